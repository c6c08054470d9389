"""Verification over a token tree: keep the longest root-to-leaf path the target agrees with.

Names as in `leapdecode.verifiers.greedy` (p, q, accepted, rejected, bonus). Here the drafted
tokens form a tree (`leapdecode.engine.tree`); the accepted tokens are one root-to-node path,
every other node is rejected, and the bonus token follows the last accepted node. Tree drafters
are deterministic (q is one-hot on each drafted token), and siblings carry distinct tokens.

Both functions return (path, tokens): `path` lists the accepted drafted-token indices from the
root down, `tokens` = [their tokens..., bonus], a [len(path)+1] long tensor.
"""

from __future__ import annotations

import torch

from leapdecode.engine.tree import TreeLayout
from leapdecode.verifiers.sampling import SamplingParams, logits_to_probs


def verify_tree_greedy(
    draft_tokens: torch.Tensor,  # [D] long
    tree: TreeLayout,
    target_logits: torch.Tensor,  # [D+1, vocab]: row i predicts the token after node i
) -> tuple[list[int], torch.Tensor]:
    """Walk down from the root while a child carries the target's argmax."""
    predicted = target_logits.argmax(dim=-1).tolist()  # [D+1]
    tokens = draft_tokens.tolist()
    node, path = 0, []
    while True:
        want = predicted[node]
        child = next((c for c in tree.children[node] if tokens[c - 1] == want), None)
        if child is None:
            break
        path.append(child - 1)
        node = child
    kept = [tokens[i] for i in path] + [predicted[node]]
    return path, torch.tensor(kept, dtype=torch.long, device=target_logits.device)


def verify_tree_speculative(
    draft_tokens: torch.Tensor,  # [D] long
    tree: TreeLayout,
    target_logits: torch.Tensor,  # [D+1, vocab]
    params: SamplingParams,
    generator: torch.Generator | None = None,
) -> tuple[list[int], torch.Tensor]:
    """Recursive rejection over siblings (SpecInfer, 2305.09781) with one-hot q: at a node, try
    its children in order, accepting child x with probability p(x); after a rejection p becomes
    norm(p with x removed), the residual for a one-hot q. The first accepted child becomes the
    node; when every child is rejected the bonus token is drawn from the residual p. Each
    emitted token is therefore distributed exactly as p."""
    tokens = draft_tokens.tolist()
    node, path = 0, []
    while True:
        p = logits_to_probs(target_logits[node : node + 1], params)[0]  # [vocab]
        accepted = None
        for child in tree.children[node]:
            x = tokens[child - 1]
            u = float(torch.rand(1, generator=generator, device=p.device))
            if u < float(p[x]):
                accepted = child
                break
            p = p.clone()
            p[x] = 0.0
            p = p / p.sum()  # p(x) < 1 here, since u < 1 = p(x) always accepts
        if accepted is None:
            last = int(torch.multinomial(p, 1, generator=generator))
            break
        path.append(accepted - 1)
        node = accepted
    kept = [tokens[i] for i in path] + [last]
    return path, torch.tensor(kept, dtype=torch.long, device=target_logits.device)
