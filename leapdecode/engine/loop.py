"""The decode loop: one loop for every method.

    prefill -> repeat: emit (cut at a stop) -> tell the drafter, draft -> score pending token +
               draft in one pass -> verify -> keep the accepted path in the KV cache

Plain decoding is the same loop with a drafter that never drafts. A draft is a chain, or a tree
(`Draft.parents`): a tree is scored in the same single pass with a tree attention mask, and the
cache keeps only its accepted path. The drafter and the verifiers come in as arguments (the
engine depends on their interfaces only): `leapdecode.drafters.base` and
`leapdecode.verifiers.verdict`.

Per step the loop does work proportional to the draft, never to the context, and makes one
device-to-host transfer (inside the verifier). A `SequenceRun` is one generation's side of the
loop; the scheduler (`engine.scheduler`) owns the passes, for a request alone (`decode_run`: a
batch of one) as for many.
"""

from __future__ import annotations

from collections.abc import Generator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from leapdecode.engine.backend import Backend, CacheState, Scores
from leapdecode.engine.stopping import StopCriteria
from leapdecode.engine.tree import TreeLayout, compile_tree

if TYPE_CHECKING:
    from leapdecode.drafters.base import Draft, Drafter, DraftFeed, Offer
    from leapdecode.engine.cost import PassCost
    from leapdecode.verifiers.verdict import TokenLogprob, Verdict


class Verifier(Protocol):
    """(drafted tokens [D], target logits [D+1, vocab], draft probs q [D, vocab] or None) -> Verdict;
    `position`: the output position the first row decides (a sampled request's noise is per position)."""

    def __call__(
        self, draft: Sequence[int], logits: torch.Tensor, q: torch.Tensor | None, *, position: int
    ) -> Verdict: ...


class TreeVerifier(Protocol):
    """(drafted tokens [D], their tree, target logits [D+1, vocab]) -> Verdict; `position` as above."""

    def __call__(self, draft: Sequence[int], tree: TreeLayout, logits: torch.Tensor, *, position: int) -> Verdict: ...


@dataclass(frozen=True)
class PassResult:
    """What a drafter hears of one target pass (or of the prefill), in one event: everything the
    pass produced that a drafter may learn from (`Drafter.hear`)."""

    tokens: Sequence[int]  # emitted: the accepted drafted tokens, then the target's own (bonus) token
    accepted: int  # drafted tokens the target kept
    features: torch.Tensor | None  # [rows, F] the target's states (`feature_layers`): the prompt's, or the kept rows'
    predicted: Sequence[int] | None  # [D+1] the target's greedy token per scored row (`observes_target`)
    candidates: Sequence[Sequence[int]] | None  # [D+1][k] its k best per row (`candidates`), greedy only


@dataclass(frozen=True)
class Step:
    """One target forward pass: what was drafted, how much was accepted, what was emitted."""

    drafted: tuple[int, ...]
    num_accepted: int  # drafted tokens the target kept
    tokens: tuple[int, ...]  # emitted: accepted drafts + the bonus token, cut at a stop
    finish_reason: str | None  # "stop", "length", or None while generation goes on
    parents: tuple[int, ...] | None = None  # the draft's tree (None: a chain)
    path: tuple[int, ...] = ()  # indices of the accepted drafted tokens, root first
    logprobs: tuple[TokenLogprob, ...] | None = None  # one per emitted token, when the verifier was asked


class SequenceRun:
    """One generation, step by step: what `decode` drives for one request, and a batch scheduler
    (`engine.scheduler`) for several in one pass. It owns the request's drafter, verifiers and
    stop criteria; the caller owns the passes.

        begin(prefill's scores) -> Step;  then repeat:  propose -> plan -> (a pass) -> settle -> Step
    """

    def __init__(
        self,
        prompt_ids: Sequence[int],
        drafter: Drafter,
        stop: StopCriteria,
        verifier: Verifier,
        tree_verifier: TreeVerifier,
    ) -> None:
        self.prompt_ids = list(prompt_ids)
        self.drafter = drafter
        self.stop = stop
        self.verifier = verifier
        self.tree_verifier = tree_verifier
        # trained heads draft from the target's own states (feature_layers); others ask for none
        self.features: tuple[int, ...] = drafter.feature_layers
        self.seq: CacheState | None = None
        self.generated: list[int] = []
        self.done = False
        self._verdict: Verdict | None = None
        self._draft: Draft | None = None
        self._tree: TreeLayout | None = None
        self._start = 0

    def begin(self, backend: Backend, seq: CacheState, scores: Scores) -> Step:
        """The prompt was prefilled into `seq` (`scores`: its last row, and features if wanted)."""
        self.seq = seq
        self._verdict = self.verifier((), scores.logits[-1:], None, position=0)
        self.drafter.reset(self.prompt_ids)
        self.drafter.horizon(self.stop.max_new_tokens)
        self.drafter.attach(backend, seq)
        states = wanted_features(scores) if self.features else None  # [prompt, F]
        self.drafter.hear(PassResult(self._verdict.tokens, 0, states, None, None))
        return self._emit((), None)

    @property
    def budget(self) -> int:
        """The most tokens the next draft may hold: what is left, less the bonus token."""
        return self.stop.max_new_tokens - len(self.generated) - 1

    def propose(self, exact: int | None) -> Draft:
        """Tell the drafter what was emitted and ask for a draft (the deepest branch of a tree
        counts) within the budget and `exact`, the most drafted tokens the backend verifies
        exactly (a tree's nodes all count there: a wider tree keeps its first nodes)."""
        draft = self.drafter.propose(self._limit(exact))
        if exact is None or len(draft) <= exact:
            return draft
        # the loop's cut is a cut like any other: a drafter that keeps per-row state hears which
        # of its tokens will be scored (a tree's first nodes keep their parents)
        self.drafter.cut(range(exact))
        return draft.first(exact)

    def offer_rounds(
        self, exact: int | None, batch: int = 1, cost: PassCost | None = None
    ) -> Generator[DraftFeed, tuple[CacheState, Scores], Offer]:
        """As `propose`, for passes shared by `batch` sequences costing `cost` by rows: the whole draft, with
        each token's reach when the drafter estimates it, for the scheduler to cut (`take`); as
        the drafter's rounds over its own draft model (`Drafter.offer_rounds`), started by the scheduler."""
        return self.drafter.offer_rounds(self._limit(exact), batch, cost)

    def take(self, offer: Offer, kept: Sequence[int]) -> Draft:
        """The part of `offer` the scheduler kept (ascending indices, parents kept)."""
        return self.drafter.take(offer, kept)

    def plan(self, draft: Draft) -> tuple[list[int], TreeLayout | None]:
        """The next pass's tokens, [pending token, *draft], and their tree (None: a chain)."""
        assert self.seq is not None, "plan before begin"
        self._draft, self._start = draft, self.seq.length
        self._tree = compile_tree(draft.parents) if draft.parents is not None else None
        return [self._last_verdict().tokens[-1], *draft.tokens], self._tree

    def settle(self, backend: Backend, scores: Scores) -> Step:
        """The planned pass's scores: verify, keep the accepted path in the cache, emit."""
        draft, tree, seq = self._draft, self._tree, self.seq
        assert draft is not None and seq is not None, "settle before plan"
        # 5. Verify: the longest prefix (tree: root-to-node path) the target agrees with, plus
        #    its bonus token; the step's one device-to-host transfer. Row 0 decides output
        #    position len(generated): the pending token is already emitted.
        if tree is None:
            verdict = self.verifier(draft.tokens, scores.logits, draft.q, position=len(self.generated))
        else:
            verdict = self.tree_verifier(draft.tokens, tree, scores.logits, position=len(self.generated))
        self._verdict = verdict
        # 6. Keep the root and the accepted path in the cache; the bonus token is not cached yet.
        kept = [0, *(i + 1 for i in verdict.path)]
        backend.keep(seq, self._start, kept)
        # 7. The drafter hears the pass in one event: what was emitted and accepted, the target's
        #    states at the kept rows (trained heads), its predictions (Jacobi-style, recycling).
        states = wanted_features(scores)[kept] if self.features else None  # [1 + accepted, F]
        observed = self.drafter.observes_target
        predicted = verdict.predicted if observed else None  # [D+1]
        self.drafter.hear(
            PassResult(verdict.tokens, len(verdict.path), states, predicted, verdict.candidates if observed else None)
        )
        self._draft = None
        return self._emit(tuple(draft.tokens), draft.parents)

    def _limit(self, exact: int | None) -> int:
        """The most tokens the next draft may hold: the budget, and what is verified exactly."""
        return self.budget if exact is None else min(self.budget, exact)

    def _last_verdict(self) -> Verdict:
        assert self._verdict is not None, "no pass yet"
        return self._verdict

    def _emit(self, drafted: tuple[int, ...], parents: tuple[int, ...] | None) -> Step:
        """Cut what the target produced at EOS / a stop string / the budget, and record it."""
        verdict = self._last_verdict()
        keep, reason = self.stop.cut(self.generated, verdict.tokens)
        self.generated.extend(verdict.tokens[:keep])
        logprobs = None if verdict.logprobs is None else tuple(verdict.logprobs[:keep])
        if reason is not None:
            self.done = True
            self.drafter.finish()
        return Step(
            drafted, len(verdict.path), tuple(verdict.tokens[:keep]), reason, parents, tuple(verdict.path), logprobs
        )


def wanted_features(scores: Scores) -> torch.Tensor:
    """The states a drafter with `feature_layers` asked the pass for."""
    assert scores.features is not None, "a pass asked for states returned none"
    return scores.features
