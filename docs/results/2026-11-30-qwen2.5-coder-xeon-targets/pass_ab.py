"""The whole lean pass on one change to the quantized kernel (`leapdecode/models/quant.cpp`), built
with `lean.cpp` and `row_exact.cpp` as an extension of its own, against the tree's: the 0.5B's
one-token pass on its draft path and the 1.5B's at 1, 4 and 8 rows, after 300 cached tokens,
alternating in one process (15 rounds of 10 passes, median of the paired ratios), and whether the
logits are the same bits.

    python pass_ab.py VARIANT     VARIANT: same (the tree's source built again: the noise) |
                                  dynamic-split (threads take blocks of output rows from a shared
                                  counter, 8 chunks a thread, instead of a half each) |
                                  nta-prefetch (the weight stream prefetched non-temporally)
"""

from __future__ import annotations

import dataclasses
import gc
import statistics
import sys
import time
from types import ModuleType

import torch

from leapdecode.bench.ab import build_variant
from leapdecode.bench.probes import CONTEXT, draft_path
from leapdecode.engine.backend import TorchBackend

SPLIT = """  at::parallel_for(0, first.back(), 4, [&](int64_t b0, int64_t b1) {
    for (size_t i = 0; i < ps.size(); ++i) {"""
DYNAMIC_SPLIT = """  const int64_t total_blocks = first.back(), threads = at::get_num_threads();
  const int64_t chunk = std::max<int64_t>(4, total_blocks / (8 * threads) + 1);
  std::atomic<int64_t> next_block{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
   for (;;) {
    const int64_t b0 = next_block.fetch_add(chunk, std::memory_order_relaxed);
    if (b0 >= total_blocks) break;
    const int64_t b1 = std::min(b0 + chunk, total_blocks);
    for (size_t i = 0; i < ps.size(); ++i) {"""
SPLIT_END = """        blocks_portable(rows, p.packed, BITS, SUPER, out, M, K, lo, hi);
      });
    }
  });"""
DYNAMIC_SPLIT_END = """        blocks_portable(rows, p.packed, BITS, SUPER, out, M, K, lo, hi);
      });
    }
   }
  });"""
VARIANTS: dict[str, list[tuple[str, str]]] = {
    "same": [],
    "dynamic-split": [
        (SPLIT, DYNAMIC_SPLIT),
        (SPLIT_END, DYNAMIC_SPLIT_END),
        ("#include <algorithm>", "#include <algorithm>\n#include <atomic>"),
    ],
    "nta-prefetch": [("_MM_HINT_T0", "_MM_HINT_NTA")],
}


def variant_module(name: str) -> ModuleType:
    """The lean pass's extension (`lean.cpp` with the kernels it calls) with variant `name`'s changes."""
    sources, defines = ("lean.cpp", "quant.cpp", "row_exact.cpp"), ("LEAPDECODE_NO_MODULE",)
    return build_variant(f"lean_{name.replace('-', '_')}", VARIANTS[name], sources, defines)


def main() -> None:
    torch.set_num_threads(2)
    name = sys.argv[1]
    target, draft = draft_path()
    plain = TorchBackend(target.model, exact_tokens=target.exact_tokens)
    module = variant_module(name)
    gc.collect()
    gc.freeze()
    cases = (
        ("0.5B draft, 1 row", draft, 1),
        ("1.5B, 1 row", plain, 1),
        ("1.5B, 4 rows", plain, 4),
        ("1.5B, 8 rows", plain, 8),
    )
    for label, backend, rows in cases:
        assert backend.lean is not None and backend.lean.native is not None
        tree = backend.lean.native
        sides = {"tree": tree, name: dataclasses.replace(tree, module=module)}
        tokens = [1234 + i for i in range(rows)]
        times: dict[str, list[float]] = {tag: [] for tag in sides}
        with torch.inference_mode():
            seq, _ = backend.prefill(CONTEXT)
            logits = {}
            for tag, native in sides.items():
                backend.lean.native = native
                logits[tag] = backend.forward(seq, tokens).logits
                backend.rollback(seq, len(CONTEXT))
            same = torch.equal(logits["tree"], logits[name])
            for r in range(15):
                for tag in sorted(sides, reverse=bool(r % 2)):
                    backend.lean.native = sides[tag]
                    start = time.perf_counter()
                    for _ in range(10):
                        backend.forward(seq, tokens)
                        backend.rollback(seq, len(CONTEXT))
                    times[tag].append((time.perf_counter() - start) / 10)
        backend.lean.native = tree
        ratio = statistics.median(a / b for a, b in zip(times[name], times["tree"]))
        print(
            f"{label:18s} tree {statistics.median(times['tree']) * 1e3:6.2f} ms  "
            f"{name} / tree {ratio:.3f}  {'same bits' if same else 'other bits'}",
            flush=True,
        )


if __name__ == "__main__":
    main()
