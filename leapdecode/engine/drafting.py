"""The drafter contract the engine drives: four calls, and the types that pass between them.

    start(request) -> (offer(context) -> hear(result))* -> finish()

- `start`: a request begins; it carries the prompt, the budget, the target's backend and cache,
  and what the prompt's pass produced (the first token, the prompt's states).
- `offer`: a draft for the next pass, as a generator: a drafter with a model of its own yields
  what that model must score (`DraftFeed`) and gets the scores back, so that the scheduler runs
  every request's draft-model passes together (`engine.batch.drive_rounds`); the others return
  at once. The context says how many tokens the pass can verify, how many sequences share it
  and what its rows cost. The offer may price each token (`Offer.reach`); the scheduler keeps
  the part that pays (`engine.cost.allocate`), alone or among many.
- `hear`: everything the pass produced, in one event: what was emitted and accepted, which
  offered tokens were scored (the cut), the target's states and predictions where asked for.
- `finish`: the request ended (a stop or its budget; not when abandoned).

What a drafter needs of the target (its states, its predictions, a draft model's backend) is one
typed value, `Drafter.needs`. A drafter that wraps another (`Delegating`) forwards the four calls.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Generator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple, Protocol

import torch

if TYPE_CHECKING:
    from leapdecode.engine.backend import Backend, CacheState, Scores


class PassCost(Protocol):
    """The seconds of a target pass over n tokens (rows), which drafts are priced and cut by.
    `engine.cost.ForwardCost` is our backend's measured curve; `integrations.step_cost.StepCost`
    a vLLM step's live fit."""

    def of(self, tokens: int) -> float: ...


class Evidence(NamedTuple):
    """Why a drafter drafted a token, for cost-aware drafting to learn how often each kind of
    evidence holds: where it came from (`source`: "ngram", "suffix", "recycle", "head"...) and a
    small level within that source (a match's length, a probability's tenth, a rank and depth)."""

    source: str
    level: int


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
    # Optional, per drafted token: the drafter's evidence for it (e.g. how long a match it came
    # from), so that cost-aware drafting can learn acceptance per kind of evidence.
    evidence: tuple[Evidence, ...] | None = None

    def __len__(self) -> int:
        return len(self.tokens)

    def first(self, n: int) -> Draft:
        """The first `n` drafted tokens: a chain's prefix, or a tree's first nodes (still a tree,
        as parents come first), with their q rows and evidence."""
        return self.subset(range(min(n, len(self.tokens))))

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
    """A whole draft offered to the scheduler, with each token's estimated probability of being
    accepted (its path's, parents before children: `reach[child] <= reach[parent]`), so that a
    pass's rows go to the most probable tokens of all its sequences; `reach` None: no estimate,
    the draft is taken whole (up to what the pass verifies exactly). `cost`: the curve the reach
    was priced against, by which a pass of this request's own is cut (a shared pass is cut by its
    own curve); None: such a pass takes the draft whole."""

    draft: Draft
    reach: tuple[float, ...] | None = None
    cost: PassCost | None = None


@dataclass(frozen=True)
class DraftFeed:
    """Tokens a drafter's own model must score next: appended to `seq`, or, `seq` None, prefilled
    as a new sequence. An offer yields these, is sent back (the sequence, its scores: every row's
    logits, a prefill's last) and returns what it drafted."""

    seq: CacheState | None
    tokens: list[int]


@dataclass(frozen=True, eq=False)
class Needs:
    """What a drafter needs from the target's passes, asked once (`Drafter.needs`)."""

    # the indices, into Hugging Face's `hidden_states` (0: the embeddings, i: what enters layer i,
    # L: the final norm's output), of the states wanted from every pass (trained heads)
    features: tuple[int, ...] = ()
    # the target's greedy token at every scored row (Jacobi-style drafters, recycling)
    predictions: bool = False
    # the k best token ids of every scored row, from the (greedy) verifier's one host transfer
    candidates: int = 0
    # the backend of a model of the drafter's own, shared by a method's drafters, so that the
    # scheduler runs their passes together; None: none
    draft_backend: Backend | None = None

    def merged(self, other: Needs) -> Needs:
        """Both drafters' needs (a composite's children); at most one draft model between them."""
        if self.draft_backend is not None and other.draft_backend is not None:
            raise ValueError("a composite drafter's children draft with two models of their own")
        return Needs(
            self.features + tuple(layer for layer in other.features if layer not in self.features),  # in order
            self.predictions or other.predictions,
            max(self.candidates, other.candidates),
            self.draft_backend if self.draft_backend is not None else other.draft_backend,
        )


@dataclass(frozen=True)
class PassResult:
    """What a drafter hears of one target pass (or of the prompt's, in `Request.prefill`)."""

    tokens: Sequence[int]  # emitted: the accepted drafted tokens, then the target's own (bonus) token
    accepted: int  # drafted tokens the target kept
    # the offered tokens the pass scored (ascending indices into the offer's draft, parents kept;
    # a chain's: a prefix): rows 1.. of `predicted`; None: no offer (the prompt's pass)
    kept: Sequence[int] | None = None
    features: torch.Tensor | None = (
        None  # [rows, F] the target's states (`Needs.features`): the prompt's, or the kept rows'
    )
    predicted: Sequence[int] | None = (
        None  # [1 + len(kept)] the target's greedy token per scored row (`Needs.predictions`)
    )
    candidates: Sequence[Sequence[int]] | None = None  # [1 + len(kept)][k] its k best per row (`Needs.candidates`)


@dataclass(frozen=True)
class Request:
    """A request as its drafter starts it."""

    prompt_ids: Sequence[int]
    max_new_tokens: int | None = None  # None: unknown (an engine that does not say)
    backend: Backend | None = None  # the target's backend: drafters that draft with its own layers share it
    seq: CacheState | None = None  # this request's cache on it, the prompt in it
    prefill: PassResult | None = None  # what the prompt's pass produced; None: the prompt is all there is yet


@dataclass(frozen=True)
class DraftContext:
    """The limits of the pass a draft is for."""

    max_tokens: (
        int  # the most tokens a chain may hold (a tree: its deepest branch): the budget, what is verified exactly
    )
    batch: int = 1  # the sequences sharing the target's passes (decoding, or with their prompts in them)
    cost: PassCost | None = None  # a shared pass's cost by its rows; None: a pass of this request's own


Rounds = Generator[DraftFeed, "tuple[CacheState, Scores]", Offer]


class Drafter(ABC):
    """Proposes tokens for the target model to verify in one forward pass (see the module doc)."""

    needs: Needs = Needs()

    @abstractmethod
    def start(self, request: Request) -> None:
        """A new request: its prompt, and what its prompt's pass produced."""

    @abstractmethod
    def offer(self, context: DraftContext) -> Rounds:
        """A draft for the next pass, within `context`; a generator (see the module doc)."""

    @abstractmethod
    def hear(self, result: PassResult) -> None:
        """What the pass over the last offer produced."""

    def finish(self) -> None:  # noqa: B027 - optional, no-op by default
        """The request ended (a stop or the budget; not when abandoned): drafters that share what
        they learned with later requests commit it here."""


def offered(draft: Draft) -> Rounds:
    """A draft offered whole, without asking for a pass of a draft model (a generator that returns
    at once)."""
    return Offer(draft)
    yield  # a generator


class Delegating(Drafter):
    """A drafter that wraps another: the four calls and the needs go to `inner` unless the
    wrapper overrides them."""

    def __init__(self, inner: Drafter) -> None:
        self.inner = inner
        self.needs = inner.needs

    def start(self, request: Request) -> None:
        self.inner.start(request)

    def offer(self, context: DraftContext) -> Rounds:
        return self.inner.offer(context)

    def hear(self, result: PassResult) -> None:
        self.inner.hear(result)

    def finish(self) -> None:
        self.inner.finish()


# The legal order of a drafter's calls, as every driver makes them: state -> call -> next state.
# An engine that drops a request between its steps (vLLM's slots) may finish it after an offer
# whose pass it never reports.
CALL_ORDER: dict[str, dict[str, str]] = {
    "new": {"start": "started"},
    "started": {"offer": "offered", "finish": "done"},
    "offered": {"hear": "started", "finish": "done"},
    "done": {"start": "started"},
}
