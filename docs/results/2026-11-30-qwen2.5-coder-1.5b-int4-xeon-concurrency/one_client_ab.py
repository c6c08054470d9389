"""One request through the decode loop alone (`Decoder.stream`, the benchmark's solo reference) against the
same request through the shared-pass scheduler with one client, alternating in one process (48 new
tokens, greedy; the outputs checked equal). Usage: python one_client_ab.py"""

import time

import torch

from leapdecode import Decoder
from leapdecode.engine.cost import measure_batch_cost
from leapdecode.engine.scheduler import BatchScheduler
from leapdecode.engine.submission import Submission
from leapdecode.methods import backend_for
from leapdecode.models import load_model

torch.set_num_threads(2)
lm = load_model("qwen2.5-coder-1.5b", log=lambda m: None)
dec = Decoder(lm, "ar")
prompt = lm.tokenizer("Explain how a hash map works, with an example in Python.")["input_ids"]
N = 48
dec.generate(prompt, max_new_tokens=8)
cost = measure_batch_cost(backend_for(lm), 128, 8)


def solo():
    t = time.perf_counter()
    out = []
    for step in dec.stream(prompt, max_new_tokens=N):
        out.extend(step.tokens)
    return time.perf_counter() - t, out


def one_client():
    sched = BatchScheduler(dec.backend, cost, max_batch=1, max_rows=128)
    out = []
    done = []
    t = time.perf_counter()
    sched.submit(
        Submission(dec.start(prompt, max_new_tokens=N), lambda s: out.extend(s.tokens), lambda r: done.append(r))
    )
    passes = 0
    while not done:
        if sched.step() is not None:
            passes += 1
    return time.perf_counter() - t, out


for r in range(4):  # rounds
    a, oa = solo()
    b, ob = one_client()
    assert oa == ob
    print(
        f"round {r}: solo {a * 1000 / N:.1f} ms/token   one client {b * 1000 / N:.1f} ms/token   ratio {b / a:.2f}",
        flush=True,
    )
