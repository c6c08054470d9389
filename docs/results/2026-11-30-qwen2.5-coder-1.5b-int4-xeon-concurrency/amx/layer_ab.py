"""The AMX path (`amx.patch`, applied to commit 3ddd193: `git apply`) against the VNNI kernel on the
1.5B's layer shapes, weights in cache, in one process: the two paths alternate, best of 5 (3 calls
each), and give the same bits. Usage: python layer_ab.py"""

import time

import torch

from leapdecode.models.quantize import AMX, AVX512_VNNI, QuantizedLinear

torch.manual_seed(0)
SHAPES = [("gate+up int4", 1536, 17920, 4), ("down int4", 8960, 1536, 4), ("down int8", 8960, 1536, 8)]
for name, k, n, bits in SHAPES:
    layer = QuantizedLinear.from_weight(torch.randn(n, k) * 0.02, bits, None)
    for rows in (1, 2, 4, 8, 16, 32, 64, 128):
        x = torch.randn(rows, k)
        outs = {}
        for isa in (AVX512_VNNI, AMX):
            layer.isa = isa
            outs[isa] = layer(x)
        assert torch.equal(outs[AVX512_VNNI], outs[AMX])
        best = {AVX512_VNNI: 1e9, AMX: 1e9}
        for _ in range(5):
            for isa in (AVX512_VNNI, AMX):
                layer.isa = isa
                start = time.perf_counter()
                for _ in range(3):
                    layer(x)
                best[isa] = min(best[isa], (time.perf_counter() - start) / 3)
        vnni, amx = best[AVX512_VNNI], best[AMX]
        macs = rows * k * n / 1e9
        print(
            f"{name:14s} M={rows:4d}  vnni {vnni * 1e3:7.2f} ms {macs / vnni:6.0f} G/s"
            f"   amx {amx * 1e3:7.2f} ms {macs / amx:6.0f} G/s  ratio {amx / vnni:.2f}",
            flush=True,
        )
