"""Hybrid drafting: one tree per pass from a suffix match and from recycled candidates.

Copying (`suffix`) drafts long, sure branches where the text repeats and nothing where it does
not; Token Recycling (`recycle`) drafts short trees everywhere, right less often. Each pass
merges both into one tree: the recycled tree, with the suffix match's continuations grafted on
(shared prefixes merged, so siblings stay distinct). Every token carries its evidence (the
match's length, or the candidate's rank and depth: two kinds), and cost-aware cutting keeps the
part worth its cost: the suffix branch when its match is long, the recycled branches otherwise.

Every scored row, suffix branch included, teaches the recycling table.
"""

from __future__ import annotations

from leapdecode.drafters.base import Composite
from leapdecode.drafters.recycle import RecycleDrafter
from leapdecode.drafters.suffix import SuffixDrafter
from leapdecode.engine.drafting import Draft, Evidence

UNMARKED = Evidence("unmarked", 0)  # a grafted token whose drafter gave no evidence


def graft(draft: Draft, branch: Draft) -> Draft:
    """`draft` (a tree, or empty) with `branch` (a chain or a tree) added from the root; where the
    branch follows existing tokens it takes them over (their evidence becomes the branch's)."""
    tokens, parents = list(draft.tokens), list(draft.parents or ())
    marks = list(draft.evidence or (UNMARKED,) * len(tokens))
    children = {(p, t): i for i, (p, t) in enumerate(zip(parents, tokens, strict=True))}
    branch_parents = branch.parents if branch.parents is not None else range(-1, len(branch) - 1)
    where: list[int] = []  # each branch token's index in the merged tree
    for token, parent, mark in zip(
        branch.tokens, branch_parents, branch.evidence or (UNMARKED,) * len(branch), strict=True
    ):
        node = where[parent] if parent >= 0 else -1
        found = children.get((node, token))
        if found is None:
            found = children[(node, token)] = len(tokens)
            tokens.append(token)
            parents.append(node)
            marks.append(mark)
        else:
            marks[found] = mark
        where.append(found)
    return Draft(tokens, parents=tuple(parents), evidence=tuple(marks)) if tokens else Draft()


class HybridDrafter(Composite):
    """A recycled tree and a suffix match's continuations in one tree (see the module doc)."""

    def __init__(self, suffix: SuffixDrafter, recycle: RecycleDrafter) -> None:
        super().__init__(recycle, suffix)
        self.suffix, self.recycle = suffix, recycle

    def merge(self, first: Draft, second: Draft) -> Draft:
        draft = graft(first, second)
        self.recycle.scoring(draft.tokens)  # every row of the merged tree teaches the table
        return draft
