"""The 1.5B's one-row pass with its packed weights as loaded (a huge-page copy per layer: each
layer's tail past its last whole 2 MiB page, and every layer under 2 MiB, in 4 KiB pages) against
the same weights moved into one huge-page arena: two models in one process, their passes
alternating (40 each, after 300 cached tokens), the scores bitwise equal.

    python arena_ab.py [ROWS]
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from leapdecode.bench.probes import CONTEXT
from leapdecode.engine.backend import TorchBackend
from leapdecode.models import load_model, quantize
from leapdecode.models.quantize import QuantizedLinear


def huge_pages() -> tuple[float, float]:
    """MB of this process's anonymous memory in huge pages, and in all."""
    fields = {}
    for line in open("/proc/self/smaps_rollup"):
        key, _, value = line.partition(":")
        fields[key] = int(value.split()[0]) / 1024 if value.strip().endswith("kB") else 0
    return fields["AnonHugePages"], fields["Anonymous"]


def into_arena(model: torch.nn.Module) -> torch.Tensor:
    """Every quantized layer's packed weights copied into one huge-page buffer (64-byte aligned
    each), the layers reading views of it: the returned buffer."""
    layers = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    sizes = [(layer.packed.numel() + 63) // 64 * 64 for layer in layers]
    arena = quantize.kernel().huge_page_copy(torch.empty(sum(sizes), dtype=torch.uint8))
    at = 0
    for layer, size in zip(layers, sizes):
        view = arena[at : at + layer.packed.numel()].view(layer.packed.shape)
        view.copy_(layer.packed)
        layer.packed = view
        at += size
    return arena


def main() -> None:
    torch.set_num_threads(2)
    rows = int(sys.argv[1]) if len(sys.argv) > 1 else 1
    quiet = lambda message: None  # noqa: E731
    lm_a = load_model("qwen2.5-coder-1.5b", log=quiet)
    print("as loaded: huge-page MB, anonymous MB", huge_pages())
    lm_b = load_model("qwen2.5-coder-1.5b", log=quiet)
    arena = into_arena(lm_b.model)
    print("second model in one arena:", huge_pages(), f"(arena {arena.numel() / 2**20:.0f} MB)")
    backends = {
        "per layer": TorchBackend(lm_a.model, exact_tokens=lm_a.exact_tokens),
        "arena": TorchBackend(lm_b.model, exact_tokens=lm_b.exact_tokens),
    }
    times: dict[str, list[float]] = {name: [] for name in backends}
    tokens = [1234 + i for i in range(rows)]
    with torch.inference_mode():
        seqs = {name: b.prefill(CONTEXT)[0] for name, b in backends.items()}
        scores = {}
        for name, b in backends.items():
            scores[name] = b.forward(seqs[name], tokens).logits
            b.rollback(seqs[name], 300)
        assert torch.equal(scores["per layer"], scores["arena"])
        for r in range(40):
            for name, b in list(backends.items())[:: 1 if r % 2 == 0 else -1]:
                start = time.perf_counter()
                b.forward(seqs[name], tokens)
                times[name].append(time.perf_counter() - start)
                b.rollback(seqs[name], 300)
    for name, seconds in times.items():
        print(
            f"{name:10s} rows {rows}: median {statistics.median(seconds) * 1e3:6.2f} ms, "
            f"best {min(seconds) * 1e3:6.2f} ms"
        )
    paired = statistics.median(a / b for a, b in zip(times["arena"], times["per layer"]))
    print(f"arena / per layer, paired median {paired:.3f}")


if __name__ == "__main__":
    main()
