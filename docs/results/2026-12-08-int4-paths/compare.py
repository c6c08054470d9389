#!/usr/bin/env python
"""The 1.5B's two int4 paths side by side: the default (the GGUF's own Q4_K/Q6_K blocks) and
`quantize="int4"` (the file's weights rounded again to this engine's int4 groups). For each: the
bytes of its quantized layers, a pass of 1 and of 8 rows after 300 cached tokens (fastest of
interleaved rounds), and its greedy answers against the file's own model as llama.cpp runs it
(tokens before the first difference, of 64, on eight Spec-Bench prompts).

    python docs/results/2026-12-08-int4-paths/compare.py
"""

from __future__ import annotations

import json
import time

import torch

from leapdecode import load_model, wrap
from leapdecode.bench.datasets import load_dataset
from leapdecode.bench.runner import first_difference
from leapdecode.engine.backend import TorchBackend
from leapdecode.models.quantize import QuantizedLinear

CONTEXT = [1000 + (i * 37) % 20000 for i in range(300)]


def quantized_bytes(model: torch.nn.Module) -> int:
    return sum(m.packed.numel() * m.packed.element_size() for m in model.modules() if isinstance(m, QuantizedLinear))


def pass_ms(backend: TorchBackend, rows: int, rounds: int = 7) -> float:
    seq, _ = backend.prefill(CONTEXT)
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        backend.forward(seq, CONTEXT[:rows])
        best = min(best, time.perf_counter() - start)
        backend.rollback(seq, len(CONTEXT))
    return best * 1000


def main() -> None:
    torch.set_num_threads(2)
    paths = {
        "the GGUF's own blocks (default)": load_model("qwen2.5-coder-1.5b", log=lambda m: None),
        "int4 rounded again (quantize=int4)": load_model("qwen2.5-coder-1.5b", quantize="int4", log=lambda m: None),
    }
    reference = wrap(load_model("qwen2.5-coder-1.5b", backend="llama.cpp", log=lambda m: None), "ar")
    prompts = [p for p in load_dataset("spec-bench", limit=2) if not p.earlier][:8]
    for name, lm in paths.items():
        backend = TorchBackend(lm.model, exact_tokens=lm.exact_tokens)
        times = {rows: [] for rows in (1, 8)}
        for _ in range(2):  # interleaved rounds
            for rows in times:
                times[rows].append(pass_ms(backend, rows))
        print(
            json.dumps(
                {
                    "path": name,
                    "describe": lm.describe,
                    "quantized_bytes": quantized_bytes(lm.model),
                    "pass_ms": {rows: round(min(t), 1) for rows, t in times.items()},
                }
            ),
            flush=True,
        )
    decoders = {name: wrap(lm, "ar") for name, lm in paths.items()}
    agreement = {name: [] for name in decoders}
    for prompt in prompts:
        want = reference.generate(prompt.text, max_new_tokens=64, chat=True).token_ids
        for name, decoder in decoders.items():
            got = decoder.generate(prompt.text, max_new_tokens=64, chat=True).token_ids
            split = first_difference(got, want)
            agreement[name].append(min(len(got), len(want)) if split is None else split)
    for name, agreed in agreement.items():
        print(json.dumps({"path": name, "tokens_before_first_difference": agreed, "prompts": len(agreed)}), flush=True)


if __name__ == "__main__":
    main()
