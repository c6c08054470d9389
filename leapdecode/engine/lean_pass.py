"""Passes of a `TorchBackend` on the lean forward (`models.lean`): the model's decoder layers in a
few calls, or one C++ call a pass, giving bitwise the scores its own forward gives.

A backend takes the lean forward only after `lean_agrees`: a 6-token prompt, a 2-token chain and
a 4-node tree after it, scored through the model's own forward, the C++ layers and the Python
loop, must give the same bits. By construction they run the same kernels and float operations, so a model that
fails the check has something the lean forward does not run (and keeps its own forward).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from leapdecode.engine.cache import CacheState, cache_room, extend_cache, new_growing_cache
from leapdecode.engine.tree import TreeLayout, compile_tree
from leapdecode.models.lean import Attend, LeanDecoder, NativeSequence

# (tokens [n] appended to the sequence, the sequence; `native`: the C++ layers where they can run;
# a tree or None: a chain) -> the pass's scores [n, vocab]
LeanRun = Callable[[list[int], CacheState, bool, TreeLayout | None], torch.Tensor]
OwnRun = Callable[[list[int], CacheState, TreeLayout | None], torch.Tensor]


def lean_states(
    decoder: LeanDecoder, tokens: torch.Tensor, seq: CacheState, *, native: bool = True, tree: TreeLayout | None = None
) -> torch.Tensor:
    """The lean forward of `tokens` [n] after `seq`'s cache, which it writes (`seq.length` is the
    caller's to move), a chain or `tree`'s nodes (root first, each seeing its own path): the C++
    layers where the cache has room, else the Python loop, which grows it -> the final norm's
    states [n, hidden]."""
    n, device = tokens.shape[0], tokens.device
    visible = None
    if tree is None or tree.is_chain:
        positions = torch.arange(seq.length, seq.length + n, device=device)  # [n]
    else:
        positions = seq.length + tree.depth_on(device)  # [n]
        visible = seq.tree_mask.mask(tree, seq.length, torch.float32, device)[0, 0] == 0  # [n, past+n]
    room = cache_room(seq, n) if native and decoder.native is not None else None
    if room is None:
        return decoder.forward(tokens, positions, decoder.attend_cache(seq.cache, visible))
    states = decoder.forward_native(tokens, positions, [NativeSequence(seq.length, n, room, visible)])
    extend_cache(seq, n)
    return states


def lean_packed_states(
    decoder: LeanDecoder, input_ids: torch.Tensor, positions: torch.Tensor, cache: Any
) -> torch.Tensor | None:
    """A packed pass (`engine.batch.PackedCache`: its items' tokens side by side in `input_ids`,
    `positions` [N]) through the C++ layers, each sequence's rows over its own cache, which it
    writes (`seq.length` is the caller's to move) -> the final norm's states [N, hidden]; None,
    writing nothing, where the C++ layers do not run or a sequence's cache lacks room (then the
    Python loop runs the pass and grows it)."""
    if decoder.native is None:
        return None
    sequences = []
    for item, mask in zip(cache.items, cache.masks):
        n = len(item.tokens)
        room = cache_room(item.seq, n)
        if room is None:
            return None
        chain = item.tree is None or item.tree.is_chain
        # a chain attends causally, as its own pass does; a tree's nodes the keys its mask shows
        visible = None if chain or mask is None else (mask[0, 0] if mask.dtype == torch.bool else mask[0, 0] == 0)
        sequences.append(NativeSequence(item.seq.length, n, room, visible))
    states = decoder.forward_native(input_ids, positions, sequences)
    for item in cache.items:
        extend_cache(item.seq, len(item.tokens))
    return states


def attend_packed(decoder: LeanDecoder, cache: Any) -> Attend:
    """The lean forward's attention in a packed pass (`engine.batch.PackedCache`): each sequence's
    rows over that sequence's own cache, through the same function a packed own pass calls."""

    def attend(index: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        cache.update(key, value, index)
        result: torch.Tensor = cache.attend_layer(index, query, decoder.scale)
        return result

    return attend


CHECK_TREE = compile_tree((-1, -1, 0))  # the root, two children, a grandchild: `lean_agrees`' tree pass


def lean_agrees(own: OwnRun, lean: LeanRun, vocab: int, *, trees: bool = True) -> bool:
    """Whether `lean` scores bitwise as `own` does: a 6-token prompt, a 2-token chain after it and
    (`trees`: where the backend scores trees) a 4-node tree (`CHECK_TREE`) after that, on fresh
    sequences, through the C++ layers (the chain and the tree) and through the Python loop."""
    tokens = torch.randint(0, vocab, (12,), generator=torch.Generator().manual_seed(0)).tolist()
    sequences = [CacheState(cache=new_growing_cache(), length=0) for _ in range(3)]  # own, C++, Python
    passes = [(0, 6, None), (6, 8, None)] + ([(8, 12, CHECK_TREE)] if trees else [])
    with torch.inference_mode():
        for a, b, tree in passes:
            want = own(tokens[a:b], sequences[0], tree)
            got = [lean(tokens[a:b], sequences[1], True, tree), lean(tokens[a:b], sequences[2], False, tree)]
            if not all(torch.equal(want, scores) for scores in got):
                return False
    return True
