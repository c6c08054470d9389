"""Training losses: EAGLE-3's training-time test and Medusa's per-head loss, against the target.

Both compare the head's log-probabilities with the target's own distribution at the position
the head predicts (`Example.label_ids`/`label_probs`: its most probable tokens, renormalised), a
soft cross-entropy, and report how often the head's best token is the target's best (the
acceptance a greedy draft would see, per step or per head).

EAGLE-3's training-time test unrolls the head on its own outputs as drafting does: step 0 reads
the target's states (entry i: the state at position i with token i+1, at rotary position i);
step j reads step j-1's outputs, with token i+j+1, at position i+j, and attends to step 0's
entries up to i and to its own chain's entries (i in steps 1..j), exactly the entries a drafted
token at depth j sees in the head's cache when drafting. Step j's loss weighs 0.8**j (EAGLE-3).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from leapdecode.heads.eagle3 import Eagle3Head
    from leapdecode.training.features import Example

STEP_WEIGHT = 0.8


def soft_cross_entropy(
    logp: torch.Tensor, label_ids: torch.Tensor, label_probs: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """logp [T, V], labels [T, K] (ids -1: none), mask [T] -> (mean loss over the mask, the
    number of masked rows whose argmax is the target's best token)."""
    ids = label_ids.long()
    valid = ids >= 0  # [T, K]
    picked = logp.gather(1, ids.clamp_min(0))  # [T, K]
    loss = -(label_probs.float() * picked * valid).sum(-1)  # [T]
    weight = mask & valid[:, 0]
    hits = ((logp.argmax(-1) == ids[:, 0]) & weight).sum()
    return (loss * weight).sum() / weight.sum().clamp_min(1), hits


def ttt_logits(head: Eagle3Head, states: torch.Tensor, ids: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """The training-time test's draft-vocabulary logits, one [T, draft_vocab] per step: step j's
    row i is what a token drafted at depth j+1 after committing states 0..i would be scored with
    (module doc). states [T, F], ids [T]."""
    t = ids.shape[0]
    device = head.norm.weight.device
    rows = torch.arange(t, device=device)
    causal = rows[None, :] <= rows[:, None]  # [T, T]
    eye = torch.eye(t, dtype=torch.bool, device=device)
    hidden = states[None].to(device).clone()  # [1, T, F]; a normal tensor, even from inference mode
    ids = ids.to(device)
    past: tuple[torch.Tensor, torch.Tensor] | None = None
    out_logits: list[torch.Tensor] = []
    for j in range(min(steps, t - 1)):
        source = (rows + j + 1).clamp_max(t - 1)  # [T]: token i+j+1 (past the end: any, never judged)
        mask = torch.cat([causal, *([eye] * j)], dim=1)[None]  # [1, T, (j+1)T]
        out, (k, v) = head.attend(hidden, ids[source][None], (rows + j)[None], mask, fuse=j == 0, past=past)
        past = (k, v) if past is None else (torch.cat([past[0], k], dim=2), torch.cat([past[1], v], dim=2))
        out_logits.append(head.logits(out[0]))
        hidden = out
    return out_logits


def eagle3_loss(head: Eagle3Head, example: Example, steps: int) -> tuple[torch.Tensor, list[tuple[int, int]]]:
    """The training-time test over one sequence: (weighted loss, per step (hits, rows))."""
    device = head.norm.weight.device
    t = example.input_ids.shape[0]
    rows = torch.arange(t, device=device)
    mask, label_ids, label_probs = (x.to(device) for x in (example.loss_mask, example.label_ids, example.label_probs))
    total = torch.zeros((), device=device)
    stats: list[tuple[int, int]] = []
    for j, logits in enumerate(ttt_logits(head, example.states, example.input_ids, steps)):
        target_row = (rows + j + 1).clamp_max(t - 1)  # the target's row judging entry i at step j
        predicted = rows + j + 2  # the token it predicts: trained where that is answer text
        keep = (predicted < t) & mask[predicted.clamp_max(t - 1)]
        loss, hits = soft_cross_entropy(
            logits.float().log_softmax(-1), label_ids[target_row], label_probs[target_row], keep
        )
        total = total + STEP_WEIGHT**j * loss
        stats.append((int(hits), int((keep & (label_ids[target_row, 0] >= 0)).sum())))
    return total, stats


def medusa_loss(logits: torch.Tensor, example: Example) -> tuple[torch.Tensor, list[tuple[int, int]]]:
    """Medusa's heads' logits [heads, T, draft vocab] (the labels' ids: the whole vocabulary or a
    draft one) on the target's last states: head i at position t
    predicts the token after the target's own next one, judged against the target's row t+i+1."""
    heads, t, _ = logits.shape
    total = torch.zeros((), device=logits.device)
    stats: list[tuple[int, int]] = []
    for i in range(heads):
        n = t - i - 1
        if n <= 0:
            break
        logp = logits[i, :n].float().log_softmax(-1)  # [n, vocab]
        rows = slice(i + 1, i + 1 + n)
        keep = example.loss_mask[i + 2 : i + 2 + n].to(logits.device)  # the predicted token is answer text
        keep = torch.cat([keep, torch.zeros(n - len(keep), dtype=torch.bool, device=logits.device)])
        loss, hits = soft_cross_entropy(
            logp, example.label_ids[rows].to(logits.device), example.label_probs[rows].to(logits.device), keep
        )
        total = total + STEP_WEIGHT**i * loss
        stats.append((int(hits), int((keep & (example.label_ids[rows, 0].to(logits.device) >= 0)).sum())))
    return total, stats
