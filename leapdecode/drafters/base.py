"""Bases that keep drafters short: most drafters read the token stream and propose from it.

The contract itself (`start`, `offer`, `hear`, `finish`) is the engine's (`engine.drafting`).
`StreamDrafter` turns it into three calls over the stream: `reset` with the prompt, `propose`
within a length, `update` with what was emitted; a drafter that learns more from a pass (the
target's predictions, its states, the cut) overrides `hear` and calls `update` from it.
`Composite` runs two drafters side by side and merges their drafts (`hybrid`, `head_suffix`).
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Sequence

from leapdecode.engine.drafting import (
    Draft,
    DraftContext,
    Drafter,
    Offer,
    PassResult,
    Request,
    Rounds,
    offered,
)


class StreamDrafter(Drafter):
    """A drafter over the token stream (prompt, then every emitted token): `reset`, `propose`,
    `update`. The prompt's pass is heard like any other (its first token, the prompt's states)."""

    def start(self, request: Request) -> None:
        self.reset(request.prompt_ids)
        if request.prefill is not None:
            self.hear(request.prefill)

    def offer(self, context: DraftContext) -> Rounds:
        return offered(self.propose(context.max_tokens))

    def hear(self, result: PassResult) -> None:
        self.update(result.tokens, result.accepted)

    @abstractmethod
    def reset(self, prompt_ids: Sequence[int]) -> None:
        """Start a new stream from the prompt's token ids."""

    @abstractmethod
    def propose(self, max_tokens: int) -> Draft:
        """Up to `max_tokens` tokens (a tree: its deepest branch) that continue the stream."""

    @abstractmethod
    def update(self, tokens: Sequence[int], num_accepted: int) -> None:
        """`tokens` were appended to the stream: the first `num_accepted` were drafted tokens
        the target accepted, the last one is the target's own (bonus) token."""


class Composite(Drafter):
    """Two drafters run side by side, their drafts merged into one (`merge`): both start, hear
    every pass (the cut indexes the merged draft) and finish. The merged draft is offered unpriced
    (a cost-aware wrapper prices it by its evidence), so a child must neither price its own draft
    nor keep state by its own draft's rows, unless `merge` maps them (`HybridDrafter` hands the
    merged rows to its recycling child)."""

    def __init__(self, first: Drafter, second: Drafter) -> None:
        self.children = (first, second)
        self.needs = first.needs.merged(second.needs)

    def start(self, request: Request) -> None:
        for child in self.children:
            child.start(request)

    def offer(self, context: DraftContext) -> Rounds:
        first = yield from self.children[0].offer(context)
        second = yield from self.children[1].offer(context)
        return Offer(self.merge(first.draft, second.draft))

    @abstractmethod
    def merge(self, first: Draft, second: Draft) -> Draft:
        """One draft from the children's."""

    def hear(self, result: PassResult) -> None:
        for child in self.children:
            child.hear(result)

    def finish(self) -> None:
        for child in self.children:
            child.finish()


class NoDrafter(StreamDrafter):
    """Plain autoregressive decoding: never drafts, so each pass emits exactly one token."""

    def reset(self, prompt_ids: Sequence[int]) -> None:
        pass

    def propose(self, max_tokens: int) -> Draft:
        return Draft()

    def update(self, tokens: Sequence[int], num_accepted: int) -> None:
        pass
