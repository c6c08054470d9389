"""A/B of a packed pass's layers: the one C++ call (`lean_packed_states`) against the Python loop
it replaces (the lean forward's ~20 calls a layer, attention through `PackedCache`), alternating
in one process, on the pass shapes many clients make and on the closed-loop load of
`bench --concurrency`. The same outputs are checked on every pass.

    python packed_ab.py [MODEL] [METHOD] [CLIENTS] [ROUNDS]
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from leapdecode.api import Decoder
from leapdecode.bench.concurrent import run_concurrent
from leapdecode.bench.datasets import load_dataset
from leapdecode.bench.runner import encode_turns
from leapdecode.engine import backend as backend_module
from leapdecode.engine.batch import BatchItem, forward_batch
from leapdecode.engine.cost import measure_batch_cost
from leapdecode.methods import backend_for
from leapdecode.models import load_model

MODEL = sys.argv[1] if len(sys.argv) > 1 else "qwen2.5-coder-1.5b"
METHOD = sys.argv[2] if len(sys.argv) > 2 else "ar"
CLIENTS = int(sys.argv[3]) if len(sys.argv) > 3 else 8
ROUNDS = int(sys.argv[4]) if len(sys.argv) > 4 else 3
DATASET = "spec-bench:multi-turn+spec-bench:translation+spec-bench:qa+spec-bench:math_reasoning"
NATIVE = backend_module.lean_packed_states


def use(native: bool) -> None:
    backend_module.lean_packed_states = NATIVE if native else (lambda *args: None)


def shapes(lm) -> None:
    """Packed passes of 8 sequences (300 cached tokens each), one row each, then with a prompt chunk."""
    backend = backend_for(lm)
    g = torch.Generator().manual_seed(0)
    rand = lambda n: torch.randint(10, 1000, (n,), generator=g).tolist()  # noqa: E731
    with torch.inference_mode():
        seqs = [backend.prefill(rand(300))[0] for _ in range(9)]
        new = rand(24)
        cases = {
            "8 sequences x 1 row": [BatchItem(s, new[:1]) for s in seqs[:8]],
            "8 x 1 + a 8-token prompt chunk": [BatchItem(s, new[:1]) for s in seqs[:8]]
            + [BatchItem(seqs[8], new[:8], last_only=True)],
            "8 x 1 + a 24-token prompt chunk": [BatchItem(s, new[:1]) for s in seqs[:8]]
            + [BatchItem(seqs[8], new[:24], last_only=True)],
            "4 sequences x 3 rows": [BatchItem(s, new[:3]) for s in seqs[:4]],
        }
        times: dict[tuple[str, bool], list[float]] = {}
        for _ in range(9):
            for name, items in cases.items():
                outs = []
                for native in (False, True):
                    use(native)
                    start = time.perf_counter()
                    outs.append(forward_batch(backend, items))
                    times.setdefault((name, native), []).append(time.perf_counter() - start)
                    for s in seqs:
                        backend.rollback(s, 300)
                assert all(torch.equal(a.logits, b.logits) for a, b in zip(*outs)), name
    print("| packed pass | Python loop, ms | one C++ call, ms | ratio |\n|---|---:|---:|---:|")
    for name in cases:
        before, after = (statistics.median(times[(name, n)]) * 1000 for n in (False, True))
        print(f"| {name} | {before:.1f} | {after:.1f} | {after / before:.2f} |")


def load(lm) -> None:
    """`bench --concurrency`'s closed loop at CLIENTS clients, alternating the two paths."""
    plain = Decoder(lm, "ar")
    prompts = [
        encode_turns(lm, p, lambda ids: plain.generate(ids, max_new_tokens=96).token_ids)
        for p in load_dataset(DATASET, 4)
    ]
    reference = [plain.generate(p, max_new_tokens=96).token_ids for p in prompts]
    decoder = plain if METHOD == "ar" else Decoder(lm, METHOD)
    decoder.generate(prompts[0], max_new_tokens=8)
    cost = measure_batch_cost(backend_for(lm), 128, CLIENTS)
    print(f"\n{METHOD}, {CLIENTS} clients, {len(prompts)} prompts, 96 new tokens: tok/s (all requests)\n")
    print("| round | Python loop | one C++ call | ratio | identical |\n|---|---:|---:|---:|---:|")
    for round_ in range(ROUNDS):
        rates = []
        for native in (False, True):
            use(native)
            result = run_concurrent(decoder, cost, prompts, 96, CLIENTS, reference, 128)
            rates.append(result.new_tokens / result.wall_s)
            assert result.identical == len(prompts)
        same = f"{len(prompts)}/{len(prompts)}"
        print(f"| {round_ + 1} | {rates[0]:.1f} | {rates[1]:.1f} | {rates[1] / rates[0]:.2f} | {same} |")


if __name__ == "__main__":
    torch.set_num_threads(2)
    model = load_model(MODEL)
    shapes(model)
    load(model)
