"""Whether the int4 kernel waits on memory or on its own instructions at a few rows.

Usage: python hot_layers.py [THREADS] (default 2). For each kind of `qwen2.5-coder-1.5b`'s 1536-wide quantized layers
(the model's default int4 path), at 1, 4, 8 and 16 rows: every layer of the kind once (`stream`:
each weight read from memory once a round), and its first layer as many times (`hot`: the same
weights each call, resident in the caches). Median of 5 rounds after one; G multiply-adds a second.
Where the two agree, the products, not the weight stream, bound the layer.
"""

import statistics
import sys
import time

import torch

import leapdecode
from leapdecode.bench.layer_cost import layer_kinds


def main() -> None:
    torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 2)
    model = leapdecode.load_model("qwen2.5-coder-1.5b").model
    with torch.inference_mode():
        for kind, layers in layer_kinds(model).items():
            if kind.in_features != 1536:
                continue
            for rows in (1, 4, 8, 16):
                x = torch.randn(rows, kind.in_features)  # [rows, in]
                cells = []
                for name, calls in (("stream", layers), ("hot", [layers[0]] * len(layers))):
                    times = []
                    for _ in range(6):
                        start = time.perf_counter()
                        for layer in calls:
                            layer(x)
                        times.append(time.perf_counter() - start)
                    seconds = statistics.median(times[1:])
                    cells.append(f"{name} {seconds * 1e3:6.1f} ms {kind.macs(rows) / seconds / 1e9:5.0f} G/s")
                print(f"{kind.label:<24} {rows:>2} rows  " + "  ".join(cells), flush=True)


if __name__ == "__main__":
    main()
