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

from leapdecode.engine.noise import PositionNoise, Stream, choose
from leapdecode.engine.sampling import SamplingParams, logits_to_probs
from leapdecode.engine.tree import TreeLayout
from leapdecode.engine.verdict import Verdict
from leapdecode.verifiers.verdict import (
    emitted_logprobs,
    greedy_transfer,
    host_tokens,
    log_probs,
    split_candidates,
    top_logprobs,
)


def verify_tree_greedy(
    draft_tokens: Sequence[int] | torch.Tensor,  # [D]
    tree: TreeLayout,
    target_logits: torch.Tensor,  # [D+1, vocab]: row i predicts the token after node i
    *,
    position: int = 0,  # the root row's output position; unused: greedy draws no noise
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
    noise: PositionNoise,
    *,
    position: int,
    logprobs: int | None = None,
) -> Verdict:
    """Coupled verification over a tree (`leapdecode.verifiers.sampling`): node i's row decides
    output position `position + depth(i)`, where the target chooses y_i = choose(p_i, u); walk
    down from the root into the child that carries y at each node, and emit y at the first node
    without one. A child x is taken with probability p(x); with siblings carrying distinct tokens
    the walk is SpecInfer's recursive rejection with one-hot q (2305.09781), each emitted token
    distributed exactly as p, and the emitted tokens are those of plain sampling with the same
    seed. One device-to-host transfer; the walk runs on the host."""
    tokens = host_tokens(draft_tokens)
    p = logits_to_probs(target_logits, params)  # [D+1, vocab]
    u = noise.uniforms([position + d for d in tree.depths], Stream.TARGET, p.device)  # [D+1]
    chosen = choose(p, u)  # [D+1]: the target's token after each node
    predicted = target_logits.argmax(dim=-1)  # [D+1]
    parts = [chosen.double(), predicted.double()]
    if logprobs is not None:
        logp = log_probs(target_logits)  # [D+1, vocab]
        parts += [logp.gather(-1, chosen[:, None])[:, 0].double(), top_logprobs(logp, logprobs)]
    host = torch.cat(parts).tolist()  # the one device-to-host transfer
    num_nodes = len(tokens) + 1
    chosen_h = [int(x) for x in host[:num_nodes]]
    predicted_h = [int(x) for x in host[num_nodes : 2 * num_nodes]]
    node, path = 0, []
    while True:
        child = next((c for c in tree.children[node] if tokens[c - 1] == chosen_h[node]), None)
        if child is None:
            break
        path.append(child - 1)
        node = child
    emitted = [tokens[i] for i in path] + [chosen_h[node]]
    if logprobs is None:
        return Verdict(path, emitted, predicted_h)
    scored_at = [0, *(i + 1 for i in path)]  # the row that decided each emitted token: its parent node
    base = 2 * num_nodes
    record = emitted_logprobs(
        emitted, scored_at, [host[base + r] for r in scored_at], host[base + num_nodes :], logprobs
    )
    return Verdict(path, emitted, predicted_h, record)
