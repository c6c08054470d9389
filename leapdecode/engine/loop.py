"""The decode loop: one loop for every method.

    prefill -> repeat: draft -> score pending token + draft in one pass -> verify ->
               roll the KV cache back -> emit (cut at a stop) -> tell the drafter

Plain decoding is the same loop with a drafter that never drafts. A draft is a chain, or a tree
(`Draft.parents`): a tree is scored in the same single pass with a tree attention mask, and the
cache keeps only its accepted path.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch

from leapdecode.drafters.base import Draft, Drafter
from leapdecode.engine.backend import Backend
from leapdecode.engine.stopping import StopCriteria
from leapdecode.engine.tree import TreeLayout, compile_tree
from leapdecode.verifiers.greedy import verify_greedy
from leapdecode.verifiers.tree import verify_tree_greedy

# (drafted tokens [D], target logits [D+1, vocab], draft probs q [D, vocab] or None) -> (A, [A+1] tokens)
Verifier = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], tuple[int, torch.Tensor]]
# (drafted tokens [D], their tree, target logits [D+1, vocab]) -> (accepted path, [len(path)+1] tokens)
TreeVerifier = Callable[[torch.Tensor, TreeLayout, torch.Tensor], tuple[list[int], torch.Tensor]]


@dataclass(frozen=True)
class Step:
    """One target forward pass: what was drafted, how much was accepted, what was emitted."""

    drafted: tuple[int, ...]
    num_accepted: int  # drafted tokens the target kept
    tokens: tuple[int, ...]  # emitted: accepted drafts + the bonus token, cut at a stop
    finish_reason: str | None  # "stop", "length", or None while generation goes on
    parents: tuple[int, ...] | None = None  # the draft's tree (None: a chain)
    path: tuple[int, ...] = ()  # indices of the accepted drafted tokens, root first


def decode(
    backend: Backend,
    prompt_ids: Sequence[int],
    drafter: Drafter,
    stop: StopCriteria,
    verifier: Verifier = verify_greedy,
    tree_verifier: TreeVerifier = verify_tree_greedy,
) -> Iterator[Step]:
    """Generate after `prompt_ids`, yielding one `Step` per target forward pass."""
    # 1. Prefill: the prompt's pass also gives the first new token.
    seq, scores = backend.prefill(list(prompt_ids))
    _, first = verifier(scores.logits.new_empty(0, dtype=torch.long), scores.logits[-1:], None)
    new_tokens = first.tolist()
    drafter.reset(prompt_ids)
    drafter.attach(backend, seq)
    generated: list[int] = []
    draft, path = Draft(), []
    while True:
        # 2. Emit what the target produced, cut at EOS / a stop string / the budget.
        keep, reason = stop.cut(generated, new_tokens)
        generated.extend(new_tokens[:keep])
        yield Step(tuple(draft.tokens), len(path), tuple(new_tokens[:keep]), reason, draft.parents, tuple(path))
        if reason is not None:
            return
        # 3. Tell the drafter; ask for a draft (the deepest branch of a tree counts) no longer
        #    than what is left, less the bonus token.
        drafter.update(new_tokens, len(path))
        draft = drafter.propose(stop.max_new_tokens - len(generated) - 1)
        tree = compile_tree(draft.parents) if draft.parents is not None else None
        # 4. Score the pending token (emitted, not yet cached) and the draft in one pass.
        start = seq.length
        scores = backend.forward(seq, [new_tokens[-1], *draft.tokens], tree=tree)
        # 5. Verify: the longest prefix (tree: root-to-node path) the target agrees with, plus its bonus token.
        draft_tensor = torch.tensor(draft.tokens, dtype=torch.long, device=scores.logits.device)
        if tree is None:
            num_accepted, kept = verifier(draft_tensor, scores.logits, draft.q)
            path = list(range(num_accepted))
        else:
            path, kept = tree_verifier(draft_tensor, tree, scores.logits)
        # 6. Keep the root and the accepted path in the cache; the bonus token is not cached yet.
        backend.keep(seq, start, [0, *(i + 1 for i in path)])
        new_tokens = kept.tolist()
        # 7. Jacobi-style drafters refine their guesses from the target's own predictions.
        if drafter.observes_target:
            drafter.observe(scores.logits.argmax(dim=-1).tolist())  # [D+1]
