"""Run token-id prompts through one vLLM engine, with or without one of our proposers, and report
outputs, timings and vLLM's own speculative-decoding counters (the tests and `vllm-bench` use it).

Each call starts one engine in its own process (`python -m leapdecode.integrations.vllm_run`,
JSON in on stdin, JSON out on the last line of stdout): vLLM engines hold threads, memory and
global state that a second engine in the same process should not meet.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

# vLLM's own settings for a CPU machine shared with other work (its environment variables, read
# by vLLM; set only in the engine's process, and only where the caller left them unset).
VLLM_CPU_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB of KV cache
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",  # do not pin threads to cores (containers, shared machines)
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # engine core in this process: starts faster
}
SPEC_COUNTERS = (
    "vllm:spec_decode_num_drafts",
    "vllm:spec_decode_num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens",
)


@dataclass
class VllmRun:
    """What one engine run asks for."""

    model: str  # a folder or hub id (`models.huggingface_source` resolves presets)
    prompts: list[list[int]]
    max_tokens: list[int]
    method: str | None = None  # one of our methods (`vllm_setup.VLLM_METHODS`); None: no speculation
    speculative_config: dict[str, Any] | None = None  # vLLM's own proposers (`{"method": "ngram", ...}`)
    concurrency: int = 8  # requests in flight at once (vLLM's max_num_seqs)
    one_at_a_time: bool = False  # submit each prompt after the previous one finished
    dtype: str = "float32"
    max_model_len: int = 4096
    threads: int = 0  # torch threads (0: vLLM's default)


@dataclass
class VllmResult:
    outputs: list[list[int]]
    seconds: float  # wall time of the timed generation
    latencies: list[float]  # per request: queued to last token
    counters: dict[str, float] = field(default_factory=dict)  # SPEC_COUNTERS over the timed part
    spec_steps: list[int] = field(default_factory=list)  # per request: steps that verified a draft
    accepted: list[int] = field(default_factory=list)  # per request: drafted tokens accepted

    @property
    def new_tokens(self) -> int:
        return sum(len(o) for o in self.outputs)

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per draft-verifying step: 1 + accepted drafted tokens per draft (vLLM's
        'mean acceptance length'); 1.0 without speculation."""
        drafts = self.counters.get("vllm:spec_decode_num_drafts", 0.0)
        return 1.0 + self.counters.get("vllm:spec_decode_num_accepted_tokens", 0.0) / drafts if drafts else 1.0

    @property
    def latency_p50(self) -> float:
        return statistics.median(self.latencies) if self.latencies else 0.0


def run_in_subprocess(run: VllmRun, python: str = sys.executable, timeout: float = 1800.0) -> VllmResult:
    """Start an engine in a fresh process of `python` (which must have the `vllm` extra), run."""
    env = {**VLLM_CPU_ENV, **os.environ}
    proc = subprocess.run(
        [python, "-m", __name__],
        input=json.dumps(asdict(run)),
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
        check=False,
    )
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"the vLLM run failed (exit {proc.returncode}): {proc.stderr[-3000:]}")
    return VllmResult(**json.loads(lines[-1]))


def run_here(run: VllmRun) -> VllmResult:
    """Start an engine in this process and run the prompts (greedy)."""
    from vllm import LLM, SamplingParams, TokensPrompt

    from leapdecode.integrations.vllm_setup import vllm_engine_args

    if run.threads:
        import torch

        torch.set_num_threads(run.threads)
    extra: dict[str, Any] = vllm_engine_args(run.method) if run.method else {}
    if run.speculative_config is not None:
        extra["speculative_config"] = run.speculative_config
    if extra:
        extra["per_request_spec_decode_metrics"] = "summary"
    llm = LLM(
        model=run.model,
        dtype=run.dtype,
        enforce_eager=True,
        disable_log_stats=False,
        seed=0,
        max_num_seqs=run.concurrency,
        max_model_len=run.max_model_len,
        **extra,
    )
    llm.generate(
        [TokensPrompt(prompt_token_ids=run.prompts[0][:16])],
        SamplingParams(temperature=0, max_tokens=4),
        use_tqdm=False,
    )  # warm-up
    before = _counters(llm)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in run.prompts]
    params = [SamplingParams(temperature=0, max_tokens=m) for m in run.max_tokens]
    start = time.perf_counter()
    if run.one_at_a_time:
        results = [llm.generate([p], [s], use_tqdm=False)[0] for p, s in zip(prompts, params, strict=True)]
    else:
        results = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    after = _counters(llm)
    latencies = [r.metrics.last_token_ts - r.metrics.queued_ts for r in results if r.metrics is not None]
    spec = [r.outputs[0].spec_decode_metrics for r in results]
    return VllmResult(
        outputs=[list(r.outputs[0].token_ids) for r in results],
        seconds=seconds,
        latencies=latencies,
        counters={k: after.get(k, 0.0) - before.get(k, 0.0) for k in SPEC_COUNTERS},
        spec_steps=[sum(m.histogram) if m else 0 for m in spec],
        accepted=[sum(j * c for j, c in enumerate(m.histogram)) if m else 0 for m in spec],
    )


def _counters(llm: Any) -> dict[str, float]:
    return {m.name: float(m.value) for m in llm.get_metrics() if m.name in SPEC_COUNTERS}


def main() -> None:
    for key, value in VLLM_CPU_ENV.items():
        os.environ.setdefault(key, value)
    run = VllmRun(**json.loads(sys.stdin.read()))
    result = run_here(run)
    print(json.dumps(asdict(result)), flush=True)


if __name__ == "__main__":
    main()
