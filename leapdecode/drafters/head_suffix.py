"""A trained head and a suffix match in one tree: retrieval where the text repeats, the head elsewhere.

The head (EAGLE-3, Medusa) drafts from the target's states everywhere, right less often where
the text is copied; a suffix match (`suffix`) drafts long sure branches where it is copied and
nothing elsewhere. Each pass grafts the match's continuations onto the head's draft (shared
prefixes merged, as `hybrid` does with recycled trees), every token keeping its evidence (the
head's confidence in tenths, or the match's length: two kinds of evidence), and cost-aware cutting keeps
the part worth its cost.
"""

from __future__ import annotations

import dataclasses

from leapdecode.drafters.base import Composite
from leapdecode.drafters.hybrid import graft
from leapdecode.drafters.suffix import SuffixDrafter
from leapdecode.engine.drafting import Draft, Drafter


class HeadWithSuffix(Composite):
    """A head's draft with a suffix match's continuations grafted on (see the module doc);
    neither keeps state per drafted row, so the cut concerns neither."""

    def __init__(self, head: Drafter, suffix: SuffixDrafter) -> None:
        super().__init__(head, suffix)
        self.head, self.suffix = head, suffix

    def merge(self, first: Draft, second: Draft) -> Draft:
        if first.tokens and first.parents is None:  # a chain, as a tree
            first = dataclasses.replace(first, parents=tuple(range(-1, len(first) - 1)))
        return graft(first, second)
