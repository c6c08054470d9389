"""One client: solo (Decoder.stream) against the scheduler, per prompt TTFT and latency, on the
1.5B int4."""

import statistics
import sys

import torch

from leapdecode import load_model
from leapdecode.api import Decoder
from leapdecode.bench.concurrent import run_concurrent, run_solo
from leapdecode.bench.datasets import load_dataset
from leapdecode.bench.runner import encode_turns
from leapdecode.engine.cost import measure_batch_cost
from leapdecode.methods import backend_for

torch.set_num_threads(2)
model = sys.argv[1] if len(sys.argv) > 1 else "qwen2.5-coder-1.5b"
n = int(sys.argv[2]) if len(sys.argv) > 2 else 12
lm = load_model(model, log=lambda m: None)
prompts = load_dataset("humaneval+spec-bench", "3,humaneval=10")
plain = Decoder(lm, "ar")
ids = [encode_turns(lm, p, lambda x: plain.generate(x, max_new_tokens=128).token_ids) for p in prompts]
ids = ids[:: max(1, len(prompts) // n)][:n]
print("prompt tokens", [len(i) for i in ids])
plain.generate(ids[0], max_new_tokens=8)
cost = measure_batch_cost(backend_for(lm), 128, 8)
ref = run_solo(plain, ids, 128, None)
for method in ("ar", "anpd"):
    d = plain if method == "ar" else Decoder(lm, method)
    d.generate(ids[0], max_new_tokens=8)
    for rep in range(2):
        s = ref if (method == "ar" and rep == 0) else run_solo(d, ids, 128, ref.outputs)
        c = run_concurrent(d, cost, ids, 128, 1, ref.outputs, 128)
        for name, r in (("solo", s), ("sched", c)):
            print(
                f"{method} {name}: {r.tokens_per_s:.1f} tok/s, ttft mean {statistics.mean(r.first_token_s):.3f}, "
                f"lat mean {statistics.mean(r.latencies_s):.3f} p50 {r.summary()['latency_p50_s']:.3f}, "
                f"passes {r.passes} rows {r.rows} ident {r.identical}",
                flush=True,
            )
