"""Greedy verification: the rule that makes drafting lossless for greedy decoding.

Names (p, q, accepted, rejected, bonus) as defined in `leapdecode.verifiers.verdict`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from leapdecode.engine.verdict import Verdict
from leapdecode.verifiers.verdict import (
    emitted_logprobs,
    greedy_transfer,
    host_tokens,
    split_candidates,
)


def verify_greedy(
    draft_tokens: Sequence[int] | torch.Tensor,  # [D]
    target_logits: torch.Tensor,  # [D+1, vocab]
    draft_probs: torch.Tensor | None = None,  # [D, vocab]; unused: greedy needs only p's argmax
    *,
    position: int = 0,  # the first row's output position; unused: greedy draws no noise
    logprobs: int | None = None,
    candidates: int = 0,
) -> Verdict:
    """Keep drafted tokens while each equals the target's argmax; then add the bonus token.

    Returns a Verdict whose tokens are [d_1..d_A, bonus]: the target's own argmax at rows 0..A
    (with their log-probabilities and the `logprobs` best alternatives when `logprobs` is set;
    with `candidates` = k, also every row's k best token ids, for drafters that recycle them)."""
    drafted = host_tokens(draft_tokens)
    argmax = target_logits.argmax(dim=-1)  # [D+1]
    rows = len(drafted) + 1
    predicted, host = greedy_transfer(target_logits, argmax, logprobs, candidates)  # the one device-to-host transfer
    num_accepted = 0
    while num_accepted < len(drafted) and drafted[num_accepted] == predicted[num_accepted]:
        num_accepted += 1
    tokens = predicted[: num_accepted + 1]
    recycled = split_candidates(host[len(host) - rows * candidates :], rows, candidates) if candidates else None
    if logprobs is None:
        return Verdict(list(range(num_accepted)), tokens, predicted, None, recycled)
    emitted = range(num_accepted + 1)
    record = emitted_logprobs(tokens, emitted, [host[rows + i] for i in emitted], host[2 * rows :], logprobs)
    return Verdict(list(range(num_accepted)), tokens, predicted, record, recycled)
