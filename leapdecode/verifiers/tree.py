"""Verification over a token tree: keep the longest root-to-node path the target agrees with.

Names (p, q, accepted, rejected, bonus) as defined in `leapdecode.verifiers.verdict`. Here the
drafted tokens form a tree (`leapdecode.engine.tree`); the accepted tokens are one root-to-node
path, every other node is rejected, and the bonus token follows the last accepted node. Tree
drafters are deterministic (q is one-hot on each drafted token), and siblings carry distinct tokens.

Both functions return a `Verdict` (path: the accepted drafted-token indices from the root down;
tokens: [their tokens..., bonus]) after one device-to-host transfer.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from leapdecode.engine.sampling import SamplingParams, logits_to_probs
from leapdecode.engine.tree import TreeLayout
from leapdecode.verifiers.verdict import (
    Verdict, emitted_logprobs, greedy_transfer, host_tokens, log_probs, split_candidates, top_logprobs,
)


def verify_tree_greedy(
    draft_tokens: Sequence[int] | torch.Tensor,  # [D]
    tree: TreeLayout,
    target_logits: torch.Tensor,  # [D+1, vocab]: row i predicts the token after node i
    *,
    logprobs: int | None = None,
    candidates: int = 0,
) -> Verdict:
    """Walk down from the root while a child carries the target's argmax (`logprobs`, `candidates`:
    as in `verify_greedy`)."""
    argmax = target_logits.argmax(dim=-1)  # [D+1]
    rows = len(argmax)
    predicted, host = greedy_transfer(target_logits, argmax, logprobs, candidates)  # the one device-to-host transfer
    tokens = host_tokens(draft_tokens)
    node, path = 0, []
    while True:
        want = predicted[node]
        child = next((c for c in tree.children[node] if tokens[c - 1] == want), None)
        if child is None:
            break
        path.append(child - 1)
        node = child
    emitted = [tokens[i] for i in path] + [predicted[node]]
    recycled = split_candidates(host[len(host) - rows * candidates :], rows, candidates) if candidates else None
    if logprobs is None:
        return Verdict(path, emitted, predicted, None, recycled)
    scored_at = [0, *(i + 1 for i in path)]  # the row that predicted each emitted token: its parent node
    record = emitted_logprobs(emitted, scored_at, [host[rows + r] for r in scored_at], host[2 * rows :], logprobs)
    return Verdict(path, emitted, predicted, record, recycled)


def verify_tree_speculative(
    draft_tokens: Sequence[int] | torch.Tensor,  # [D]
    tree: TreeLayout,
    target_logits: torch.Tensor,  # [D+1, vocab]
    params: SamplingParams,
    generator: torch.Generator | None = None,
    *,
    logprobs: int | None = None,
) -> Verdict:
    """Recursive rejection over siblings (SpecInfer, 2305.09781) with one-hot q: at a node, try
    its children in order, accepting child x with probability p(x); after a rejection p becomes
    norm(p with x removed), the residual for a one-hot q, so the j-th child is accepted with
    probability p(x_j) / (1 - sum of the rejected siblings' p). The first accepted child becomes
    the node; when every child is rejected the bonus token is drawn from p without any of the
    children. Each emitted token is therefore distributed exactly as p.

    All random draws are made up front on the device (one uniform per drafted token, one residual
    sample per node: a node's residual is used only when all its children were rejected, so it
    does not depend on the walk), then copied to the host with p at each drafted token in one
    transfer; the walk itself runs on the host."""
    tokens = host_tokens(draft_tokens)
    num_nodes = len(tokens) + 1
    p = logits_to_probs(target_logits, params)  # [D+1, vocab]
    device = p.device
    draft = torch.tensor(tokens, dtype=torch.long, device=device)  # [D]
    parent_rows = torch.tensor([parent + 1 for parent in tree.parents], dtype=torch.long, device=device)  # [D]
    child_p = p[parent_rows, draft]  # [D]: p at the parent of each drafted token, of that token
    u = torch.rand(len(tokens), device=device, generator=generator)  # [D]
    residual = p.index_put((parent_rows, draft), torch.zeros_like(child_p))  # [D+1, vocab]: children removed
    total = residual.sum(-1, keepdim=True)  # [D+1, 1]
    residual = torch.where(total > 0, residual / total.clamp_min(1e-30), p)
    fallback = torch.multinomial(residual, 1, generator=generator)[:, 0]  # [D+1]
    predicted = target_logits.argmax(dim=-1)  # [D+1]
    parts = [child_p.double(), u.double(), fallback.double(), predicted.double()]
    if logprobs is not None:
        logp = log_probs(target_logits)  # [D+1, vocab]
        child_logp = logp[parent_rows, draft]  # [D]: each drafted token at its parent's row
        fallback_logp = logp.gather(-1, fallback[:, None])[:, 0]  # [D+1]
        parts += [child_logp.double(), fallback_logp.double(), top_logprobs(logp, logprobs)]
    host = torch.cat(parts).tolist()  # the one device-to-host transfer
    d = len(tokens)
    child_p_h, u_h = host[:d], host[d : 2 * d]
    fallback_h = [int(x) for x in host[2 * d : 2 * d + num_nodes]]
    predicted_h = [int(x) for x in host[2 * d + num_nodes : 2 * d + 2 * num_nodes]]
    node, path = 0, []
    while True:
        accepted, removed = None, 0.0
        for child in tree.children[node]:
            i = child - 1
            if u_h[i] * max(1.0 - removed, 1e-30) < child_p_h[i]:
                accepted = child
                break
            removed += child_p_h[i]
        if accepted is None:
            last = fallback_h[node]
            break
        path.append(accepted - 1)
        node = accepted
    emitted = [tokens[i] for i in path] + [last]
    if logprobs is None:
        return Verdict(path, emitted, predicted_h)
    base = 2 * d + 2 * num_nodes
    chosen = [host[base + i] for i in path] + [host[base + d + node]]
    scored_at = [0, *(i + 1 for i in path)]
    record = emitted_logprobs(emitted, scored_at, chosen, host[base + d + num_nodes :], logprobs)
    return Verdict(path, emitted, predicted_h, record)
