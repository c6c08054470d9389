"""A draft model's backend that scores only a draft vocabulary.

Why: a small draft model spends a large share of its pass in its output layer (the 0.5B
Qwen2.5's 151,936 x 896 head is a quarter of its bytes) on tokens it almost never drafts. Its
decoder body runs as usual (the model's public `get_decoder()` forward, with the same cache), and
only the rows of a draft vocabulary are scored. The logits come back over the whole vocabulary,
-inf outside the draft vocabulary, so every verifier and sampler reads them unchanged: a drafter
then never proposes a token outside it, and q's support only narrows (losslessness is the
verifier's, whatever the draft proposes).

Where the draft model's structure allows, its decoder body runs the lean forward
(`TorchBackend.take_lean`), checked bitwise against its own at construction.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import torch
from torch import nn

from leapdecode.engine.backend import CacheState, Scores, TorchBackend, cache_argument
from leapdecode.engine.tree import TreeLayout
from leapdecode.errors import InputError
from leapdecode.models.quantize import QuantizedLinear


def trimmed_head(model: Any, ids: torch.Tensor) -> nn.Module:
    """`model`'s output layer restricted to the rows `ids` [V'], in the layer's own form: a
    quantized head keeps those rows' own records (the same integers and factors, so each row
    scores bitwise as in the whole layer), a float one its rows."""
    head = model.get_output_embeddings()
    if isinstance(head, QuantizedLinear):
        return head.rows(ids)
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

    scores_trees: ClassVar[bool] = False

    def __init__(self, model: Any, ids: Sequence[int], exact_tokens: int | None = None, *, lean: bool = True) -> None:
        """`lean`: the decoder body on the lean forward where it gives the model's own scores
        (`TorchBackend.take_lean`; `lean_reason` says why not, else empty)."""
        super().__init__(model, exact_tokens, lean=False)
        self.body = model.get_decoder()
        self.body_cache_argument = cache_argument(self.body.forward)
        self.ids = torch.tensor(sorted(set(ids)), dtype=torch.long, device=self.device)  # [V'] target ids, ascending
        self.head = trimmed_head(model, self.ids)
        if lean:
            self.take_lean()

    def head_logits(self, states: torch.Tensor) -> torch.Tensor:
        return self._widened(states)

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
        return super()._run(seq, token_ids, logits_to_keep)

    def _own_run(
        self,
        seq: CacheState,
        token_ids: list[int],
        logits_to_keep: int,
        tree: TreeLayout | None = None,
        features: tuple[int, ...] = (),
    ) -> Scores:
        """The decoder body's own forward, then the draft vocabulary's rows of the output layer."""
        input_ids = torch.tensor([token_ids], dtype=torch.long, device=self.device)  # [1, n]
        out = self.body(input_ids=input_ids, use_cache=True, **{self.body_cache_argument: seq.cache})
        seq.length += len(token_ids)
        states = out.last_hidden_state[0]  # [n, hidden], after the final norm
        return Scores(logits=self.head_logits(states[-logits_to_keep:] if logits_to_keep else states))

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
            return super().score_packed(input_ids, position_ids, attention_mask, cache, rows, features)
        out = self.body(
            input_ids=input_ids,  # [1, N]
            position_ids=position_ids,  # [1, N]
            attention_mask=attention_mask,
            use_cache=True,
            **{self.body_cache_argument: cache, BATCH_KEYWORD: cache},
        )
        return self._widened(out.last_hidden_state[0, rows]), None  # [kept, vocab]

    def _widened(self, states: torch.Tensor) -> torch.Tensor:
        """The draft vocabulary's logits for `states` [k, hidden], over the whole vocabulary
        (-inf outside it): [k, vocab]."""
        scored = self.head(states).float()  # [k, V']
        logits = torch.full((scored.shape[0], self.vocab_size), float("-inf"), device=self.device)  # [k, vocab]
        logits.index_copy_(1, self.ids, scored)
        return logits
