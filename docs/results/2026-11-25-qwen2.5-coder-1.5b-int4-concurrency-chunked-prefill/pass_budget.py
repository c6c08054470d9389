"""Eight clients, `ar` and `anpd`, the 28 bench prompts (128 new tokens): per pass, the predicted
cost (the curve at 64 tokens of context) against the measured seconds, split into passes that carry
a prompt chunk and passes that only decode."""

import time

import torch

from leapdecode import load_model
from leapdecode.api import Decoder
from leapdecode.bench.concurrent import run_concurrent
from leapdecode.bench.datasets import load_dataset
from leapdecode.bench.runner import encode_turns
from leapdecode.engine import scheduler as S
from leapdecode.engine.cost import allocate as orig_alloc
from leapdecode.engine.cost import measure_batch_cost
from leapdecode.methods import backend_for

torch.set_num_threads(2)
lm = load_model("qwen2.5-coder-1.5b", log=lambda m: None)
plain = Decoder(lm, "ar")
prompts = load_dataset("humaneval+spec-bench", "3,humaneval=10")
ids = [encode_turns(lm, p, lambda i: plain.generate(i, max_new_tokens=128).token_ids) for p in prompts]
print("prompt tokens", sum(map(len, ids)), "mean", sum(map(len, ids)) / len(ids), flush=True)
cost = measure_batch_cost(backend_for(lm), 128, 8)
rec = {}


def alloc(offers, caps, base_rows, decoding, c, budget):
    kept = orig_alloc(offers, caps, base_rows, decoding, c, budget)
    reach = sum(o.reach[t] for o, k in zip(offers, kept) if o is not None and o.reach for t in k)
    rec["exp"] = reach
    rec["drafts"] = sum(map(len, kept))
    rec["offered"] = sum(len(o.draft) for o in offers if o is not None)
    return kept


S.allocate = alloc
orig_fb = S.forward_batch
passes = []


def fb(backend, items, features=()):
    t = time.perf_counter()
    out = orig_fb(backend, items, features)
    dt = time.perf_counter() - t
    passes.append(
        dict(
            seqs=len(items),
            rows=sum(len(i.tokens) for i in items),
            prefill=sum(len(i.tokens) for i in items if i.last_only),
            s=dt,
            pred=cost.of(sum(len(i.tokens) for i in items)),
            **rec,
        )
    )
    rec.clear()
    return out


S.forward_batch = fb
for method in ("ar", "anpd"):
    d = Decoder(lm, method)
    d.generate(ids[0], max_new_tokens=8)
    passes.clear()
    r = run_concurrent(d, cost, ids, 128, 8, [[] for _ in ids], 128)
    n = len(passes)
    fs = sum(p["s"] for p in passes)
    dec = [p for p in passes if p["prefill"] == 0]
    print(
        method,
        f"tok/s {r.new_tokens / r.wall_s:.1f} wall {r.wall_s:.1f} forward {fs:.1f} passes {n} decode-only {len(dec)}",
        flush=True,
    )
    print(
        "  decode-only: mean rows",
        sum(p["rows"] for p in dec) / max(1, len(dec)),
        "seconds",
        sum(p["s"] for p in dec),
        "pred",
        sum(p["pred"] for p in dec),
    )
    print(
        "  prefill passes: seconds",
        sum(p["s"] for p in passes if p["prefill"]),
        "pred",
        sum(p["pred"] for p in passes if p["prefill"]),
    )
