"""How well the 0.5B drafts for the 1.5B with one of its decoder layers left out (the draft's
numerics never change the output, so a shallower draft would stay lossless and cost less a
pass): the same measure as `draft_rounding.py` (the kernel probes' folder), on the same 1.5B
answers (`leapdecode.bench.probes.answers`): the 0.5B on the draft path's int4 scores each prompt
and answer in one pass; counted, its top-1 agreement with the 1.5B's token and the mean
probability it gives it.

    python layer_skip.py single            # each layer left out in turn
    python layer_skip.py "3,9;4,6,9"       # the given sets (";" between sets)
"""

from __future__ import annotations

import sys
import time

import torch
from torch import nn

from leapdecode.bench.probes import answers
from leapdecode.models import load_model, quantize


def main() -> None:
    torch.set_num_threads(2)
    rows = answers(3)
    draft = load_model("qwen2.5-coder-0.5b", dtype="float32", quantize="none", log=lambda message: None)
    quantize.quantize_model(draft.model, "int4", head_bits=4)
    body = draft.model.model
    layers = list(body.layers)

    def score(skip: set[int]) -> tuple[float, float]:
        kept = [layer for i, layer in enumerate(layers) if i not in skip]
        body.layers, body.config.num_hidden_layers = nn.ModuleList(kept), len(kept)
        hits, total, mass = 0, 0, 0.0
        with torch.inference_mode():
            for row in rows:
                prompt, answer = row["prompt"], row["answer"]
                logits = draft.model(torch.tensor([prompt + answer]), use_cache=False).logits[
                    0, len(prompt) - 1 : len(prompt) - 1 + len(answer)
                ]
                hits += sum(a == b for a, b in zip(logits.argmax(-1).tolist(), answer))
                total += len(answer)
                mass += logits.float().softmax(-1)[torch.arange(len(answer)), torch.tensor(answer)].sum().item()
        return hits / total, mass / total

    top1, p = score(set())
    print(f"all layers: top-1 {top1:.4f}, mean p {p:.4f}", flush=True)
    sets = (
        [{i} for i in range(len(layers))]
        if sys.argv[1] == "single"
        else [{int(i) for i in part.split(",")} for part in sys.argv[1].split(";")]
    )
    for skip in sets:
        start = time.perf_counter()
        top1, p = score(skip)
        seconds = time.perf_counter() - start
        print(f"without {sorted(skip)}: top-1 {top1:.4f}, mean p {p:.4f} ({seconds:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
