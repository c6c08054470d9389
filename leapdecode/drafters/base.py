"""The drafter interface: propose a continuation, then hear what the target kept.

A drafter sees the whole token stream (prompt, then every token the target emitted) through
`reset` and `update`, and proposes tokens that would follow it. The decode loop never asks a
drafter for more than `max_tokens`, so drafts cannot overshoot `max_new_tokens`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Generator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from leapdecode.engine.loop import PassResult

if TYPE_CHECKING:
    from leapdecode.engine.backend import Backend, CacheState, Scores
    from leapdecode.engine.cost import PassCost


@dataclass(frozen=True)
class Draft:
    """A proposed chain, or tree, of tokens.

    `q` holds the drafter's probabilities for each drafted token's position, for speculative
    sampling; None means a deterministic drafter (q is one-hot on the drafted token).
    `parents` makes the draft a tree: for each token, the index of its parent token (-1: it
    follows the last emitted token directly); parents come first, siblings differ. None is a chain.
    """

    tokens: list[int] = field(default_factory=list)
    q: torch.Tensor | None = None  # [len(tokens), vocab]
    parents: tuple[int, ...] | None = None
    # Optional, per drafted token: the drafter's evidence for it (a small int, e.g. how long a
    # match it came from), so that cost-aware drafting can learn acceptance per kind of evidence.
    evidence: tuple[int, ...] | None = None

    def __len__(self) -> int:
        return len(self.tokens)

    def first(self, n: int) -> Draft:
        """The first `n` drafted tokens: a chain's prefix, or a tree's first nodes (still a tree,
        as parents come first), with their q rows and evidence."""
        if n >= len(self.tokens):
            return self
        return Draft(
            self.tokens[:n],
            None if self.q is None else self.q[:n],
            None if self.parents is None else self.parents[:n],
            None if self.evidence is None else self.evidence[:n],
        )

    def subset(self, kept: Sequence[int]) -> Draft:
        """Only the tokens at `kept` (ascending indices, each with its parent kept): a chain's
        prefix stays a chain; a tree's nodes keep their parents, renumbered."""
        if len(kept) == len(self.tokens):
            return self
        if not kept:
            return Draft()
        parents = self.parents if self.parents is not None else tuple(range(-1, len(self.tokens) - 1))
        where = {full: new for new, full in enumerate(kept)}
        if any(parents[i] >= 0 and parents[i] not in where for i in kept):
            raise ValueError(f"a kept token's parent was dropped: {list(kept)}")
        evidence = None if self.evidence is None else tuple(self.evidence[i] for i in kept)
        tokens = [self.tokens[i] for i in kept]
        if self.parents is None:  # a chain's kept part is a prefix (parents kept): still a chain
            return Draft(tokens, None if self.q is None else self.q[: len(kept)], None, evidence)
        q = None if self.q is None else self.q[list(kept)]
        return Draft(tokens, q, tuple(where[parents[i]] if parents[i] >= 0 else -1 for i in kept), evidence)


@dataclass(frozen=True)
class Offer:
    """A whole draft offered to a batch scheduler, with each token's estimated probability of
    being accepted (its path's, parents before children: `reach[child] <= reach[parent]`), so
    that rows go to the most probable tokens of all the sequences in a pass; `reach` None: no
    estimate, the draft is taken whole."""

    draft: Draft
    reach: tuple[float, ...] | None = None


@dataclass(frozen=True)
class DraftFeed:
    """Tokens a drafter's own model must score next: appended to `seq`, or, `seq` None, prefilled
    as a new sequence. A drafter's rounds (`Drafter.offer_rounds`) yield these, are sent back (the
    sequence, its scores: every row's logits, a prefill's last) and return what they drafted;
    `engine.batch.drive_rounds` runs many requests' rounds together."""

    seq: CacheState | None
    tokens: list[int]


class Drafter(ABC):
    """Proposes tokens for the target model to verify in one forward pass."""

    # Jacobi-style drafters guess from the target's own predictions at the drafted positions:
    # when True, the loop calls `observe` after every pass (an argmax over the scored rows).
    observes_target: bool = False
    # Top-k token ids of every scored row the drafter wants from the (greedy) verifier, in its one
    # host transfer (`observe`'s `candidates`); 0: none.
    candidates: int = 0
    # Trained heads draft from the target's own hidden states: the indices, into Hugging Face's
    # `hidden_states` (0: the embeddings, i: what enters layer i, L: the final norm's output), of
    # the states the drafter wants from every target pass (`take_features`); (): none.
    feature_layers: tuple[int, ...] = ()
    # A drafter that drafts with a model of its own: that model's backend, shared by the drafters
    # of one method, so that a scheduler runs their passes together (`offer_rounds`); None: none.
    draft_backend: Backend | None = None

    @abstractmethod
    def reset(self, prompt_ids: Sequence[int]) -> None:
        """Start a new sequence from the prompt's token ids."""

    @abstractmethod
    def propose(self, max_tokens: int) -> Draft:
        """Propose up to `max_tokens` tokens that continue the stream seen so far."""

    @abstractmethod
    def update(self, tokens: Sequence[int], num_accepted: int) -> None:
        """`tokens` were appended to the stream: the first `num_accepted` were drafted tokens
        the target accepted, the last one is the target's own (bonus) token."""

    def offer(self, max_tokens: int) -> Offer:
        """Propose for a pass shared with other sequences (`engine.scheduler`): the whole draft,
        with reach when the drafter estimates it (cost-aware drafting); `take` then gets the
        part the scheduler kept."""
        return Offer(self.propose(max_tokens))

    def offer_rounds(
        self, max_tokens: int, batch: int = 1, cost: PassCost | None = None
    ) -> Generator[DraftFeed, tuple[CacheState, Scores], Offer]:
        """`offer` as rounds over `draft_backend`'s model, so that one pass of it drafts for every
        sequence of a shared pass (`engine.batch.drive_rounds`). By default no round: `offer`.
        `batch`: the sequences sharing the target's passes, decoding or with their prompts in
        them, and `cost` what such a pass costs by its rows (the scheduler's measured curve;
        None: alone): a drafter that prices its draft prices the pass's rows for all of them. A
        wrapper (`Delegating`) keeps this default, so its own `propose` shapes its offer."""
        offer = self.offer(max_tokens)
        return offer
        yield  # a generator that asks for no pass

    def take(self, offer: Offer, kept: Sequence[int]) -> Draft:
        """The part of `offer` the scheduler kept (ascending indices, parents kept); a drafter
        that observes the target's rows hears of the cut (`cut`)."""
        if len(kept) < len(offer.draft):
            self.cut(kept)
        return offer.draft.subset(kept)

    def horizon(self, max_new_tokens: int) -> None:  # noqa: B027 - optional hook, no-op by default
        """The request emits at most `max_new_tokens` tokens (called right after `reset`): a
        drafter with a one-time cost (a draft model's own prompt prefill) weighs it against the
        steps it can count on to repay it, which the budget bounds."""

    def attach(self, backend: Backend, seq: CacheState) -> None:  # noqa: B027 - optional hook, no-op by default
        """The target's backend and this request's cache, right after the prefill: drafters
        that draft with the target's own layers (self-speculative, early exit) share them."""

    def observe(self, predicted: Sequence[int], candidates: Sequence[Sequence[int]] | None = None) -> None:  # noqa: B027 - optional hook
        """The target's greedy token after each scored position of the last pass: the pending
        token first (index 0), then each drafted token (index i+1); with `candidates` (when the
        drafter asked for k and the verifier is greedy) each row's k best token ids too. Called
        before `update`, only when `observes_target` is set."""

    def take_features(self, states: torch.Tensor) -> None:  # noqa: B027 - optional hook
        """The target's states at the positions it just verified, for drafters with
        `feature_layers`: after the prefill, one row per prompt token; after each pass, the
        pending token's row and each accepted drafted token's, in order (`feature_layers`'
        states side by side: [rows, len(feature_layers) * hidden]). Called before `update`."""

    def cut(self, kept: Sequence[int]) -> None:  # noqa: B027 - optional hook
        """Only these tokens of the last draft (ascending indices, parents kept) will be scored: a
        wrapper, a batch scheduler or the loop (to the rows the backend verifies exactly) cut the
        rest. Called after `propose` (or within `take`) and before the pass, whenever a draft is
        cut; a drafter that keeps state per drafted row must follow it."""

    def hear(self, result: PassResult) -> None:
        """What one pass (or the prefill) produced, in one event, right after it: the target's
        states, its predictions, then what was emitted. By default the three hooks in that
        order; a drafter may take the whole event instead."""
        if result.features is not None:
            self.take_features(result.features)
        if result.predicted is not None:
            self.observe(result.predicted, result.candidates)
        self.update(result.tokens, result.accepted)

    def finish(self) -> None:  # noqa: B027 - optional hook
        """The request ended (a stop or the budget; not when abandoned): drafters that share what
        they learned with later requests of the same decoder commit it here."""


class Delegating(Drafter):
    """A drafter that wraps another: every hook and capability goes to `inner` unless the wrapper
    overrides it, so a wrapper writes only what it changes and cannot forget a hook. `offer` and
    `take` stay the base's, through the wrapper's own `propose` and `cut`: a wrapper that changes
    the draft changes it in shared passes too."""

    def __init__(self, inner: Drafter) -> None:
        self.inner = inner
        self.candidates = inner.candidates
        self.observes_target = inner.observes_target
        self.feature_layers = inner.feature_layers

    def reset(self, prompt_ids: Sequence[int]) -> None:
        self.inner.reset(prompt_ids)

    def propose(self, max_tokens: int) -> Draft:
        return self.inner.propose(max_tokens)

    def update(self, tokens: Sequence[int], num_accepted: int) -> None:
        self.inner.update(tokens, num_accepted)

    def horizon(self, max_new_tokens: int) -> None:
        self.inner.horizon(max_new_tokens)

    def attach(self, backend: Backend, seq: CacheState) -> None:
        self.inner.attach(backend, seq)

    def observe(self, predicted: Sequence[int], candidates: Sequence[Sequence[int]] | None = None) -> None:
        self.inner.observe(predicted, candidates)

    def take_features(self, states: torch.Tensor) -> None:
        self.inner.take_features(states)

    def cut(self, kept: Sequence[int]) -> None:
        self.inner.cut(kept)

    def finish(self) -> None:
        self.inner.finish()


# The legal order of a drafter's calls, as the loop and the scheduler make them: state -> call ->
# next state. A request: reset, its horizon, attach, then the prefill's event (`hear`: the prompt's states,
# what was emitted); per pass: a draft (propose, or offer then take; cuts; the scheduler offers
# through `offer_rounds`, which is the offer: the default's calls `offer`), then the pass's event
# (the kept rows' states, the target's predictions, what was emitted); finish when it ends (not
# when abandoned).
CALL_ORDER: dict[str, dict[str, str]] = {
    "new": {"reset": "reset"},
    "reset": {"horizon": "reset", "attach": "attached"},
    "attached": {"take_features": "attached", "update": "heard"},
    "heard": {"propose": "drafted", "offer": "offered", "finish": "done"},
    "offered": {"take": "drafted", "cut": "offered"},
    "drafted": {"cut": "drafted", "take_features": "scored", "observe": "scored", "update": "heard"},
    "scored": {"observe": "scored", "update": "heard"},
    "done": {"reset": "reset"},
}


class NoDrafter(Drafter):
    """Plain autoregressive decoding: never drafts, so each pass emits exactly one token."""

    def reset(self, prompt_ids: Sequence[int]) -> None:
        pass

    def propose(self, max_tokens: int) -> Draft:
        return Draft()

    def update(self, tokens: Sequence[int], num_accepted: int) -> None:
        pass
