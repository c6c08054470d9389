"""A pass's drafts: what each decoding request offers, and the cut for the whole pass.

The scheduler (`engine.scheduler`) asks every decoding request's drafter for an offer (requests
whose drafters share one draft model run their rounds together, one packed pass of it a round:
`drive_rounds`), then keeps the most probable drafted tokens of all requests in the number the
pass's measured cost says pays (`engine.cost.allocate`). A pass of one request's own is the same
with one offer, cut by the curve its drafter priced it with (`Offer.cost`; none: kept whole). A
request whose drafting, cut or plan fails leaves with its error through `isolated`; the others go on.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol, TypeVar

import torch

from leapdecode.engine.batch import BatchItem, drive_rounds
from leapdecode.engine.cost import allocate
from leapdecode.engine.drafting import DraftContext, Drafter, Offer, PassCost, Rounds
from leapdecode.engine.submission import Submission

if TYPE_CHECKING:
    from leapdecode.engine.backend import Backend, Scores
    from leapdecode.engine.loop import SequenceRun

T = TypeVar("T")
Planned = tuple[Submission, tuple[Offer, int]]  # a request, its offer and the most its pass verifies exactly


class Isolated(Protocol):
    """Runs `work` for one request; if it fails, that request ends with the error (None)."""

    def __call__(self, submission: Submission, work: Callable[[], T]) -> T | None: ...


def plan_offers(
    decoding: list[Submission], backend: Backend, batch: int, cost: PassCost | None, isolated: Isolated
) -> list[Planned]:
    """Each decoding request's offer and the most drafted tokens its pass on `backend` may verify
    exactly; `batch`: the requests sharing the passes, whom the drafters price rows for (those
    decoding now and those whose prompts are in the passes, decoding in a few steps, while a
    draft's cost is repaid), `cost` their pass's curve (None: a pass of one request's own). A
    request whose drafting fails leaves with its error."""
    groups: dict[int, list[Submission]] = {}
    for submission in decoding:
        groups.setdefault(id(submission.run.drafter.needs.draft_backend), []).append(submission)
    offers: dict[int, tuple[Offer, int]] = {}
    for members in groups.values():
        started = [
            (submission, made)
            for submission in members
            if (made := isolated(submission, functools.partial(_start_offer, submission, backend, batch, cost)))
            is not None
        ]
        drafting = members[0].run.drafter.needs.draft_backend
        done = drive_rounds(drafting, [rounds for _, (_, rounds) in started])
        for (submission, (exact, _)), offer in zip(started, done):
            if isinstance(offer, Exception):
                isolated(submission, functools.partial(_raise, offer))
                continue
            offers[id(submission)] = (offer, len(offer.draft) if exact is None else min(len(offer.draft), exact))
    return [(submission, offers[id(submission)]) for submission in decoding if id(submission) in offers]


def _start_offer(
    submission: Submission, backend: Backend, batch: int, cost: PassCost | None
) -> tuple[int | None, Rounds]:
    """A decoding request's exact bound (the most drafted tokens its pass verifies exactly) and
    its drafter's rounds, not yet started."""
    run = submission.run
    assert run.seq is not None, "a decoding request has its cache"
    exact = backend.draft_limit(run.seq)
    return exact, run.offer(exact, batch, cost)


def _raise(error: Exception) -> None:
    raise error


def cut_drafts(
    planned: list[Planned], base: int, cost: PassCost | None, max_rows: int | None, isolated: Isolated
) -> list[tuple[Submission, BatchItem]]:
    """Cut the decoding requests' offers for the pass (`allocate`; `base`: the rows it holds
    before drafts, `max_rows` the most it may hold, None: as many as the caps allow; `cost` None:
    a pass of one request's own, cut by its offer's curve) and build their items; a request
    whose cut or plan fails leaves with its error, the others go on."""
    kept = cut_offers([offer for _, (offer, _) in planned], [cap for _, (_, cap) in planned], base, cost, max_rows)
    items: list[tuple[Submission, BatchItem]] = []
    for (submission, (offer, _)), keep in zip(planned, kept):
        run = submission.run
        plan = isolated(submission, functools.partial(run.plan, offer, keep))
        if plan is not None and run.seq is not None:
            items.append((submission, BatchItem(run.seq, plan[0], plan[1])))
    return items


def cut_offers(
    offers: Sequence[Offer], caps: Sequence[int], base: int, cost: PassCost | None, max_rows: int | None
) -> list[list[int]]:
    """Which tokens of each offer a pass keeps (ascending indices, parents kept), at most `caps[i]`
    of offer i: `allocate` by `cost`, the pass's curve; `cost` None: a pass of one request's own,
    cut by the curve its offer was priced with, or kept whole without one. `base`: the rows the
    pass holds before drafts, `max_rows` the most it may hold (None: as many as the caps allow)."""
    budget = max(max_rows if max_rows is not None else base + sum(caps), base)
    if cost is None and len(offers) == 1:
        cost = offers[0].cost
    if cost is None:  # no curve: each offer whole, up to what its pass verifies exactly
        return [list(range(min(len(offer.draft), cap))) for offer, cap in zip(offers, caps)]
    # a prompt row is worth a token, as a decoding row is: work the requests need either way,
    # where a drafted row is worth only its reach (else a pass that carries a prompt chunk would
    # make drafts look cheap against its cost)
    return allocate(offers, caps, base, base, cost, budget)


def offer_alone(drafter: Drafter, context: DraftContext, cap: int | None = None) -> tuple[Offer, list[int]]:
    """A drafter's offer for a pass of its own (its rounds, if any, over its own draft model) and the
    part that pass keeps, at most `cap` tokens (None: all), cut as `cut_offers` cuts one offer: for
    a driver that runs one request's passes itself (vLLM's slots) and for tests."""
    (offer,) = drive_rounds(drafter.needs.draft_backend, [drafter.offer(context)])
    if isinstance(offer, Exception):
        raise offer
    size = len(offer.draft) if cap is None else min(len(offer.draft), cap)
    return offer, cut_offers([offer], [size], 1, None, None)[0]


def features_for(run: SequenceRun, scores: Scores, wanted: tuple[int, ...]) -> Scores:
    """A request's scores with only the states its drafter asked for (the pass computed the
    union of every request's)."""
    from leapdecode.engine.backend import Scores

    own = run.features
    if own == wanted or scores.features is None:
        return scores if own else Scores(scores.logits)
    width = scores.features.shape[-1] // len(wanted)
    columns = [slice(wanted.index(layer) * width, (wanted.index(layer) + 1) * width) for layer in own]
    return Scores(scores.logits, features=torch.cat([scores.features[:, c] for c in columns], dim=-1))
