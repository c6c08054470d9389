"""One forward pass, the model's own forward against the lean forward, alternating in one process.

The 1.5B int4 target (the GGUF's blocks) by rows, chains after 300 cached tokens, and the 0.5B on
its draft path (int4, 32,768-token draft vocabulary), one row: median of 15 passes a round, two
rounds each. Usage: python lean_ab.py [threads]
"""

import sys
import time

import torch

from leapdecode.engine.backend import TorchBackend
from leapdecode.engine.draft_head import DraftHeadBackend
from leapdecode.methods import DraftModel
from leapdecode.models import load_model

torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 2)
CONTEXT, REPEATS = 300, 15
quiet = lambda message: None  # noqa: E731
target = load_model("qwen2.5-coder-1.5b", log=quiet)
method = DraftModel(model="qwen2.5-coder-0.5b")
draft = method.load_draft(target, quiet)
lean_draft = method.draft_backend(target, draft, quiet)
backends = {
    "1.5B": (
        TorchBackend(target.model, target.exact_tokens, lean=False),
        TorchBackend(target.model, target.exact_tokens),
    ),
    "0.5B draft": (
        DraftHeadBackend(draft.model, lean_draft.ids.tolist(), draft.exact_tokens, lean=False),
        lean_draft,
    ),
}
prompt = [1000 + (i * 37) % 20000 for i in range(CONTEXT)]


def median_ms(backend, rows: int) -> float:
    seq, _ = backend.prefill(prompt)
    tokens = [1234 + i for i in range(rows)]
    for _ in range(3):
        backend.forward(seq, tokens)
        backend.rollback(seq, CONTEXT)
    times = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        backend.forward(seq, tokens)
        times.append(time.perf_counter() - start)
        backend.rollback(seq, CONTEXT)
    return 1000 * sorted(times)[REPEATS // 2]


print("| model | rows | own forward, ms | lean forward, ms | lean / own |\n|---|---:|---:|---:|---:|")
with torch.inference_mode():
    for name, (own, lean) in backends.items():
        assert lean.lean is not None and lean.lean.native is not None, lean.lean_reason
        for rows in (1, 2, 4, 8) if name == "1.5B" else (1, 4):
            pairs = [(median_ms(own, rows), median_ms(lean, rows)) for _ in range(2)]
            own_ms, lean_ms = min(p[0] for p in pairs), min(p[1] for p in pairs)
            print(f"| {name} | {rows} | {own_ms:.1f} | {lean_ms:.1f} | {lean_ms / own_ms:.2f} |", flush=True)

print("\n| model | prefill of 128 tokens | own forward, ms a token | lean forward, ms a token |\n|---|---|---:|---:|")
with torch.inference_mode():
    for name, (own, lean) in backends.items():
        runs: dict[str, list[float]] = {"own": [], "lean": []}
        for _ in range(3):
            for label, backend in (("own", own), ("lean", lean)):
                start = time.perf_counter()
                backend.prefill(prompt[:128])
                runs[label].append(1000 * (time.perf_counter() - start) / 128)
        print(f"| {name} | 128 | {sorted(runs['own'])[1]:.2f} | {sorted(runs['lean'])[1]:.2f} |", flush=True)
