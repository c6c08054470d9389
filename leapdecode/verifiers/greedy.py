"""Greedy verification: the rule that makes drafting lossless for greedy decoding.

Names used by every verifier in this package:
- p: the target model's distribution at each scored position (from `target_logits`);
- q: the drafter's distribution (None for a deterministic drafter: one-hot on its token);
- drafted tokens d_1..d_D follow the last accepted token; the target scores D+1 positions;
- accepted tokens: the longest prefix d_1..d_A that the target itself would have produced;
- rejected tokens: d_{A+1}..d_D, discarded with their KV-cache entries;
- bonus token: the target's own token at position A+1, always emitted, so that every
  forward pass yields at least one token (A+1 in all).
"""

from __future__ import annotations

import torch


def verify_greedy(
    draft_tokens: torch.Tensor,  # [D] long
    target_logits: torch.Tensor,  # [D+1, vocab]
    draft_probs: torch.Tensor | None = None,  # [D, vocab]; unused: greedy needs only p's argmax
) -> tuple[int, torch.Tensor]:
    """Keep drafted tokens while each equals the target's argmax; then add the bonus token.

    Returns (A, tokens) where tokens = [d_1..d_A, bonus], a [A+1] long tensor.
    """
    predicted = target_logits.argmax(dim=-1)  # [D+1]
    num_drafted = draft_tokens.shape[0]
    if num_drafted == 0:
        return 0, predicted[:1]
    matches = predicted[:num_drafted] == draft_tokens  # [D]
    num_accepted = int(matches.cumprod(dim=0).sum())
    return num_accepted, predicted[: num_accepted + 1]
