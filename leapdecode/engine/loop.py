"""The decode loop: one loop for every method.

    prefill -> repeat: draft -> score pending token + draft in one pass -> verify ->
               roll the KV cache back -> emit (cut at a stop) -> tell the drafter

Plain decoding is the same loop with a drafter that never drafts.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch

from leapdecode.drafters.base import Drafter
from leapdecode.engine.backend import Backend
from leapdecode.engine.stopping import StopCriteria
from leapdecode.verifiers.greedy import verify_greedy

# (drafted tokens [D], target logits [D+1, vocab], draft probs q [D, vocab] or None) -> (A, [A+1] tokens)
Verifier = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], tuple[int, torch.Tensor]]


@dataclass(frozen=True)
class Step:
    """One target forward pass: what was drafted, how much was accepted, what was emitted."""

    drafted: tuple[int, ...]
    num_accepted: int  # drafted tokens the target kept
    tokens: tuple[int, ...]  # emitted: accepted drafts + the bonus token, cut at a stop
    finish_reason: str | None  # "stop", "length", or None while generation goes on


def decode(
    backend: Backend,
    prompt_ids: Sequence[int],
    drafter: Drafter,
    stop: StopCriteria,
    verifier: Verifier = verify_greedy,
) -> Iterator[Step]:
    """Generate after `prompt_ids`, yielding one `Step` per target forward pass."""
    # 1. Prefill: the prompt's pass also gives the first new token.
    seq, scores = backend.prefill(list(prompt_ids))
    _, first = verifier(scores.logits.new_empty(0, dtype=torch.long), scores.logits[-1:], None)
    new_tokens = first.tolist()
    drafter.reset(prompt_ids)
    generated: list[int] = []
    drafted: list[int] = []
    num_accepted = 0
    while True:
        # 2. Emit what the target produced, cut at EOS / a stop string / the budget.
        keep, reason = stop.cut(generated, new_tokens)
        generated.extend(new_tokens[:keep])
        yield Step(tuple(drafted), num_accepted, tuple(new_tokens[:keep]), reason)
        if reason is not None:
            return
        # 3. Tell the drafter; ask for a draft no longer than what is left, less the bonus token.
        drafter.update(new_tokens, num_accepted)
        draft = drafter.propose(stop.max_new_tokens - len(generated) - 1)
        drafted = list(draft.tokens)
        # 4. Score the pending token (emitted, not yet cached) and the draft in one pass.
        scores = backend.forward(seq, [new_tokens[-1], *drafted])
        # 5. Verify: the longest prefix the target agrees with, plus its bonus token.
        draft_tensor = torch.tensor(drafted, dtype=torch.long, device=scores.logits.device)
        num_accepted, kept = verifier(draft_tensor, scores.logits, draft.q)
        # 6. Roll the cache back over rejected drafts; the bonus token is not cached yet.
        backend.rollback(seq, seq.length - (len(drafted) - num_accepted))
        new_tokens = kept.tolist()
