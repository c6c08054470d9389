"""Passes of a `TorchBackend` on the lean forward (`models.lean`): the model's decoder layers in a
few calls, or one C++ call a pass, giving bitwise the scores its own forward gives.

A backend takes the lean forward only after `lean_agrees`: a 6-token prompt and a 2-token chain
after it, scored through the model's own forward, the C++ layers and the Python loop, must give
the same bits. By construction they run the same kernels and float operations, so a model that
fails the check has something the lean forward does not run (and keeps its own forward).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from leapdecode.engine.cache import CacheState, cache_room, extend_cache, new_growing_cache
from leapdecode.models.lean import Attend, LeanDecoder

# (tokens [n] appended to the sequence, the sequence; `native`: the C++ layers where they can run)
# -> the pass's scores [n, vocab]
LeanRun = Callable[[list[int], CacheState, bool], torch.Tensor]
OwnRun = Callable[[list[int], CacheState], torch.Tensor]


def lean_states(decoder: LeanDecoder, tokens: torch.Tensor, seq: CacheState, *, native: bool = True) -> torch.Tensor:
    """The lean forward of `tokens` [n] after `seq`'s cache, which it writes (`seq.length` is the
    caller's to move): the C++ layers where the cache has room, else the Python loop, which grows
    it -> the final norm's states [n, hidden]."""
    n = tokens.shape[0]
    room = cache_room(seq, n) if native and decoder.native is not None else None
    if room is None:
        positions = torch.arange(seq.length, seq.length + n, device=tokens.device)  # [n]
        return decoder.forward(tokens, positions, decoder.attend_cache(seq.cache))
    states = decoder.forward_native(tokens, seq.length, room)
    extend_cache(seq, n)
    return states


def attend_packed(decoder: LeanDecoder, cache: Any) -> Attend:
    """The lean forward's attention in a packed pass (`engine.batch.PackedCache`): each sequence's
    rows over that sequence's own cache, through the same function a packed own pass calls."""

    def attend(index: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        cache.update(key, value, index)
        result: torch.Tensor = cache.attend_layer(index, query, decoder.scale)
        return result

    return attend


def lean_agrees(own: OwnRun, lean: LeanRun, vocab: int) -> bool:
    """Whether `lean` scores bitwise as `own` does: a 6-token prompt, then a 2-token chain after
    it, on fresh sequences, through the C++ layers (the chain) and through the Python loop."""
    tokens = torch.randint(0, vocab, (8,), generator=torch.Generator().manual_seed(0)).tolist()
    sequences = [CacheState(cache=new_growing_cache(), length=0) for _ in range(3)]  # own, C++, Python
    with torch.inference_mode():
        for a, b in ((0, 6), (6, 8)):
            want = own(tokens[a:b], sequences[0])
            got = [lean(tokens[a:b], sequences[1], True), lean(tokens[a:b], sequences[2], False)]
            if not all(torch.equal(want, scores) for scores in got):
                return False
    return True
