"""Where the draft model's work goes with N clients at once: how many requests start it (its
prompt prefill), its passes, the steps a suffix match drafted instead, and each step's decision
on its first drafted token (requests sharing the passes, whether its cache had started, whether
the token paid, whether it was a probe). Plain rows (`ar`) run before and after under the same
load, on the same scheduler curve.

    python draft_load.py N        # N clients, the 12 chat prompts of the concurrency runs, 96 tokens

A measurement script: it wraps two of the drafter's methods to count them.
"""

import sys
from collections import Counter

import torch

import leapdecode.drafters.draft_model as dm
from leapdecode.api import Decoder
from leapdecode.bench.concurrent import run_concurrent
from leapdecode.bench.datasets import load_dataset
from leapdecode.bench.runner import encode_turns
from leapdecode.engine.cost import measure_batch_cost
from leapdecode.models import load_model

torch.set_num_threads(2)
N = int(sys.argv[1])
lm = load_model("qwen2.5-coder-1.5b", log=lambda m: None)
D = "spec-bench:multi-turn+spec-bench:translation+spec-bench:qa+spec-bench:math_reasoning"
plain = Decoder(lm, "ar")
ids = [encode_turns(lm, p, lambda ids: plain.generate(ids, max_new_tokens=96).token_ids) for p in load_dataset(D, 3)]
print("prompt lengths", [len(i) for i in ids])
ref = [plain.generate(i, max_new_tokens=96).token_ids for i in ids]
dec = Decoder(lm, "draft:model=qwen2.5-coder-0.5b")
dec.generate(ids[0], max_new_tokens=8)
cost = measure_batch_cost(dec.backend, 128, 8)
counts: Counter = Counter()
drafters = []
reset, pays = dm.DraftModelDrafter.reset, dm.DraftModelDrafter._pays


def counted_reset(self, p):
    drafters.append(self)
    return reset(self, p)


def counted_pays(self, drafted, reach, expected, batch, *rest):
    paid = pays(self, drafted, reach, expected, batch, *rest)
    if drafted == 0:
        counts[("batch", batch, "started", self.seq is not None, "pays", paid, "probe", self.probing)] += 1
    return paid


dm.DraftModelDrafter.reset, dm.DraftModelDrafter._pays = counted_reset, counted_pays
for label, decoder in (("ar", plain), ("draft", dec), ("ar again", plain)):
    r = run_concurrent(decoder, cost, ids, 96, N, ref, 128)
    print(
        f"{label}: {r.new_tokens / r.wall_s:.1f} tok/s, {r.wall_s:.1f} s, {r.passes} passes, {r.rows} rows, "
        f"{r.identical}/{len(ids)} identical"
    )
print(
    "draft-model passes",
    sum(d.draft_passes for d in drafters),
    "steps drafted by the suffix match",
    sum(d.retrieved_steps for d in drafters),
    "requests that started the draft model",
    sum(d.seq is not None for d in drafters),
)
for key, n in sorted(counts.items(), key=lambda kv: -kv[1]):
    print(key, n)
