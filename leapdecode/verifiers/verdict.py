"""What a verifier returns: the verdict on one pass, already on the host.

Names used by every verifier in this package:
- p: the target model's distribution at each scored position (from `target_logits`);
- q: the drafter's distribution (None for a deterministic drafter: one-hot on its token);
- drafted tokens d_1..d_D follow the last accepted token; the target scores D+1 positions
  (the pending token, then each drafted token);
- accepted tokens: the drafted tokens the target keeps (a prefix of a chain; one root-to-node
  path of a tree);
- rejected tokens: every other drafted token, discarded with its KV-cache entries;
- bonus token: the target's own token after the last accepted one, always emitted, so that
  every forward pass yields at least one token.

Each verifier makes exactly one device-to-host transfer: everything the decode loop needs next
(the accepted path, the emitted tokens, and the target's greedy token at every scored row for
drafters that learn from it) comes back in that one copy.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch


class Verdict(NamedTuple):
    path: list[int]  # indices of the accepted drafted tokens, root first (a chain: 0..A-1)
    tokens: list[int]  # emitted: the accepted tokens, then the bonus token ([A+1])
    predicted: list[int]  # the target's greedy token after each scored row ([D+1])

    @property
    def num_accepted(self) -> int:
        return len(self.path)


def host_tokens(draft_tokens: Sequence[int] | torch.Tensor) -> list[int]:
    """Drafted tokens as a host list (the loop passes lists; a tensor is accepted for convenience)."""
    return draft_tokens.tolist() if isinstance(draft_tokens, torch.Tensor) else list(draft_tokens)
