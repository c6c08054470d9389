"""The decode loop: one loop for every method.

    prefill -> start the drafter -> repeat: emit (cut at a stop) -> offer a draft -> cut it to
               what pays -> score pending token + draft in one pass -> verify -> keep the
               accepted path in the KV cache -> the drafter hears the pass

Plain decoding is the same loop with a drafter that never drafts. A draft is a chain, or a tree
(`Draft.parents`): a tree is scored in the same single pass with a tree attention mask, and the
cache keeps only its accepted path. The drafter and the verifiers come in as arguments, through
the engine's own contract (`engine.drafting`: four calls; `engine.verdict`).

Per step the loop does work proportional to the draft, never to the context, and makes one
device-to-host transfer (inside the verifier). A `SequenceRun` is one generation's side of the
loop; the scheduler (`engine.scheduler`) owns the passes, for a request alone (`decode_run`: a
batch of one) as for many.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from leapdecode.engine.backend import Backend, CacheState, Scores
from leapdecode.engine.drafting import Draft, DraftContext, Drafter, Offer, PassCost, PassResult, Request, Rounds
from leapdecode.engine.stopping import StopCriteria
from leapdecode.engine.tree import TreeLayout, compile_tree
from leapdecode.engine.verdict import TokenLogprob, Verdict


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

        begin(prefill's scores) -> Step;  then repeat:  offer -> plan (the kept part) -> (a pass) -> settle -> Step
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
        # trained heads draft from the target's own states; others ask for none
        self.features: tuple[int, ...] = drafter.needs.features
        self.predictions = drafter.needs.predictions
        self.candidates = drafter.needs.candidates > 0
        self.seq: CacheState | None = None
        self.generated: list[int] = []
        self.done = False
        self._verdict: Verdict | None = None
        self._draft: Draft | None = None
        self._kept: Sequence[int] = ()  # the offered tokens the planned pass scores
        self._tree: TreeLayout | None = None
        self._start = 0

    def begin(self, backend: Backend, seq: CacheState, scores: Scores) -> Step:
        """The prompt was prefilled into `seq` (`scores`: its last row, and features if wanted)."""
        self.seq = seq
        self._verdict = self.verifier((), scores.logits[-1:], None, position=0)
        states = wanted_features(scores) if self.features else None  # [prompt, F]
        prefill = PassResult(self._verdict.tokens, 0, None, states)
        self.drafter.start(Request(self.prompt_ids, self.stop.max_new_tokens, backend, seq, prefill))
        return self._emit((), None)

    @property
    def budget(self) -> int:
        """The most tokens the next draft may hold: what is left, less the bonus token."""
        return self.stop.max_new_tokens - len(self.generated) - 1

    def offer(self, exact: int | None, batch: int = 1, cost: PassCost | None = None) -> Rounds:
        """The drafter's offer for the next pass (its rounds, started by the scheduler): within
        the budget (the deepest branch of a tree counts) and `exact`, the most drafted tokens the
        backend verifies exactly; `batch` sequences share the pass, its rows costing `cost`
        (None: a pass of this request's own)."""
        return self.drafter.offer(DraftContext(self._limit(exact), batch, cost))

    def plan(self, offer: Offer, kept: Sequence[int]) -> tuple[list[int], TreeLayout | None]:
        """The next pass's tokens, [pending token, *the kept part of `offer`] (ascending indices,
        parents kept: the scheduler's cut), and their tree (None: a chain)."""
        assert self.seq is not None, "plan before begin"
        draft = offer.draft.subset(kept)
        self._draft, self._kept, self._start = draft, tuple(kept), self.seq.length
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
        predicted = verdict.predicted if self.predictions else None  # [D+1]
        candidates = verdict.candidates if self.candidates else None  # [D+1][k]
        self.drafter.hear(PassResult(verdict.tokens, len(verdict.path), self._kept, states, predicted, candidates))
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
    """The states a drafter's needs asked the pass for."""
    assert scores.features is not None, "a pass asked for states returned none"
    return scores.features
