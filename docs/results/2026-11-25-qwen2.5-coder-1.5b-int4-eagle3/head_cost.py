"""What a draft step of the trained EAGLE-3 head costs against a pass of the target, in a real
decode of one chat prompt (int4 target, int4 head, 2 threads): median seconds of the drafter's
`propose` (its head steps, and committing the accepted states) and of the target's pass."""

import statistics
import sys
import time

import torch

from leapdecode import load_model, wrap

torch.set_num_threads(2)
lm = load_model("qwen2.5-coder-1.5b", log=lambda m: None)
prompt = "Explain how a hash map handles collisions, with an example."
print(f"model: {lm.describe}")
for method in (
    "ar",
    "eagle3:depth=1,min_prob=0.0,cost_aware=false",
    "eagle3:depth=6,min_prob=0.0,cost_aware=false",
    "eagle3",
):
    decoder = wrap(lm, method)
    decoder.generate(prompt, chat=True, max_new_tokens=8)  # warm
    run = decoder.start(prompt, chat=True, max_new_tokens=96)
    backend = decoder.backend
    with torch.inference_mode():
        seq, scores = backend.prefill(run.prompt_ids, **run.wants)
        run.begin(backend, seq, scores)
        proposes, passes, drafted = [], [], []
        while not run.done:
            t0 = time.perf_counter()
            draft = run.propose(backend.draft_limit(seq))
            t1 = time.perf_counter()
            tokens, tree = run.plan(draft)
            scores = backend.forward(seq, tokens, tree=tree, **run.wants)
            t2 = time.perf_counter()
            run.settle(backend, scores)
            proposes.append(t1 - t0)
            passes.append(t2 - t1)
            drafted.append(len(draft))
    print(
        f"{method}: propose median {statistics.median(proposes) * 1000:.1f} ms, target pass median "
        f"{statistics.median(passes) * 1000:.1f} ms, drafted per pass {statistics.mean(drafted):.2f}, "
        f"passes {len(passes)}"
    )
    sys.stdout.flush()
