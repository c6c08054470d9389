"""Where a method's time goes at eight clients: draft rounds, catch-up feeds, target passes.

Usage: python eight_clients_time.py METHOD. The 16 chat prompts of the bench runs here (4 each of
Spec-Bench's multi-turn, translation, QA and math), 96 new tokens, greedy: plain decoding's
references, the shared passes' cost curve, four requests alone (as the bench's solo cells run
before: live costs and kept draft caches), then one round of eight closed-loop clients
(`run_concurrent`), with the draft rounds (`drive_rounds`), the draft model's packed feeds and
the target's shared passes timed and counted in place. Every output must equal plain decoding's.
"""

import sys
import time

import torch

import leapdecode
from leapdecode.api import Decoder
from leapdecode.bench.concurrent import run_concurrent
from leapdecode.bench.datasets import load_dataset
from leapdecode.bench.runner import encode_turns
from leapdecode.engine import batch, pass_plan, scheduler
from leapdecode.engine.cost import measure_batch_cost
from leapdecode.methods import backend_for

tally = {
    "draft_s": 0.0,
    "rounds": 0,
    "feeds": 0,
    "feed_tokens": 0,
    "long_feeds": 0,
    "long_tokens": 0,
    "target_s": 0.0,
    "passes": 0,
    "rows": 0,
    "offers": 0,
    "drafted": 0,
    "unpriced": 0,
}

orig_drive = pass_plan.drive_rounds


def drive(backend, rounds):
    start = time.perf_counter()
    out = orig_drive(backend, rounds)
    tally["draft_s"] += time.perf_counter() - start
    for o in out:
        if not isinstance(o, Exception):
            tally["offers"] += 1
            tally["drafted"] += len(o.draft)
            tally["unpriced"] += o.reach is None and len(o.draft) > 0
    return out


pass_plan.drive_rounds = drive

orig_packed = batch._packed_answers


def packed(backend, feeds):
    tally["rounds"] += 1
    for f in feeds.values():
        n = len(f.tokens)
        tally["feeds"] += 1
        tally["feed_tokens"] += n
        if n > 2:
            tally["long_feeds"] += 1
            tally["long_tokens"] += n
    return orig_packed(backend, feeds)


batch._packed_answers = packed

orig_fb = scheduler.forward_batch


def fb(backend, items, wanted=()):
    start = time.perf_counter()
    out = orig_fb(backend, items, wanted)
    tally["target_s"] += time.perf_counter() - start
    tally["passes"] += 1
    tally["rows"] += sum(len(i.tokens) for i in items)
    return out


scheduler.forward_batch = fb

torch.set_num_threads(2)
method = sys.argv[1]
lm = leapdecode.load_model("qwen2.5-coder-1.5b")
plain = Decoder(lm, "ar")
spec = "spec-bench:multi-turn+spec-bench:translation+spec-bench:qa+spec-bench:math_reasoning"
ids = [encode_turns(lm, p, lambda x: plain.generate(x, max_new_tokens=96).token_ids) for p in load_dataset(spec, 4)]
ref = [plain.generate(x, max_new_tokens=96).token_ids for x in ids]
cost = measure_batch_cost(backend_for(lm), 128, 8)
dec = Decoder(lm, method)
dec.generate(ids[0], max_new_tokens=8)
for x in ids[:4]:  # alone first, as the bench's solo cells: live costs and kept draft caches
    dec.generate(x, max_new_tokens=96)
for k in tally:
    tally[k] = 0 if isinstance(tally[k], int) else 0.0
r = run_concurrent(dec, cost, ids, 96, 8, ref, 128)
print(method, f"{r.tokens_per_s:.1f} tok/s, wall {r.wall_s:.1f} s, identical {r.identical}/{r.requests}")
print({k: (round(v, 2) if isinstance(v, float) else v) for k, v in tally.items()})
