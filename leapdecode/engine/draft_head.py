"""A draft model's backend that scores only a draft vocabulary.

Why: a small draft model spends a large share of its pass in its output layer (the 0.5B
Qwen2.5's 151,936 x 896 head is a quarter of its bytes) on tokens it almost never drafts. Its
decoder body runs as usual (the model's public `get_decoder()` forward, with the same cache), and
only the rows of a draft vocabulary are scored. The logits come back over the whole vocabulary,
-inf outside the draft vocabulary, so every verifier and sampler reads them unchanged: a drafter
then never proposes a token outside it, and q's support only narrows (losslessness is the
verifier's, whatever the draft proposes).

Where the draft model's structure allows (`models.lean`), its decoder body runs the lean forward,
checked bitwise against the model's own at construction: the same states in far fewer calls.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from leapdecode.engine.backend import (
    CacheState,
    Scores,
    TorchBackend,
    cache_argument,
    cache_room,
    extend_cache,
    new_growing_cache,
)
from leapdecode.engine.tree import TreeLayout
from leapdecode.errors import InputError
from leapdecode.models.lean import Attend, LeanDecoder
from leapdecode.models.quantize import QuantizedLinear


def trimmed_head(model: Any, ids: torch.Tensor) -> nn.Module:
    """`model`'s output layer restricted to the rows `ids` [V'], in the layer's own form (a
    quantized head stays quantized at its bits; a float one stays float)."""
    head = model.get_output_embeddings()
    if isinstance(head, QuantizedLinear):
        rows = head.weight_float()[ids]  # [V', hidden]
        bias = None if head.bias is None else head.bias[ids]
        return QuantizedLinear.from_weight(rows, head.bits, bias)
    if isinstance(head, nn.Linear):
        layer = nn.Linear(
            head.in_features, len(ids), bias=head.bias is not None, dtype=head.weight.dtype, device=head.weight.device
        )
        with torch.no_grad():
            layer.weight.copy_(head.weight[ids])
            if head.bias is not None:
                layer.bias.copy_(head.bias[ids])
        return layer.requires_grad_(False)
    raise InputError(f"a draft vocabulary needs a linear output layer, not {type(head).__name__}")


class DraftHeadBackend(TorchBackend):
    """A `TorchBackend` over a draft model whose logits come from a draft vocabulary's rows of its
    output layer (see the module doc). Chains only: a draft model drafts chains."""

    def __init__(self, model: Any, ids: Sequence[int], exact_tokens: int | None = None, *, lean: bool = True) -> None:
        """`lean`: run the decoder body's lean forward where it reproduces the model's own
        (`lean_reason` says why not, else empty)."""
        super().__init__(model, exact_tokens)
        self.body = model.get_decoder()
        self.body_cache_argument = cache_argument(self.body.forward)
        self.ids = torch.tensor(sorted(set(ids)), dtype=torch.long, device=self.device)  # [V'] target ids, ascending
        self.head = trimmed_head(model, self.ids)
        self.lean: LeanDecoder | None = None
        self.lean_reason = "not asked for"
        if lean:
            self.lean, self.lean_reason = LeanDecoder.build(model)
            if self.lean is not None and not self._lean_agrees():
                self.lean, self.lean_reason = None, "its states differ from the model's own forward"

    def _lean_agrees(self) -> bool:
        """Whether the lean forward gives bitwise the model's own states: a 6-token prompt, then a
        2-token chain after it, through the C++ layers where they run and through the Python loop."""
        vocab = int(self.model.config.get_text_config().vocab_size)
        tokens = torch.randint(0, vocab, (8,), generator=torch.Generator().manual_seed(0))  # [8]
        sequences = [CacheState(cache=new_growing_cache(), length=0) for _ in range(3)]  # own, lean, lean in Python
        with torch.inference_mode():
            for a, b in ((0, 6), (6, 8)):
                want = self._own_states(tokens[a:b], sequences[0].cache)
                got = [
                    self._lean_states(tokens[a:b], sequences[1]),
                    self._lean_states(tokens[a:b], sequences[2], native=False),
                ]
                for seq in sequences:
                    seq.length = b
                if not all(torch.equal(want, states) for states in got):
                    return False
        return True

    def _lean_states(self, tokens: torch.Tensor, seq: CacheState, *, native: bool = True) -> torch.Tensor:
        """The lean forward of `tokens` [n] after `seq`'s cache (written, `seq.length` not moved):
        the C++ layers where the cache has room, else the Python loop -> states [n, hidden]."""
        assert self.lean is not None, "built"
        n = tokens.shape[0]
        room = cache_room(seq, n) if native and self.lean.native is not None else None
        if room is None:
            positions = torch.arange(seq.length, seq.length + n, device=self.device)  # [n]
            return self.lean.forward(tokens, positions, self.lean.attend_cache(seq.cache))
        states = self.lean.forward_native(tokens, seq.length, room)
        extend_cache(seq, n)
        return states

    def _own_states(self, tokens: torch.Tensor, cache: Any) -> torch.Tensor:
        """The decoder body's own forward: tokens [n] appended to `cache` -> states [n, hidden]."""
        out = self.body(input_ids=tokens[None], use_cache=True, **{self.body_cache_argument: cache})
        states: torch.Tensor = out.last_hidden_state[0]
        return states

    def _run(
        self,
        seq: CacheState,
        token_ids: list[int],
        logits_to_keep: int,
        tree: TreeLayout | None = None,
        features: tuple[int, ...] = (),
    ) -> Scores:
        if (tree is not None and not tree.is_chain) or features:
            raise InputError("a draft vocabulary's backend scores chains only, without states")
        tokens = torch.tensor(token_ids, dtype=torch.long, device=self.device)  # [n]
        if self.lean is not None:
            states = self._lean_states(tokens, seq)  # [n, hidden]
        else:
            states = self._own_states(tokens, seq.cache)  # [n, hidden], after the final norm
        seq.length += len(token_ids)
        if logits_to_keep:
            states = states[-logits_to_keep:]  # [k, hidden]
        return Scores(logits=self._widened(states))

    @torch.inference_mode()
    def score_packed(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        cache: Any,
        rows: torch.Tensor,
        features: tuple[int, ...],
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A packed pass of the decoder body, the draft vocabulary's rows scoring the kept rows."""
        from leapdecode.models.row_exact import BATCH_KEYWORD

        if features:
            raise InputError("a draft vocabulary's backend scores without states")
        if self.lean is not None:
            states = self.lean.forward(input_ids[0], position_ids[0], self._attend_packed(cache))  # [N, hidden]
            return self._widened(states[rows]), None
        out = self.body(
            input_ids=input_ids,  # [1, N]
            position_ids=position_ids,  # [1, N]
            attention_mask=attention_mask,
            use_cache=True,
            **{self.body_cache_argument: cache, BATCH_KEYWORD: cache},
        )
        return self._widened(out.last_hidden_state[0, rows]), None  # [kept, vocab]

    def _attend_packed(self, cache: Any) -> Attend:
        """The lean forward's attention in a packed pass: each sequence over its own cache
        (`engine.batch.PackedCache`)."""
        assert self.lean is not None, "only the lean forward attends this way"
        scale = self.lean.scale

        def attend(index: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
            cache.update(key, value, index)
            result: torch.Tensor = cache.attend_layer(index, query, scale)
            return result

        return attend

    def _widened(self, states: torch.Tensor) -> torch.Tensor:
        """The draft vocabulary's logits for `states` [k, hidden], over the whole vocabulary
        (-inf outside it): [k, vocab]."""
        scored = self.head(states).float()  # [k, V']
        logits = torch.full((scored.shape[0], self.vocab_size), float("-inf"), device=self.device)  # [k, vocab]
        logits.index_copy_(1, self.ids, scored)
        return logits
