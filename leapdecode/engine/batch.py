"""One target pass over several sequences, each sequence's rows bitwise what its own pass gives.

The sequences' tokens are packed into one row of the model's input, [1, N = sum of n_i], and go
through its public forward once: every layer's linear parts run over all N rows together (the
cost that batching shares), and attention runs per sequence, over that sequence's own KV cache.
Two public hooks of `transformers` make that possible without touching modeling code:
- the cache argument is a `PackedCache`, whose `update` (called by every attention layer with
  the new keys and values) writes each sequence's slice into that sequence's own cache;
- a forward keyword (`leapdecode_batch`) reaches the attention function, where the row-exact
  attention (`models.row_exact`) hands the layer to `PackedCache.attend`: each sequence's query
  rows attend to exactly the keys they would see in a pass of their own, through the same call.

Every other operation is row-local (embeddings, norms, rotary, activations, the row-exact and
quantized linear kernels, the LM head on the kept rows), so a sequence's logits do not depend on
what else is in the pass: greedy output in a batch equals the request alone, by construction,
and the tests check it exactly. Models whose attention is not row-exact, or that slide a window
over their keys, are not batched (`batchable`).
"""

from __future__ import annotations

import functools
from collections.abc import Generator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from leapdecode.engine.tree import TreeLayout
from leapdecode.errors import InputError

if TYPE_CHECKING:
    from leapdecode.engine.backend import Backend, CacheState, Packer, Scores
    from leapdecode.engine.drafting import DraftFeed

T = TypeVar("T")


@dataclass(frozen=True)
class BatchItem:
    """One sequence's part of a packed pass: `tokens` appended to `seq`'s cache (a prompt, or the
    pending token and its draft; `tree` makes them a tree, root first); `last_only`: keep the
    logits of the last row only (a prefill)."""

    seq: CacheState
    tokens: Sequence[int]
    tree: TreeLayout | None = None
    last_only: bool = False


@functools.cache
def _packed_cache_class() -> type:
    from transformers import DynamicCache

    class PackedCache(DynamicCache):
        """The cache a packed pass hands the model: `update` writes each sequence's new keys and
        values into that sequence's own cache; `attend` runs each sequence's attention there.
        Holds nothing after the pass."""

        def __init__(self, items: Sequence[BatchItem], masks: list[torch.Tensor | None], attention: Any) -> None:
            super().__init__()
            self.items = items
            self.masks = masks  # per item: the mask its own pass would give attention ([1, 1, n, past+n]) or None
            self.attention = attention  # the row-exact attention function, called once per sequence
            bounds, start = [], 0
            for item in items:
                bounds.append((start, start + len(item.tokens)))
                start += len(item.tokens)
            self.bounds = bounds
            self.views: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}

        def update(
            self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
        ) -> tuple[torch.Tensor, torch.Tensor]:
            # key_states, value_states: [1, kv_heads, N, head_dim]
            self.views[layer_idx] = [
                item.seq.cache.update(key_states[:, :, a:b], value_states[:, :, a:b], layer_idx)
                for item, (a, b) in zip(self.items, self.bounds)
            ]
            return key_states, value_states  # unused: `attend` reads each sequence's own cache

        def attend(
            self, module: Any, query: torch.Tensor, scaling: float | None, kwargs: dict[str, Any]
        ) -> torch.Tensor:
            """query [1, heads, N, dim] -> [1, N, heads, dim], each sequence over its own keys."""
            return self.attend_layer(module.layer_idx, query, scaling, module, kwargs)

        def attend_layer(
            self,
            layer_idx: int,
            query: torch.Tensor,
            scaling: float | None,
            module: Any = None,
            kwargs: dict[str, Any] | None = None,
        ) -> torch.Tensor:
            """`attend` for layer `layer_idx`, whose keys and values `update` wrote: a forward
            of its own (`models.lean`) calls this directly."""
            outs = []
            for (a, b), (keys, values), mask in zip(self.bounds, self.views[layer_idx], self.masks):
                out, _ = self.attention(module, query[:, :, a:b], keys, values, mask, scaling=scaling, **(kwargs or {}))
                outs.append(out)  # [1, n_i, heads, dim]
            return torch.cat(outs, dim=1)

    return PackedCache


def packed_cache(items: Sequence[BatchItem], masks: list[torch.Tensor | None], attention: Any) -> Any:
    return _packed_cache_class()(items, masks, attention)


def _causal_mask(seq_length: int, n: int, device: torch.device) -> torch.Tensor | None:
    """The mask a chain of `n` tokens after `seq_length` cached ones gets in its own pass, as
    transformers' SDPA mask builds it: none for one token or a fresh prompt (attention then runs
    causal), else a boolean [1, 1, n, past+n]."""
    if n == 1 or seq_length == 0:
        return None
    total = seq_length + n
    rows = torch.arange(seq_length, total, device=device)[:, None]  # [n, 1]
    return (torch.arange(total, device=device)[None, :] <= rows)[None, None]  # [1, 1, n, past+n]


def forward_batch(backend: Packer, items: Sequence[BatchItem], features: tuple[int, ...] = ()) -> list[Scores]:
    """Append each item's tokens to its sequence's cache and score them, all in one pass; each
    sequence's `Scores` are bitwise those of `backend.forward` (or `prefill`) on it alone."""
    from leapdecode.engine.backend import Scores

    if not items:
        return []
    if len({id(item.seq) for item in items}) != len(items):
        raise InputError("a packed pass takes each sequence at most once")
    if any(not item.tokens for item in items):
        raise InputError("every sequence in a packed pass needs at least one token")
    if len(items) == 1 and (items[0].tree is None or items[0].tree.is_chain) and not features:
        # one chain: the sequence's own pass (bitwise the same, and where the backend has a faster
        # path for one sequence, as the lean forward's one C++ call, that one)
        item = items[0]
        own = backend.forward(item.seq, list(item.tokens))
        return [Scores(logits=own.logits[-1:]) if item.last_only else own]
    device = backend.device
    masks: list[torch.Tensor | None] = []
    positions = []
    keep: list[torch.Tensor] = []
    start = 0
    for item in items:
        n, past = len(item.tokens), item.seq.length
        if item.tree is not None and not item.tree.is_chain:
            masks.append(item.seq.tree_mask.mask(item.tree, past, backend.model.dtype, device))  # [1, 1, n, past+n]
            positions.append(past + item.tree.depth_on(device))  # [n]
        else:
            masks.append(_causal_mask(past, n, device))
            positions.append(torch.arange(past, past + n, device=device))
        keep.append(torch.arange(start + n - 1 if item.last_only else start, start + n, device=device))
        start += n
    input_ids = torch.tensor([[t for item in items for t in item.tokens]], dtype=torch.long, device=device)  # [1, N]
    position_ids = torch.cat(positions)[None]  # [1, N]
    rows = torch.cat(keep)  # [kept rows]
    cache = packed_cache(items, masks, backend.batch_attention())
    # A prepared 4-D mask skips transformers' own mask building; attention ignores it and
    # takes each sequence's mask from the cache.
    unused_mask = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=device)
    with torch.inference_mode():
        logits, chosen = backend.score_packed(
            input_ids, position_ids, unused_mask, cache, rows, features
        )  # [kept rows, vocab], [N, F] or None
    scores, row, start = [], 0, 0
    for item in items:
        n = len(item.tokens)
        kept = 1 if item.last_only else n
        item.seq.length += n
        scores.append(
            Scores(logits=logits[row : row + kept], features=None if chosen is None else chosen[start : start + n])
        )
        row += kept
        start += n
    return scores


def drive_rounds(
    backend: Backend | None, rounds: Sequence[Generator[DraftFeed, tuple[CacheState, Scores], T]]
) -> list[T | Exception]:
    """Run several drafters' rounds (`Drafter.offer`) over one draft model together: each
    round, the feeds of every drafter still drafting are scored in packed passes (a prefill, a
    request's first, alone), so a batch of requests pays about one draft pass a round, not one
    each. Returns each drafter's result, or the error its rounds raised; the others go on (a
    packed pass that fails is rolled back and its feeds scored one by one, so only the drafter
    whose feed fails then fails). Alone, or on a backend that cannot pack sequences, each feed is
    an ordinary forward of its own."""
    results: dict[int, T | Exception] = {}
    pending: dict[int, DraftFeed] = {}

    def advance(index: int, answer: tuple[CacheState, Scores] | Exception | None) -> None:
        try:
            if isinstance(answer, Exception):
                rounds[index].close()
                raise answer
            feed = next(rounds[index]) if answer is None else rounds[index].send(answer)
            if backend is None:
                rounds[index].close()
                raise InputError("a drafter asked for a pass of a draft model it did not name")
            pending[index] = feed
        except StopIteration as stop:
            results[index] = stop.value
        except Exception as exc:  # noqa: BLE001 - this drafter fails, the others go on
            results[index] = exc

    for index in range(len(rounds)):
        advance(index, None)
    while pending:
        assert backend is not None, "only a named backend's feeds are pending"
        feeds = dict(pending)
        pending.clear()
        answers: dict[int, tuple[CacheState, Scores] | Exception] = dict(_packed_answers(backend, feeds))
        for i, feed in feeds.items():
            if i not in answers:
                answers[i] = _alone(backend, feed)
        for i, answer in answers.items():
            advance(i, answer)
    return [results[i] for i in range(len(rounds))]


def _packed_answers(backend: Backend, feeds: dict[int, DraftFeed]) -> dict[int, tuple[CacheState, Scores]]:
    """The chained feeds (those with a sequence) scored in packed passes of at most `PASS_ROWS`
    rows, where the backend packs and there are two or more; a pass that fails is rolled back and
    its feeds left out (scored alone after)."""
    from leapdecode.engine.backend import rollback_cache
    from leapdecode.models.row_exact import PASS_ROWS

    chained = [(i, feed.seq, feed.tokens) for i, feed in feeds.items() if feed.seq is not None]
    packer = backend.packer
    if len(chained) < 2 or packer is None or backend.batchable is not None:
        return {}
    packs: list[list[tuple[int, CacheState, list[int]]]] = [[]]
    for entry in chained:
        if packs[-1] and sum(len(tokens) for _, _, tokens in packs[-1]) + len(entry[2]) > PASS_ROWS:
            packs.append([])
        packs[-1].append(entry)
    answers: dict[int, tuple[CacheState, Scores]] = {}
    for pack in packs:
        if len(pack) < 2:
            continue
        try:
            scored = forward_batch(packer, [BatchItem(seq, tokens) for _, seq, tokens in pack])
        except Exception:  # noqa: BLE001 - rolled back; its feeds are scored one by one
            for _, seq, _ in pack:
                rollback_cache(seq, seq.length)
            continue
        answers.update({i: (seq, scores) for (i, seq, _), scores in zip(pack, scored)})
    return answers


def _alone(backend: Backend, feed: DraftFeed) -> tuple[CacheState, Scores] | Exception:
    """One feed in a pass of its own (a prefill, or a forward), or the error it raised."""
    try:
        if feed.seq is None:
            return backend.prefill(feed.tokens)
        return feed.seq, backend.forward(feed.seq, feed.tokens)
    except Exception as exc:  # noqa: BLE001 - this drafter fails, the others go on
        return exc
