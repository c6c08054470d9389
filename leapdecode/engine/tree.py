"""Token trees as data: parent indices, compiled once per shape into an attention mask and depths.

A tree draft is a list of drafted tokens and, for each, the index of its parent among the
drafted tokens (-1: a child of the root). The root is the pending token, the last token the
target emitted and has not cached yet. Parents come before their children, so a chain is
`parents = (-1, 0, 1, ...)`.

In the forward pass the block is [root, d_0, ..., d_{D-1}] (node 0 is the root, node i+1 is
d_i); node i attends to the whole cached prefix and to the nodes on its own root-to-node path,
and sits at position `past + depth(i)`. Its logits are then exactly those of its root-to-node
sequence, so one pass scores every branch.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class TreeLayout:
    """A compiled tree shape; node 0 is the root, node i+1 the drafted token i."""

    parents: tuple[int, ...]  # per drafted token: parent among drafted tokens, -1 for the root
    children: tuple[tuple[int, ...], ...]  # per node: child nodes, in draft order
    depth: torch.Tensor  # [D+1] long: root 0
    depths: tuple[int, ...]  # the same on the host: a node's output position is the first row's + its depth
    ancestors: torch.Tensor  # [D+1, D+1] bool: [i, j] is True when node j is node i or above it
    is_chain: bool
    # device copies of `depth` and of the blocked (non-ancestor) pairs, made once per device
    _on_device: dict[tuple[str, str], torch.Tensor] = field(default_factory=dict, repr=False, compare=False)

    def depth_on(self, device: torch.device) -> torch.Tensor:
        """`depth` [D+1] on `device` (copied once)."""
        key = ("depth", str(device))
        if key not in self._on_device:
            self._on_device[key] = self.depth.to(device)
        return self._on_device[key]

    def blocked_on(self, device: torch.device) -> torch.Tensor:
        """[D+1, D+1] bool on `device` (copied once): True where node i may not see node j."""
        key = ("blocked", str(device))
        if key not in self._on_device:
            self._on_device[key] = (~self.ancestors).to(device)
        return self._on_device[key]

    @property
    def num_nodes(self) -> int:
        return len(self.parents) + 1

    def path_to(self, node: int) -> list[int]:
        """Nodes from the root's first child down to `node` (empty for the root)."""
        path = []
        while node > 0:
            path.append(node)
            node = self.parents[node - 1] + 1
        return path[::-1]

    def attention_mask(self, past: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """[1, 1, D+1, past+D+1] additive mask: 0 where a node may attend, -inf elsewhere.
        Built whole (O(context)); the decode loop uses `TreeMaskBuffer`, which writes only the draft's block."""
        n = self.num_nodes
        mask = torch.zeros(n, past + n, dtype=dtype, device=device)
        mask[:, past:] = mask[:, past:].masked_fill(self.blocked_on(device), torch.finfo(dtype).min)
        return mask[None, None]


class TreeMaskBuffer:
    """One sequence's tree attention mask, kept from pass to pass.

    The cached prefix is visible to every node, so its columns are all zeros and stay so: each
    pass writes only the [D+1, D+1] block of the draft (and clears the previous pass's block),
    which costs O(draft^2) instead of O(draft * context). The buffer grows by doubling, so its
    allocation is amortised too. Returns views [1, 1, D+1, past+D+1] into the buffer: valid
    until the next call."""

    def __init__(self) -> None:
        self.buffer: torch.Tensor | None = None  # [rows, columns] additive mask
        self.written = (0, 0)  # columns of the last block written

    def mask(self, tree: TreeLayout, past: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        n = tree.num_nodes
        buffer = self.buffer
        if (
            buffer is None
            or buffer.dtype != dtype
            or buffer.device != device
            or buffer.shape[0] < n
            or buffer.shape[1] < past + n
        ):
            rows = max(n, buffer.shape[0] if buffer is not None else 0)
            columns = max(2 * (past + n), 256)
            buffer = self.buffer = torch.zeros(rows, columns, dtype=dtype, device=device)
        else:
            buffer[:, self.written[0] : self.written[1]] = 0
        block = buffer[:n, past : past + n]  # [D+1, D+1]
        block.masked_fill_(tree.blocked_on(device), torch.finfo(dtype).min)
        self.written = (past, past + n)
        return buffer[:n, : past + n][None, None]


@functools.lru_cache(maxsize=512)
def compile_tree(parents: tuple[int, ...]) -> TreeLayout:
    """Check a parent list and build its layout (cached: drafters reuse a few shapes)."""
    n = len(parents) + 1
    depth = [0] * n
    children: list[list[int]] = [[] for _ in range(n)]
    ancestors = torch.eye(n, dtype=torch.bool)  # [n, n]
    for i, parent in enumerate(parents):
        if not -1 <= parent < i:
            raise ValueError(f"parent of drafted token {i} must be in [-1, {i - 1}], got {parent}")
        node, parent_node = i + 1, parent + 1
        depth[node] = depth[parent_node] + 1
        children[parent_node].append(node)
        ancestors[node] = ancestors[parent_node]
        ancestors[node, node] = True
    is_chain = all(p == i - 1 for i, p in enumerate(parents))
    return TreeLayout(
        parents=parents,
        children=tuple(tuple(c) for c in children),
        depth=torch.tensor(depth),
        depths=tuple(depth),
        ancestors=ancestors,
        is_chain=is_chain,
    )


def chain_parents(length: int) -> tuple[int, ...]:
    return tuple(range(-1, length - 1))


def full_tree_parents(nodes: int, width: int = 3) -> tuple[int, ...]:
    """The parents of a breadth-first tree with `width` children per node, as drafters build."""
    return tuple(-1 if i < width else i // width - 1 for i in range(nodes))
