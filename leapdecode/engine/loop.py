"""The decode loop: one loop for every method.

    prefill -> repeat: emit (cut at a stop) -> tell the drafter, draft -> score pending token +
               draft in one pass -> verify -> keep the accepted path in the KV cache

Plain decoding is the same loop with a drafter that never drafts. A draft is a chain, or a tree
(`Draft.parents`): a tree is scored in the same single pass with a tree attention mask, and the
cache keeps only its accepted path. The drafter and the verifiers come in as arguments (the
engine depends on their interfaces only): `leapdecode.drafters.base` and
`leapdecode.verifiers.verdict`.

Per step the loop does work proportional to the draft, never to the context, and makes one
device-to-host transfer (inside the verifier).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from leapdecode.engine.backend import Backend
from leapdecode.engine.stopping import StopCriteria
from leapdecode.engine.tree import TreeLayout, compile_tree

if TYPE_CHECKING:
    from leapdecode.drafters.base import Drafter
    from leapdecode.verifiers.verdict import TokenLogprob, Verdict

class Verifier(Protocol):
    """(drafted tokens [D], target logits [D+1, vocab], draft probs q [D, vocab] or None) -> Verdict;
    `position`: the output position the first row decides (a sampled request's noise is per position)."""

    def __call__(self, draft: Sequence[int], logits: torch.Tensor, q: torch.Tensor | None, *, position: int) -> Verdict: ...


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


def decode(
    backend: Backend,
    prompt_ids: Sequence[int],
    drafter: Drafter,
    stop: StopCriteria,
    verifier: Verifier,
    tree_verifier: TreeVerifier,
) -> Iterator[Step]:
    """Generate after `prompt_ids`, yielding one `Step` per target forward pass."""
    # 1. Prefill: the prompt's pass also gives the first new token.
    # trained heads draft from the target's own states (feature_layers); others ask for none
    wants = {"features": drafter.feature_layers} if drafter.feature_layers else {}
    seq, scores = backend.prefill(list(prompt_ids), **wants)
    verdict = verifier((), scores.logits[-1:], None, position=0)
    new_tokens = verdict.tokens
    drafter.reset(prompt_ids)
    drafter.attach(backend, seq)
    if wants:
        drafter.take_features(scores.features)  # [prompt, F]
    generated: list[int] = []
    drafted: tuple[int, ...] = ()
    parents: tuple[int, ...] | None = None
    path: list[int] = []
    while True:
        # 2. Emit what the target produced, cut at EOS / a stop string / the budget.
        keep, reason = stop.cut(generated, new_tokens)
        generated.extend(new_tokens[:keep])
        logprobs = None if verdict.logprobs is None else tuple(verdict.logprobs[:keep])
        yield Step(drafted, len(path), tuple(new_tokens[:keep]), reason, parents, tuple(path), logprobs)
        if reason is not None:
            drafter.finish()
            return
        # 3. Tell the drafter; ask for a draft (the deepest branch of a tree counts) no longer
        #    than what is left, less the bonus token, and than the backend verifies exactly
        #    (a tree's nodes all count there: a wider tree keeps its first nodes).
        drafter.update(new_tokens, len(path))
        budget = stop.max_new_tokens - len(generated) - 1
        exact = backend.draft_limit(seq)
        draft = drafter.propose(budget if exact is None else min(budget, exact))
        draft = draft if exact is None else draft.first(exact)
        tree = compile_tree(draft.parents) if draft.parents is not None else None
        # 4. Score the pending token (emitted, not yet cached) and the draft in one pass.
        start = seq.length
        scores = backend.forward(seq, [new_tokens[-1], *draft.tokens], tree=tree, **wants)
        # 5. Verify: the longest prefix (tree: root-to-node path) the target agrees with, plus
        #    its bonus token; the step's one device-to-host transfer.
        #    Row 0 decides output position len(generated): the pending token is already emitted.
        if tree is None:
            verdict = verifier(draft.tokens, scores.logits, draft.q, position=len(generated))
        else:
            verdict = tree_verifier(draft.tokens, tree, scores.logits, position=len(generated))
        path, new_tokens = verdict.path, verdict.tokens
        drafted, parents = tuple(draft.tokens), draft.parents
        # 6. Keep the root and the accepted path in the cache; the bonus token is not cached yet.
        kept = [0, *(i + 1 for i in path)]
        backend.keep(seq, start, kept)
        if wants:
            drafter.take_features(scores.features[kept])  # [1 + accepted, F]
        # 7. Jacobi-style and recycling drafters learn from the target's own predictions.
        if drafter.observes_target:
            drafter.observe(verdict.predicted, verdict.candidates)  # [D+1], [D+1][k] or None
