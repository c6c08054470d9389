"""A trained head and a suffix match in one tree: retrieval where the text repeats, the head elsewhere.

The head (EAGLE-3, Medusa) drafts from the target's states everywhere, right less often where
the text is copied; a suffix match (`suffix`) drafts long sure branches where it is copied and
nothing elsewhere. Each pass grafts the match's continuations onto the head's draft (shared
prefixes merged, as `hybrid` does with recycled trees), every token keeping its evidence (the
head's confidence in tenths, or the match's length above those), and cost-aware cutting keeps
the part worth its cost.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from leapdecode.drafters.base import Delegating, Draft, Drafter
from leapdecode.drafters.hybrid import graft
from leapdecode.drafters.suffix import SuffixDrafter

SUFFIX_EVIDENCE = 16  # added to the suffix branch's evidence: above every head token's (0-9)


class HeadWithSuffix(Delegating):
    """A head's draft with a suffix match's continuations grafted on (see the module doc); the
    head is the inner drafter: what this class does not override goes to it."""

    def __init__(self, head: Drafter, suffix: SuffixDrafter) -> None:
        super().__init__(head)
        self.head, self.suffix = head, suffix

    def reset(self, prompt_ids: Sequence[int]) -> None:
        self.head.reset(prompt_ids)
        self.suffix.reset(prompt_ids)

    def cut(self, kept: Sequence[int]) -> None:
        pass  # neither the head nor the suffix match keeps state per drafted row

    def update(self, tokens: Sequence[int], num_accepted: int) -> None:
        self.head.update(tokens, num_accepted)
        self.suffix.update(tokens, num_accepted)

    def propose(self, max_tokens: int) -> Draft:
        own = self.head.propose(max_tokens)
        if own.tokens and own.parents is None:  # a chain, as a tree
            own = dataclasses.replace(own, parents=tuple(range(-1, len(own) - 1)))
        branch = self.suffix.propose(max_tokens)
        marks = tuple(SUFFIX_EVIDENCE + e for e in branch.evidence or (0,) * len(branch))
        return graft(own, dataclasses.replace(branch, evidence=marks))

    def finish(self) -> None:
        self.head.finish()
        self.suffix.finish()
