"""How often the draft model's runner-up token is the target's when its top token is not: what a
draft tree's sibling leaves (one more verification row each, no draft pass) could add. The 1.5B
(int4, its default load) answers Spec-Bench chat prompts greedily (96 new tokens); the 0.5B (as
`load_model` gives it: the GGUF's own blocks, whole head; not the draft path's own rounding)
scores prompt and answer in one pass, so each position's draft distribution has the true prefix,
as a draft's first token has. Binned by the draft's top probability.
Usage: python runner_up.py [PROMPTS_PER_CATEGORY]"""

import sys
from collections import defaultdict

import torch

from leapdecode import wrap
from leapdecode.bench.datasets import load_dataset
from leapdecode.models import load_model

torch.set_num_threads(2)
n = int(sys.argv[1]) if len(sys.argv) > 1 else 3
target = load_model("qwen2.5-coder-1.5b", log=lambda m: None)
draft = load_model("qwen2.5-coder-0.5b", log=lambda m: None)
cats = ["multi-turn", "translation", "qa", "math_reasoning"]
dec = wrap(target, "ar")
stats = defaultdict(lambda: [0, 0, 0, 0])  # bin -> [count, top1 hit, top2 hit (top1 miss), top3 hit]
for cat in cats:
    for p in load_dataset(f"spec-bench:{cat}", n):
        msgs = [{"role": "user", "content": p.text}]
        out = dec.generate(msgs, max_new_tokens=96, chat=True)
        ids = list(out.prompt_ids)
        new = list(out.token_ids)
        seq = torch.tensor([ids + new])
        with torch.inference_mode():
            logits = draft.model(seq).logits[0, len(ids) - 1 : len(ids) - 1 + len(new)].float()
        probs = logits.softmax(-1)
        top = probs.topk(3, -1)
        for t, tok in enumerate(new):
            p1 = top.values[t, 0].item()
            b = min(int(p1 * 5), 4)
            s = stats[(cat, b)]
            s[0] += 1
            if top.indices[t, 0] == tok:
                s[1] += 1
            elif top.indices[t, 1] == tok:
                s[2] += 1
            elif top.indices[t, 2] == tok:
                s[3] += 1
tot = defaultdict(lambda: [0, 0, 0, 0])
for (cat, b), s in sorted(stats.items()):
    second, third = s[2] / max(1, s[0] - s[1]), s[3] / max(1, s[0] - s[1] - s[2])
    print(
        cat,
        f"p1 {b / 5:.1f}-{(b + 1) / 5:.1f}",
        s[0],
        f"top1 {s[1] / s[0]:.2f} top2|miss {second:.2f} top3|miss2 {third:.2f}",
    )
    for k in range(4):
        tot[b][k] += s[k]
for b, s in sorted(tot.items()):
    second, third = s[2] / max(1, s[0] - s[1]), s[3] / max(1, s[0] - s[1] - s[2])
    print(
        "all",
        f"p1 {b / 5:.1f}-{(b + 1) / 5:.1f}",
        s[0],
        f"top1 {s[1] / s[0]:.2f} top2|miss {second:.2f} top3 {third:.2f}",
    )
a = [sum(s[k] for s in tot.values()) for k in range(4)]
print(
    "overall", a[0], f"top1 {a[1] / a[0]:.2f} top2|miss {a[2] / (a[0] - a[1]):.2f} top2 share of all {a[2] / a[0]:.3f}"
)
