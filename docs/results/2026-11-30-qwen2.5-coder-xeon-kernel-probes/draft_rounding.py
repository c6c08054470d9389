"""How well the 0.5B drafts for the 1.5B under three roundings of its int4 layers: the 1.5B (its
default int4 load) answers Spec-Bench prompts greedily (96 new tokens, kept in the system's
temporary folder after the first run); the 0.5B scores each prompt and answer in one pass, so
every answer position has the true prefix, as a draft's first token does; counted: its top token is the 1.5B's (top-1
agreement), and the mean probability it gives the 1.5B's token.

    python draft_rounding.py VARIANT [PROMPTS_PER_CATEGORY]

VARIANT: `float` (the 0.5B as its GGUF dequantizes, unrounded), `current` (the draft path's int4:
`rounding.quantize_weight_super`, each group's scale and minimum from its range), `least-squares`
(each group's scale and minimum fitted by least squares to the levels of 21 candidate scales,
14/range to 16/range, keeping the fit with the smallest squared error: llama.cpp's `make_qkx2`
idea, here unweighted; then the same super-block factors).
"""

from __future__ import annotations

import sys
import time

import torch

from leapdecode.bench.probes import answers
from leapdecode.models import load_model, quantize
from leapdecode.models import rounding as R

CHUNK = 1024  # output rows fitted at a time (the temporaries stay in cache)


def fit_groups(w: torch.Tensor, steps: int = 20) -> tuple[torch.Tensor, torch.Tensor]:
    """w [out, groups, 32] → scale, minimum [out, groups]: least squares of s·q + m against w at
    the levels q of each candidate scale, the candidate with the smallest error (from its sums)."""
    low, high = w.amin(-1), w.amax(-1)
    span = (high - low).clamp_min(1e-30)
    n, sx, sx2 = w.shape[-1], w.sum(-1), (w * w).sum(-1)
    best_s, best_m = span / 15, low
    best_e = torch.full_like(span, float("inf"))
    shifted = w - low[..., None]
    for i in range(steps + 1):
        q = (shifted * ((14.0 + 2.0 * i / steps) / span)[..., None]).round_().clamp_(0, 15)
        sl, sl2, slx = q.sum(-1), (q * q).sum(-1), (q * w).sum(-1)
        det = n * sl2 - sl * sl
        safe = torch.where(det > 0, det, 1)
        s, m = (n * slx - sl * sx) / safe, (sl2 * sx - sl * slx) / safe
        e = s * s * sl2 + 2 * s * m * sl - 2 * s * slx + n * m * m - 2 * m * sx + sx2
        better = (det > 0) & (s > 0) & (e < best_e)
        best_e, best_s, best_m = (
            torch.where(better, e, best_e),
            torch.where(better, s, best_s),
            torch.where(better, m, best_m),
        )
    return best_s, best_m


def least_squares_super(weight: torch.Tensor, bits: int) -> tuple[torch.Tensor, R.SuperScales]:
    """`rounding.quantize_weight_super` with fitted group scales and minimums (int4 only)."""
    if bits != 4:
        return CURRENT(weight, bits)
    w = R._groups_of(weight, bits)
    parts = [fit_groups(w[i : i + CHUNK]) for i in range(0, w.shape[0], CHUNK)]
    s, m = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
    dmin = R._by_super(m).abs().amax(-1) / 127
    mi = torch.round(m / R._per_group(torch.where(dmin > 0, dmin, 1), m.shape[1])).clamp(-127, 127).to(torch.int8)
    d = R._by_super(s).amax(-1) / 255
    sc = torch.round(s / R._per_group(torch.where(d > 0, d, 1), s.shape[1])).clamp(1, 255).to(torch.uint8)
    factors = R.SuperScales(d.contiguous(), sc.contiguous(), dmin.contiguous(), mi.contiguous())
    return R._round_int4(w, factors.scales(), R._per_group(dmin, m.shape[1]) * mi.float()), factors


CURRENT = R.quantize_weight_super


def main() -> None:
    torch.set_num_threads(2)
    variant, per_category = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 3
    rows = answers(per_category)
    if variant == "least-squares":
        quantize.quantize_weight_super = least_squares_super
    start = time.perf_counter()
    draft = load_model("qwen2.5-coder-0.5b", dtype="float32", quantize="none", log=lambda message: None)
    if variant != "float":
        quantize.quantize_model(draft.model, "int4", head_bits=4)
    print(f"{variant}: loaded and rounded in {time.perf_counter() - start:.1f} s", flush=True)
    hits: dict[str, list[int]] = {}
    mass = 0.0
    with torch.inference_mode():
        for row in rows:
            prompt, answer = row["prompt"], row["answer"]
            logits = draft.model(torch.tensor([prompt + answer])).logits[
                0, len(prompt) - 1 : len(prompt) - 1 + len(answer)
            ]
            tally = hits.setdefault(row["category"], [0, 0])
            tally[0] += sum(a == b for a, b in zip(logits.argmax(-1).tolist(), answer))
            tally[1] += len(answer)
            mass += logits.float().softmax(-1)[torch.arange(len(answer)), torch.tensor(answer)].sum().item()
    right, total = sum(t[0] for t in hits.values()), sum(t[1] for t in hits.values())
    by = " ".join(f"{c} {t[0] / t[1]:.3f}" for c, t in hits.items())
    print(
        f"{variant}: top-1 agreement {by}; all {right / total:.4f} ({right}/{total}); "
        f"mean p(target's token) {mass / total:.4f}"
    )


if __name__ == "__main__":
    main()
