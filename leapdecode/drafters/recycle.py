"""Token Recycling (arXiv 2408.08696): draft from the candidates the target already scored.

Every verification pass computes the target's distribution at each scored position; the greedy
verifier hands back the top-k token ids of every row (in its one host transfer). They are kept in
an adjacency table, token → the k tokens the target last ranked highest after it, and each step
drafts a tree by breadth-first expansion from the last token: its `width` best successors, their
successors, and so on, up to `nodes` tokens and `depth` levels. Rejected branches feed the table
too (their rows were scored all the same). It needs no repetition in the text: it helps where
n-gram drafters find nothing to copy.

Under sampling the verifier returns only each row's greedy token, and the table learns from those.
`RecycleTable` can be shared by the requests of one decoder (`recycle:shared=true`): the table then
carries what the target predicted for earlier requests — token transitions, not text, but still
something of other users' requests; it is per request unless asked.
"""

from __future__ import annotations

from collections.abc import Sequence

from leapdecode.drafters.base import StreamDrafter
from leapdecode.engine.drafting import Draft, Evidence, Needs, PassResult


class RecycleTable:
    """token → up to k successor candidates, the target's best first."""

    def __init__(self, k: int) -> None:
        self.k = k
        self.next: dict[int, tuple[int, ...]] = {}

    def learn(self, token: int, candidates: Sequence[int]) -> None:
        self.next[token] = tuple(candidates[: self.k])

    def learn_top1(self, token: int, best: int) -> None:
        """Only the greedy successor is known: put it first, keep the rest in order."""
        old = self.next.get(token, ())
        self.next[token] = (best, *(t for t in old if t != best))[: self.k]


class RecycleDrafter(StreamDrafter):
    """Drafts a token tree from the target's recycled top-k candidates (see the module doc)."""

    def __init__(
        self, k: int = 8, nodes: int = 8, depth: int = 4, width: int = 4, table: RecycleTable | None = None
    ) -> None:
        self.needs = Needs(predictions=True, candidates=k)  # top-k of every scored row asked of the verifier
        self.nodes, self.depth, self.width = nodes, depth, width
        self.table = table if table is not None else RecycleTable(k)
        self.stream: list[int] = []
        self.rows: list[int] = []  # the input token of each row of the last pass

    def reset(self, prompt_ids: Sequence[int]) -> None:
        self.stream = list(prompt_ids)
        self.rows = []

    def update(self, tokens: Sequence[int], num_accepted: int) -> None:
        self.stream.extend(tokens)

    def propose(self, max_tokens: int) -> Draft:
        tokens: list[int] = []
        parents: list[int] = []
        evidence: list[Evidence] = []  # the candidate's rank among its siblings, and its depth
        level = [(-1, self.stream[-1])]  # (index of the node, its token); the root is the pending token
        for depth in range(min(self.depth, max_tokens)):
            width = max(1, self.width >> depth)  # wide near the root, a chain further down
            below = []
            for index, token in level:
                for rank, successor in enumerate(self.table.next.get(token, ())[:width]):
                    if len(tokens) == self.nodes:
                        break
                    parents.append(index)
                    tokens.append(successor)
                    evidence.append(Evidence("recycle", min(rank, 7) * 8 + min(depth, 7)))
                    below.append((len(tokens) - 1, successor))
            if not below or len(tokens) == self.nodes:
                break
            level = below
        self.rows = [self.stream[-1], *tokens]
        return Draft(tokens, parents=tuple(parents), evidence=tuple(evidence)) if tokens else Draft()

    def scoring(self, tokens: Sequence[int]) -> None:
        """The next pass scores these drafted tokens instead of this drafter's own (a drafter that
        grafts onto its tree, `hybrid`): every scored row teaches the table."""
        self.rows = [self.rows[0], *tokens]

    def hear(self, result: PassResult) -> None:
        if result.kept is not None and self.rows:
            self.rows = [self.rows[0], *(self.rows[i + 1] for i in result.kept)]  # the scored rows
        if result.predicted is not None:
            self._learn(result.predicted, result.candidates)
        self.update(result.tokens, result.accepted)

    def _learn(self, predicted: Sequence[int], candidates: Sequence[Sequence[int]] | None) -> None:
        """Every scored row teaches the table its token's successors."""
        for i, token in enumerate(self.rows):
            if candidates is not None:
                self.table.learn(token, candidates[i])
            else:
                self.table.learn_top1(token, predicted[i])
