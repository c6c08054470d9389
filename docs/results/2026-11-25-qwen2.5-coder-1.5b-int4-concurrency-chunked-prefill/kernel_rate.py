"""The int4 model's quantized linear kernel alone: milliseconds and multiply-adds a second by rows,
for three of layer 0's layers."""

import time

import torch

from leapdecode import load_model

torch.set_num_threads(2)
lm = load_model("qwen2.5-coder-1.5b", log=lambda m: None)
layer = lm.model.model.layers[0]
mods = {
    "gate 1536->8960": layer.mlp.gate_proj,
    "down 8960->1536": layer.mlp.down_proj,
    "q 1536->1536": layer.self_attn.q_proj,
}
for name, m in mods.items():
    print(name, type(m).__name__, getattr(m, "bits", None), getattr(m, "super_blocks", None))
    for M in (1, 8, 32, 128, 256):
        x = torch.randn(M, m.in_features)
        m(x)
        reps = max(3, 200 // M)
        t = time.perf_counter()
        for _ in range(reps):
            m(x)
        dt = (time.perf_counter() - t) / reps
        macs = M * m.in_features * m.out_features / dt / 1e9
        print(f"  M={M:4d} {dt * 1000:7.2f} ms  {macs:6.1f} G MAC/s", flush=True)
