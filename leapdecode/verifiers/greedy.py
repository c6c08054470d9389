"""Greedy verification: the rule that makes drafting lossless for greedy decoding.

Names (p, q, accepted, rejected, bonus) as defined in `leapdecode.verifiers.verdict`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from leapdecode.verifiers.verdict import Verdict, host_tokens


def verify_greedy(
    draft_tokens: Sequence[int] | torch.Tensor,  # [D]
    target_logits: torch.Tensor,  # [D+1, vocab]
    draft_probs: torch.Tensor | None = None,  # [D, vocab]; unused: greedy needs only p's argmax
) -> Verdict:
    """Keep drafted tokens while each equals the target's argmax; then add the bonus token.

    Returns a Verdict whose tokens are [d_1..d_A, bonus]: the target's own argmax at rows 0..A."""
    predicted = target_logits.argmax(dim=-1).tolist()  # [D+1]: the one device-to-host transfer
    drafted = host_tokens(draft_tokens)
    num_accepted = 0
    while num_accepted < len(drafted) and drafted[num_accepted] == predicted[num_accepted]:
        num_accepted += 1
    return Verdict(list(range(num_accepted)), predicted[: num_accepted + 1], predicted)
