"""EAGLE-3 drafting: a trained head reads the target's states and drafts a chain or a tree.

Paper: EAGLE-3 (Li et al. 2503.01840); the dynamic tree is EAGLE-2's (2406.16858).

After each verification pass the loop hands the head the target's states at the positions it
kept (`hear`): entries the head commits to its own cache, each paired with the token
that followed (an accepted draft, or the target's bonus token). The last committed entry's output
predicts the first drafted token; every further drafting step feeds the head its own output.

The tree grows like EAGLE-2's: the root's `width` best tokens are depth 1; at each depth the
`width` candidates with the highest path probability (product of the head's conditional
probabilities) are run together in one head pass, each proposing its `width` best children; at
the end the `nodes` most probable candidates of every depth form the tree (a child is never more
probable than its parent, so it is closed under ancestors). `width=1` drafts a chain. With
`min_prob`, growth stops at the first level where no candidate's path is that probable.

Drafting entries live in the head's cache only while drafting: `propose` cuts them before it
commits the target's states, as the target's cache drops rejected drafts. Per pass the head does
work proportional to the draft, and the draft comes to the host in one transfer (with
`min_prob`, each level's best score too: one scalar a level, to stop growing).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from leapdecode.drafters.base import StreamDrafter
from leapdecode.engine.drafting import Draft, Evidence, Needs, PassResult
from leapdecode.heads.eagle3 import Eagle3Head, HeadCache


class Eagle3Drafter(StreamDrafter):
    """Drafts with an EAGLE-3 head over the target's states (see the module doc)."""

    def __init__(
        self, head: Eagle3Head, *, depth: int = 6, width: int = 1, nodes: int = 0, min_prob: float = 0.0
    ) -> None:
        if depth < 1 or width < 1 or not 0.0 <= min_prob < 1.0:
            raise ValueError(f"depth and width must be >= 1 and min_prob in [0, 1), got {depth}, {width}, {min_prob}")
        self.head = head
        self.depth, self.width = depth, width
        # stop growing once no candidate's path is this probable: each level costs a head pass,
        # and a draft that improbable is rarely accepted (one host read per level; 0: never stop)
        self.floor = math.log(min_prob) if min_prob > 0 else None
        self.nodes = nodes or depth * width  # the tree's size (a chain: depth)
        self.needs = Needs(features=tuple(head.config.aux_layers))
        self.stream: list[int] = []
        self.cache = HeadCache()
        self.committed = 0  # head entries built from the target's states
        self.pending: list[torch.Tensor] = []  # states not yet committed, each [rows, F]
        self.root: torch.Tensor | None = None  # [hidden]: the last committed entry's pre-norm output

    def reset(self, prompt_ids: Sequence[int]) -> None:
        self.stream = list(prompt_ids)
        self.cache = HeadCache()
        self.committed = 0
        self.pending = []
        self.root = None

    def hear(self, result: PassResult) -> None:
        # the prompt's states, or the kept rows': [rows, 3 * hidden]
        if result.features is not None:
            self.pending.append(result.features)
        self.update(result.tokens, result.accepted)

    def update(self, tokens: Sequence[int], num_accepted: int) -> None:
        self.stream.extend(tokens)

    @torch.inference_mode()
    def _commit(self) -> None:
        """Drop the last draft's entries; add one entry per pending state (state i with token i+1)."""
        self.cache.truncate(self.committed)
        if not self.pending:
            return
        states = torch.cat(self.pending)[None]  # [1, m, F]
        self.pending = []
        m, start = states.shape[1], self.committed
        if len(self.stream) < start + m + 1:
            raise RuntimeError(
                f"{start + m} states but a stream of {len(self.stream)} tokens: the loop's order was broken"
            )
        device = states.device
        tokens = torch.tensor([self.stream[start + 1 : start + m + 1]], device=device)  # [1, m]
        positions = torch.arange(start, start + m, device=device)[None]  # [1, m]
        columns = torch.arange(start + m, device=device)  # [start+m]
        mask = (columns[None, :] <= positions[0, :, None])[None]  # [1, m, start+m]: causal
        out, _ = self.head.attend(states, tokens, positions, mask, fuse=True, cache=self.cache)
        self.root = out[0, -1]  # [hidden]
        self.committed += m

    def propose(self, max_tokens: int) -> Draft:
        self._commit()
        depth = min(self.depth, max_tokens)
        if depth <= 0 or self.root is None:
            return Draft()
        return self._grow(depth, self.root)

    @torch.inference_mode()
    def _grow(self, depth: int, root: torch.Tensor) -> Draft:
        head, k, device = self.head, self.width, root.device
        logp = head.logits(root).float().log_softmax(-1)  # [draft_vocab]
        top = logp.topk(k)
        tokens, scores = [head.to_target(top.indices)], [top.values]  # per depth: [k], then [k*k]
        probs, parents = [top.values.exp()], [torch.full((k,), -1, device=device)]
        frontier = torch.arange(k, device=device)  # candidate indices run next
        hidden = root.expand(1, k, -1)  # [1, k, hidden]: each frontier node's input state
        ancestry = torch.eye(k, dtype=torch.bool, device=device)  # [run, run]: entry j is i's ancestor (or i)
        offset, run = 0, 0  # candidates before this depth; head entries drafted so far
        flat_tokens = tokens[0]
        for level in range(1, depth):
            if self.floor is not None and float(scores[-1].max()) < self.floor:
                break
            # 1. Run the frontier in one pass: each node sees the committed entries and its own path.
            rows = ancestry[run:]  # [k, run+k]
            mask = torch.cat([torch.ones(k, self.committed, dtype=torch.bool, device=device), rows], dim=1)[None]
            positions = torch.full((1, k), self.committed + level - 1, device=device)
            out, _ = head.attend(hidden, flat_tokens[frontier][None], positions, mask, fuse=False, cache=self.cache)
            # 2. Each node's best children; all are candidates, the best `k` the next frontier.
            child = head.logits(out[0]).float().log_softmax(-1).topk(k)  # [k, k]
            child_scores = (scores_of(scores, frontier, offset)[:, None] + child.values).reshape(-1)  # [k*k]
            offset += scores[-1].numel()
            tokens.append(head.to_target(child.indices).reshape(-1))
            scores.append(child_scores)
            probs.append(child.values.exp().reshape(-1))
            parents.append(frontier.repeat_interleave(k))
            flat_tokens = torch.cat(tokens)
            best = child_scores.topk(k).indices  # [k], within this depth
            hidden = out[:, best // k]  # [1, k, hidden]
            grown = torch.zeros(run + 2 * k, run + 2 * k, dtype=torch.bool, device=device)
            grown[: run + k, : run + k] = ancestry
            grown[run + k :, : run + k] = ancestry[run + best // k]
            grown[run + k :, run + k :] = torch.eye(k, dtype=torch.bool, device=device)
            ancestry, run = grown, run + k
            frontier = offset + best
        return self._select(tokens, scores, probs, parents)

    def _select(
        self,
        tokens: list[torch.Tensor],
        scores: list[torch.Tensor],
        probs: list[torch.Tensor],
        parents: list[torch.Tensor],
    ) -> Draft:
        """The `nodes` most probable candidates as a tree, parents first; one host transfer."""
        depths = [torch.full_like(t, d) for d, t in enumerate(tokens)]
        table = torch.stack([torch.cat(x).double() for x in (tokens, scores, probs, parents, depths)]).tolist()
        token, score, prob, parent, depth = table
        chosen = sorted(range(len(token)), key=lambda i: (-score[i], depth[i], i))[: self.nodes]
        chosen.sort(key=lambda i: (depth[i], i))
        kept: list[int] = []
        where: dict[int, int] = {}  # candidate -> index in the tree
        for c in chosen:  # parents first; a node whose parent lost a tie is dropped
            if parent[c] < 0 or int(parent[c]) in where:
                where[c] = len(kept)
                kept.append(c)
        ids = [int(token[c]) for c in kept]
        evidence = tuple(Evidence("head", min(9, int(10 * prob[c]))) for c in kept)
        if self.width == 1:
            return Draft(ids, evidence=evidence)
        tree = tuple(-1 if parent[c] < 0 else where[int(parent[c])] for c in kept)
        return Draft(ids, parents=tree, evidence=evidence)


def scores_of(scores: list[torch.Tensor], frontier: torch.Tensor, offset: int) -> torch.Tensor:
    """The path scores [k] of the frontier's candidates (indices past `offset` lie in the last depth)."""
    return scores[-1][frontier - offset]
