"""`bench --concurrency`'s chat load with and without the prefix cache, taking turns in one process.

The load of `bench --concurrency` (4 prompts each of Spec-Bench's multi-turn, translation, QA
and math; a second turn after the first and plain decoding's answer; 96 new tokens, greedy),
served to CLIENTS closed-loop clients through the scheduler, plain rows and the default method,
each with `serve`'s prefix cache (8,192 tokens) and without, in alternating order for ROUNDS
rounds; then `llama-server` with a slot per client, with `cache_prompt` and without. Every
engine output is checked against plain decoding's alone.

    python concurrency_ab.py [CLIENTS] [ROUNDS]
"""

from __future__ import annotations

import statistics
import sys

import torch

from leapdecode.api import Decoder
from leapdecode.bench.concurrent import run_concurrent
from leapdecode.bench.datasets import load_dataset
from leapdecode.bench.llamacpp_server import gguf_of, run_llama_server
from leapdecode.bench.runner import encode_turns
from leapdecode.engine.cost import measure_batch_cost
from leapdecode.methods import backend_for
from leapdecode.models import default_cache_dir, load_model

DATASETS = "spec-bench:multi-turn+spec-bench:translation+spec-bench:qa+spec-bench:math_reasoning"
NEW_TOKENS = 96
MAX_ROWS = 128
PREFIX_CACHE_TOKENS = 8192


def main() -> None:
    torch.set_num_threads(2)
    clients = int(sys.argv[1]) if len(sys.argv) > 1 else 8
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 2
    lm = load_model("qwen2.5-coder-1.5b", log=lambda message: None)
    plain = Decoder(lm, "ar")
    prompts = [
        encode_turns(lm, p, lambda ids: plain.generate(ids, max_new_tokens=NEW_TOKENS).token_ids)
        for p in load_dataset(DATASETS, 4)
    ]
    reference = [plain.generate(p, max_new_tokens=NEW_TOKENS).token_ids for p in prompts]
    print(f"{len(prompts)} prompts, {sum(map(len, prompts))} prompt tokens", flush=True)
    cost = measure_batch_cost(backend_for(lm), MAX_ROWS, clients)
    decoders = {"ar": plain, "default": Decoder(lm)}
    decoders["default"].generate(prompts[0], max_new_tokens=8)  # warm
    print("| round | method | prefix cache | tok/s | first token p50 s | identical |\n|---|---|---|---:|---:|---:|")
    for round_ in range(rounds):
        for name, decoder in decoders.items():
            for tokens in (PREFIX_CACHE_TOKENS, 0) if round_ % 2 == 0 else (0, PREFIX_CACHE_TOKENS):
                result = run_concurrent(
                    decoder, cost, prompts, NEW_TOKENS, clients, reference, MAX_ROWS, prefix_cache_tokens=tokens
                )
                print(
                    f"| {round_ + 1} | {name} | {'on' if tokens else 'off'} | {result.tokens_per_s:.1f} | "
                    f"{statistics.median(result.first_token_s):.2f} | {result.identical}/{result.requests} |",
                    flush=True,
                )
    gguf = gguf_of("qwen2.5-coder-1.5b", default_cache_dir())
    for cache_prompt in (True, False):
        result = run_llama_server(
            gguf, prompts, NEW_TOKENS, clients, reference, torch.get_num_threads(), cache_prompt=cache_prompt
        )
        print(
            f"| - | llama-server | {'on' if cache_prompt else 'off'} | {result.tokens_per_s:.1f} | "
            f"{statistics.median(result.first_token_s):.2f} | {result.identical}/{result.requests} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
