"""Where a pass of qwen2.5-coder-1.5b int4 goes, by rows (1-64): each linear layer type, attention,
the norms, and the rest (rotary, activations, residuals, the cache, Python), against the ideal.

    python pass_profile.py [THREADS] [target|draft]

`draft`: the 0.5B on its draft path instead (int4, its head too, the 32,768-token draft
vocabulary: `draft:model=qwen2.5-coder-0.5b`'s defaults), 1-8 rows.

A chain of R tokens after 300 cached tokens, through the backend the decode loop uses, median of
9 passes per row count. Each part is timed around its own call (the quantized kernel by layer
type, the row-exact attention and RMS norm kernels); "rest" is the pass less those. The ideal of
a linear layer type is the larger of its bytes over the machine's read bandwidth and its int8
multiply-adds over the kernel's own best rate (both measured here first: a 1 GiB read with
every thread; the gate projection at 64 rows on weights that stay in cache).
"""

from __future__ import annotations

import json
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch

from leapdecode.engine.backend import TorchBackend
from leapdecode.engine.draft_head import DraftHeadBackend
from leapdecode.methods import DraftModel
from leapdecode.models import load_model
from leapdecode.models import row_exact as row_exact_module
from leapdecode.models.quantize import QuantizedLinear

CONTEXT, REPEATS, ROWS = 300, 9, (1, 2, 4, 8, 16, 32, 64)
TYPES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head")


def read_bandwidth() -> float:
    """Bytes a second the threads read from memory (a sum over 1 GiB, best of 5)."""
    data = torch.ones(2**28, dtype=torch.float32)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - start)
    return data.numel() * 4 / best


def kernel_peak() -> float:
    """Multiply-adds a second of the int4 kernel at 64 rows, weights in cache (896 x 4864)."""
    layer = QuantizedLinear.from_weight(torch.randn(4864, 896), 4)
    x = torch.randn(64, 896)
    with torch.inference_mode():
        for _ in range(20):
            layer(x)
        start = time.perf_counter()
        for _ in range(200):
            layer(x)
    return 64 * 896 * 4864 * 200 / (time.perf_counter() - start)


class Timers:
    """Seconds spent in each wrapped call during the timed passes."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.on = False

    def wrap(self, owner: Any, attribute: str, key: str) -> None:
        inner: Callable[..., Any] = getattr(owner, attribute)

        def timed(*args: Any, **kwargs: Any) -> Any:
            if not self.on:
                return inner(*args, **kwargs)
            start = time.perf_counter()
            out = inner(*args, **kwargs)
            self.seconds[key] += time.perf_counter() - start
            return out

        setattr(owner, attribute, timed)


def main() -> None:
    torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 2)
    bandwidth, peak = read_bandwidth(), kernel_peak()
    quiet = lambda message: None  # noqa: E731
    draft = len(sys.argv) > 2 and sys.argv[2] == "draft"
    lm = load_model("qwen2.5-coder-1.5b", log=quiet)
    backend = TorchBackend(lm.model, exact_tokens=lm.exact_tokens)
    modules = list(lm.model.named_modules())
    if draft:
        method = DraftModel(model="qwen2.5-coder-0.5b")
        backend = method.draft_backend(lm, method.load_draft(lm, quiet), quiet)
        # with a draft vocabulary the body's own head is not run: the vocabulary's rows score
        unused = backend.model.get_output_embeddings() if isinstance(backend, DraftHeadBackend) else None
        modules = [(n, m) for n, m in backend.model.named_modules() if m is not unused]
        if isinstance(backend, DraftHeadBackend):
            modules.append(("lm_head", backend.head))
    timers = Timers()
    sizes: dict[str, tuple[int, int]] = defaultdict(lambda: (0, 0))  # type -> (bytes, weights) per pass
    for name, module in modules:
        if isinstance(module, QuantizedLinear):
            kind = name.rsplit(".", 1)[-1]
            timers.wrap(module, "forward", kind)
            nbytes, weights = sizes[kind]
            sizes[kind] = (nbytes + module.packed.numel(), weights + module.in_features * module.out_features)
    compiled = row_exact_module.kernel()
    timers.wrap(compiled, "row_exact_attention", "attention")
    timers.wrap(compiled, "rms_norm", "norms")
    rows_out = []
    with torch.inference_mode():
        seq, _ = backend.prefill([1000 + (i * 37) % 20000 for i in range(CONTEXT)])
        for rows in ROWS[:4] if draft else ROWS:
            tokens = [1234 + i for i in range(rows)]
            for _ in range(2):
                backend.forward(seq, tokens)
                backend.rollback(seq, CONTEXT)
            passes: list[float] = []
            parts: list[dict[str, float]] = []
            for _ in range(REPEATS):
                timers.seconds.clear()
                timers.on = True
                start = time.perf_counter()
                backend.forward(seq, tokens)
                passes.append(time.perf_counter() - start)
                timers.on = False
                parts.append(dict(timers.seconds))
                backend.rollback(seq, CONTEXT)
            middle = sorted(range(REPEATS), key=lambda i: passes[i])[REPEATS // 2]
            part = parts[middle]
            total = passes[middle]
            rest = total - sum(part.values())
            ideal = {kind: max(nbytes / bandwidth, rows * weights / peak) for kind, (nbytes, weights) in sizes.items()}
            rows_out.append({"rows": rows, "ms": 1000 * total, "parts_ms": {k: 1000 * v for k, v in part.items()},
                             "rest_ms": 1000 * rest, "ideal_ms": {k: 1000 * v for k, v in ideal.items()}})  # fmt: skip
    one = rows_out[0]["ms"]
    print(f"read bandwidth {bandwidth / 1e9:.1f} GB/s; kernel peak {peak / 1e9:.0f} G multiply-adds/s\n")
    print("| rows | pass ms | × one row | " + " | ".join(TYPES) + " | attention | norms | rest | linear ideal |")
    print("|---:|---:|---:|" + "---:|" * (len(TYPES) + 4))
    for r in rows_out:
        cells = [f"{r['parts_ms'].get(kind, 0.0):.1f}" for kind in TYPES]
        print(
            f"| {r['rows']} | {r['ms']:.1f} | {r['ms'] / one:.2f} | " + " | ".join(cells)
            + f" | {r['parts_ms'].get('attention', 0.0):.1f} | {r['parts_ms'].get('norms', 0.0):.1f}"
            + f" | {r['rest_ms']:.1f} | {sum(r['ideal_ms'].values()):.1f} |"
        )  # fmt: skip
    print("\nideal ms by type (bytes / bandwidth or multiply-adds / peak, the larger):")
    for r in rows_out:
        print(r["rows"], {k: round(v, 2) for k, v in r["ideal_ms"].items()})
    print(json.dumps({"bandwidth": bandwidth, "peak": peak, "sizes": dict(sizes), "rows": rows_out}))


if __name__ == "__main__":
    main()
