"""One change to the quantized kernel (`leapdecode/models/quant.cpp`), built as an extension of its
own beside the tree's, against the tree's on the 1.5B's layer shapes (random weights, as many
layers as the model has, so they stream from memory): the two alternate in one process, 11 rounds,
and must give the same bits unless the variant changes them (`six-bit-floats`: not in `SAME_BITS`).

    python kernel_ab.py VARIANT ROWS...      VARIANT: six-bit-floats | prefetch-l2 | six-bit-rows-4 |
                                             six-bit-rows-6 | vector-stores
"""

from __future__ import annotations

import statistics
import sys
import time
from types import ModuleType

import torch

from leapdecode.bench.ab import build_variant
from leapdecode.models import quantize
from leapdecode.models.quantize import GROUP, QuantizedLinear, SuperScales

SIX_BIT_DOT = """    I dot[MB];
    if constexpr (BITS == 6) {  // the halves' exact dot: sc_a * (even - 32 sum(x_a)) + sc_b * (odd - 32 sum(x_b))
      const I sa = V::widen(rec, body_bytes(6), true), sb = V::widen(rec, body_bytes(6) + 8, true);
      for (int i = 0; i < MB; ++i) {
        const int32_t* off = r.off.data() + 2 * ((m0 + i) * G + g);
        dot[i] = V::add(V::mullo(V::sub(even[i], V::ints(off[0])), sa), V::mullo(V::sub(odd[i], V::ints(off[1])), sb));
      }
    } else {"""
# each half's sum in floats, times its scale: two conversions and products for two vpmulld (other bits)
SIX_BIT_FLOATS = """    I dot[MB];
    if constexpr (BITS == 6) {
      __m256 parts[B];
      for (int j = 0; j < B; ++j) parts[j] = weight_factors<BITS, SUPER>(at[j].head, rec[j], 0);
      const F d = V::join(parts);
      const F da = V::mul(d, V::to_float(V::widen(rec, body_bytes(6), true)));
      const F db = V::mul(d, V::to_float(V::widen(rec, body_bytes(6) + 8, true)));
      for (int i = 0; i < MB; ++i) {
        const int32_t* off = r.off.data() + 2 * ((m0 + i) * G + g);
        const F dx = V::floats(r.d[(m0 + i) * G + g]);
        acc[i] = V::fmadd(V::to_float(V::sub(even[i], V::ints(off[0]))), V::mul(da, dx), acc[i]);
        acc[i] = V::fmadd(V::to_float(V::sub(odd[i], V::ints(off[1]))), V::mul(db, dx), acc[i]);
      }
      continue;
    } else {"""
STORE = """  for (int i = 0; i < MB; ++i) {
    alignas(32) float lanes[kBlock];
    _mm256_store_ps(lanes, acc[i]);
    float* dst = out.y + (m0 + i) * out.stride + n0;
    for (int j = 0; j < valid; ++j) dst[j] = out.bias ? lanes[j] + out.bias[n0 + j] : lanes[j];
  }"""
VECTOR_STORE = """  for (int i = 0; i < MB; ++i) {
    float* dst = out.y + (m0 + i) * out.stride + n0;
    if (valid == kBlock) {
      _mm256_storeu_ps(dst, out.bias ? _mm256_add_ps(acc[i], _mm256_loadu_ps(out.bias + n0)) : acc[i]);
      continue;
    }
    alignas(32) float lanes[kBlock];
    _mm256_store_ps(lanes, acc[i]);
    for (int j = 0; j < valid; ++j) dst[j] = out.bias ? lanes[j] + out.bias[n0 + j] : lanes[j];
  }"""
AHEAD = "_mm_prefetch(reinterpret_cast<const char*>(next + line), _MM_HINT_T0);"
ROWS = "row_blocks<kRowBlockVnni>(M, [&](auto rows, int64_t m0) { block_vnni<"


def six_bit_rows(rows: int) -> list[tuple[str, str]]:
    """The 6-bit kernel's row blocks of `rows` (other bits keep the tree's)."""
    return [(ROWS, f"row_blocks<(BITS == 6 ? {rows} : kRowBlockVnni)>(M, [&](auto rows, int64_t m0) {{ block_vnni<")]


VARIANTS: dict[str, list[tuple[str, str]]] = {
    "six-bit-floats": [(SIX_BIT_DOT, SIX_BIT_FLOATS)],
    "prefetch-l2": [(AHEAD, AHEAD.replace("_MM_HINT_T0", "_MM_HINT_T1"))],
    "six-bit-rows-4": six_bit_rows(4),
    "six-bit-rows-6": six_bit_rows(6),
    "vector-stores": [(STORE, VECTOR_STORE)],
}
SAME_BITS = {"prefetch-l2", "six-bit-rows-4", "six-bit-rows-6", "vector-stores"}


def variant_module(name: str) -> ModuleType:
    """The kernel with variant `name`'s changes, as an extension of its own."""
    return build_variant(f"quant_{name.replace('-', '_')}", VARIANTS[name])


def four_bit(k: int, n: int, bias: bool = False) -> QuantizedLinear:
    """A random int4 layer of `k` inputs and `n` outputs."""
    return QuantizedLinear.from_weight(torch.randn(n, k) * 0.02, 4, torch.randn(n) if bias else None)


def six_bit(k: int, n: int) -> QuantizedLinear:
    """A random 6-bit layer of `k` inputs and `n` outputs, in the super-block form."""
    groups = k // GROUP
    q = torch.randint(0, 64, (n, k)).to(torch.uint8)
    sc = torch.randint(-128, 128, (n, 2 * groups)).to(torch.int8)
    return QuantizedLinear.from_groups(
        q, SuperScales(torch.rand(n, -(-groups // 8)) * 0.01, sc, per_group=2), None, 6, None
    )


def call(module: ModuleType, layer: QuantizedLinear, x: torch.Tensor) -> torch.Tensor:
    """`layer`'s product through `module`'s kernel (the tree's or a variant's)."""
    return module.quantized_linear(x, layer.packed, layer.bits, layer.super_blocks, layer.out_features, layer.bias, -1)


def main() -> None:
    name, rows_list = sys.argv[1], [int(a) for a in sys.argv[2:]] or [1, 8, 16]
    torch.manual_seed(0)
    torch.set_num_threads(2)
    new, old = variant_module(name), quantize.kernel()
    shapes = [
        ("qkv 4-bit 1536->2048", [four_bit(1536, 2048, True) for _ in range(28)]),
        ("gate+up 4-bit 1536->17920", [four_bit(1536, 17920) for _ in range(28)]),
        ("down 4-bit 8960->1536", [four_bit(8960, 1536) for _ in range(14)]),
        ("down 6-bit 8960->1536", [six_bit(8960, 1536) for _ in range(14)]),
        ("head 6-bit 1536->151936", [six_bit(1536, 151936)]),
    ]
    for label, layers in shapes:
        for rows in rows_list:
            x = torch.randn(rows, layers[0].in_features)

            same = all(torch.equal(call(old, layer, x), call(new, layer, x)) for layer in layers)
            assert same or name not in SAME_BITS, f"{name} changed the bits"
            times: dict[str, list[float]] = {"tree": [], name: []}
            for r in range(11):
                order = [("tree", old), (name, new)] if r % 2 else [(name, new), ("tree", old)]
                for tag, module in order:
                    start = time.perf_counter()
                    for layer in layers:
                        call(module, layer, x)
                    times[tag].append(time.perf_counter() - start)
            ratio = statistics.median(a / b for a, b in zip(times[name], times["tree"]))
            macs = rows * layers[0].in_features * layers[0].out_features * len(layers)
            tree = statistics.median(times["tree"])
            print(
                f"{label:26s} rows {rows:3d}  tree {tree * 1e3:7.2f} ms ({macs / tree / 1e9:4.0f} G/s)  "
                f"{name} / tree {ratio:.3f}  {'same bits' if same else 'other bits'}",
                flush=True,
            )


if __name__ == "__main__":
    main()
