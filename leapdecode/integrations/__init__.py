"""Other engines running leapdecode's drafters: vLLM (`vllm`, needs the `vllm` extra; `vllm_setup`,
`slots` and `vllm_run` import no vLLM)."""
