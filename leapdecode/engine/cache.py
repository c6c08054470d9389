"""A sequence's KV cache: its state, the growing cache layer, and the one place a cache shrinks.

A `CacheState` owns one sequence's `transformers` cache, whose layers append in place
(`GrowingLayer`); `rollback_cache` and `keep_cache_entries` cut it back after a verdict,
`cache_room` / `extend_cache` let a forward of our own (`models.lean`) write its buffers directly,
and `snapshot_cache` copies a prefix to keep (`engine.prefix_cache`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import torch

from leapdecode.engine.tree import TreeMaskBuffer


@dataclass
class CacheState:
    """One sequence's KV cache. `length` is how many tokens the cache holds."""

    cache: Any
    length: int
    tree_mask: TreeMaskBuffer = field(default_factory=TreeMaskBuffer)  # reused by every tree pass


def new_growing_cache() -> Any:
    """A `transformers` DynamicCache whose layers append in place (`GrowingLayer`)."""
    from transformers import DynamicCache

    cache = DynamicCache()
    cache.layer_class_to_replicate = _growing_layer_class()
    return cache


@functools.cache
def _growing_layer_class() -> type:
    from transformers.cache_utils import DynamicLayer

    class GrowingLayer(DynamicLayer):
        """A cache layer whose keys and values are views of a longer buffer: appending writes the
        new tokens in place (the buffer grows by half when full, so copies are amortised), and
        cropping narrows the views. A decode step then copies its own tokens, never the context,
        where `DynamicLayer` concatenates the whole cache every step."""

        def update(
            self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
        ) -> tuple[torch.Tensor, torch.Tensor]:
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            length = self.get_seq_length()
            end = length + key_states.shape[-2]
            keys, values = self.keys, self.values
            assert keys is not None and values is not None, "initialised above"
            buffers: tuple[torch.Tensor, ...] | None = getattr(self, "buffers", None)  # set below, first update
            # rebuilt when full, or when something outside replaced the views (e.g. a beam reorder)
            if buffers is None or end > buffers[0].shape[-2] or buffers[0].data_ptr() != keys.data_ptr() or length == 0:
                capacity = end + max(256, end // 2)
                buffers = tuple(
                    torch.cat(
                        [old[..., :length, :], new.new_zeros((*new.shape[:-2], capacity - length, new.shape[-1]))],
                        dim=-2,
                    )
                    if length
                    else new.new_zeros((*new.shape[:-2], capacity, new.shape[-1]))
                    for old, new in ((keys, key_states), (values, value_states))
                )  # each [batch, kv_heads, capacity, head_dim]
                self.buffers = buffers
            buffers[0][..., length:end, :] = key_states
            buffers[1][..., length:end, :] = value_states
            self.keys, self.values = buffers[0][..., :end, :], buffers[1][..., :end, :]
            return self.keys, self.values

        def room(self, end: int) -> tuple[torch.Tensor, torch.Tensor] | None:
            """The key and value buffers when they hold this layer's tokens and have room up to
            `end`, for a forward that writes them itself (`models.lean`); else None."""
            buffers: tuple[torch.Tensor, ...] | None = getattr(self, "buffers", None)
            if buffers is None or self.keys is None or buffers[0].data_ptr() != self.keys.data_ptr():
                return None
            return (buffers[0], buffers[1]) if end <= buffers[0].shape[-2] else None

        def extend(self, end: int) -> None:
            """Take in the tokens a forward wrote into the buffers up to `end` (after `room`)."""
            self.keys, self.values = self.buffers[0][..., :end, :], self.buffers[1][..., :end, :]

    return GrowingLayer


def cache_room(seq: CacheState, count: int) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
    """Each layer's key and value buffers [1, kv_heads, capacity, dim] with room for `count` more
    tokens, when every layer of `seq`'s cache is a growing one holding its `length` tokens; else
    None (a forward through the cache's `update` then grows it). After writing them, `extend_cache`."""
    layers: list[Any] = list(seq.cache.layers)
    growing = _growing_layer_class()
    if not layers or not all(isinstance(layer, growing) for layer in layers):
        return None
    if any(layer.get_seq_length() != seq.length for layer in layers):
        return None
    rooms = [layer.room(seq.length + count) for layer in layers]
    return None if any(room is None for room in rooms) else [room for room in rooms if room is not None]


def extend_cache(seq: CacheState, count: int) -> None:
    """Every layer takes in `count` tokens written into its buffers (after `cache_room`); the
    caller then counts them in `seq.length`."""
    for layer in seq.cache.layers:
        layer.extend(seq.length + count)


def rollback_cache(seq: CacheState, length: int) -> None:
    """Cut a `transformers` cache back to `length` tokens (every layer, however far a failed pass
    wrote into it); the one place a cache shrinks."""
    if not 0 <= length <= seq.length:
        raise ValueError(f"cannot roll a cache of {seq.length} tokens back to {length}")
    # each layer from its own length: a pass that failed part-way leaves the first layers longer
    for layer in seq.cache.layers:
        extra = layer.get_seq_length() - length
        if extra > 0:
            layer.crop(-extra)  # a negative count: tokens to remove from the end
    seq.length = length


def keep_cache_entries(seq: CacheState, start: int, nodes: list[int]) -> None:
    """Move the entries `start + nodes[j]` to `start + j` in every layer, then cut the rest:
    after a tree pass, only the root and the accepted path stay, in order. A chain's path is
    already in place, so this is then a plain rollback."""
    if any(n < 0 or start + n >= seq.length for n in nodes):
        raise ValueError(f"cannot keep nodes {nodes} after {start} in a cache of {seq.length} tokens")
    if nodes != list(range(len(nodes))):
        source = torch.tensor(nodes, dtype=torch.long, device=seq.cache.layers[0].keys.device) + start  # [len(nodes)]
        for layer in seq.cache.layers:
            for states in (layer.keys, layer.values):  # [batch, heads, length, head_dim]
                states[:, :, start : start + len(nodes)] = states[:, :, source]
    rollback_cache(seq, start + len(nodes))


@torch.inference_mode()
def snapshot_cache(seq: CacheState, length: int) -> CacheState:
    """An exact-size copy of `seq`'s first `length` tokens, to keep (`engine.prefix_cache`): a
    kept cache never grows (requests start from copies of it, `TorchBackend.fork`), so it keeps
    none of the room a growing cache holds."""
    from transformers import DynamicCache

    if not 1 <= length <= seq.length:
        raise ValueError(f"cannot keep {length} tokens of a cache of {seq.length}")
    copy = DynamicCache()
    for index, layer in enumerate(seq.cache.layers):
        copy.update(layer.keys[..., :length, :], layer.values[..., :length, :], index)  # concatenated: a copy
    return CacheState(cache=copy, length=length)
