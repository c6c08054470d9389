"""Medusa-1 heads (Cai et al. 2401.10774); their published formats are `medusa_format`.

Head i reads the target's last hidden state h_n (after the final norm) through `num_layers`
residual blocks x = x + SiLU(W x + b), then an LM head, and predicts the token at offset i+2
from position n: the target's own LM head predicts offset 1.

Heads whose weights carry no LM head use the target's own (`MedusaHeads.lm_heads` is None).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class MedusaConfig:
    """The heads' shape; `hidden_size` and `vocab_size` are the target's."""

    hidden_size: int
    vocab_size: int
    num_heads: int
    num_layers: int = 1


class _ResidualBlock(nn.Module):
    """One head's residual blocks (vLLM's `ResidualBlock`): x = x + SiLU(layer(x)) per layer."""

    def __init__(self, hidden_size: int, num_layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(hidden_size, hidden_size, bias=True) for _ in range(num_layers)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [n, H] -> [n, H]
        for layer in self.layers:
            x = x + F.silu(layer(x))
        return x


class MedusaHeads(nn.Module):
    """`num_heads` Medusa heads. Parameter names are vLLM's (`blocks.{i}.layers.{j}`,
    `lm_heads.{i}`, `token_map`). With `shared_lm_head` ([rows, H], e.g. the target's own
    weight, kept as is and not a parameter of the heads) every head ends in it and `lm_heads` is
    None. With `token_map` (target ids [rows]) the heads score only those tokens."""

    def __init__(
        self,
        config: MedusaConfig,
        *,
        shared_lm_head: torch.Tensor | None = None,
        token_map: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        hidden = config.hidden_size
        self.blocks = nn.ModuleList([_ResidualBlock(hidden, config.num_layers) for _ in range(config.num_heads)])
        rows = config.vocab_size if token_map is None else int(token_map.numel())
        self.register_buffer("token_map", None if token_map is None else token_map.to(torch.long))
        self.shared_lm_head: torch.Tensor | None = None
        self.lm_heads: nn.ModuleList | None = None
        if shared_lm_head is None:
            self.lm_heads = nn.ModuleList([nn.Linear(hidden, rows, bias=False) for _ in range(config.num_heads)])
        elif tuple(shared_lm_head.shape) != (rows, hidden):
            raise ValueError(f"shared_lm_head has shape {tuple(shared_lm_head.shape)}, the heads need {(rows, hidden)}")
        else:
            self.shared_lm_head = shared_lm_head.detach()  # a plain tensor: `.to()` on the heads leaves it alone
        # a quantized copy of the shared head (`quantize_shared_head`) and the tensor it copies: a
        # plain callable, so neither state_dict nor `.to()` see it; used while that tensor is the head
        self._shared_product: tuple[torch.Tensor, int, Callable[[torch.Tensor], torch.Tensor]] | None = (
            None  # head, its version, product
        )

    @property
    def dtype(self) -> torch.dtype:
        for parameter in self.parameters():
            return parameter.dtype
        return torch.float32 if self.shared_lm_head is None else self.shared_lm_head.dtype

    def scores(self, hidden: torch.Tensor, count: int | None = None) -> torch.Tensor:
        """hidden [n, H] -> logits [count, n, rows] of the first `count` heads (all: None), over
        the token map's tokens when there is one. A shared LM head scores every head's rows in one
        product: on a CPU the cost of a drafting step is reading that weight, once, not per head."""
        x = hidden.to(self.dtype)  # [n, H]
        states = torch.stack(
            [self.blocks[i](x) for i in range(self.config.num_heads if count is None else count)]
        )  # [count, n, H]
        if self.lm_heads is not None:
            return torch.stack([self.lm_heads[i](h).to(self.dtype) for i, h in enumerate(states)])  # [count, n, rows]
        assert self.shared_lm_head is not None
        flat = states.reshape(-1, states.shape[-1])  # [count * n, H]
        int8 = self._int8_product()
        if int8 is not None:
            logits = int8(flat.float())  # [count * n, rows]
        else:
            logits = F.linear(flat.to(self.shared_lm_head.dtype), self.shared_lm_head)  # [count * n, rows]
        return logits.to(self.dtype).reshape(*states.shape[:2], -1)  # [count, n, rows]

    def _int8_product(self) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """The int8 copy's product while it copies the shared head as it is now (the same tensor,
        unchanged in place since the copy), else None."""
        if self._shared_product is None or self.shared_lm_head is None:
            return None
        head, version, product = self._shared_product
        return product if head is self.shared_lm_head and version == _version(head) else None

    def quantize_shared_head(self) -> bool:
        """Score with an int8 copy of the shared LM head (what `quantize_model` makes of an int4 or
        int8 target's output layer): a quarter of the float32 bytes a drafting step reads. The
        float head stays (saving, training). Returns whether there was a shared head whose width
        the kernel takes (a multiple of 32) and the kernel itself (without it a quantized layer
        de-quantizes its whole weight per call: slower than the float product)."""
        from leapdecode.models.quantize import QuantizedLinear, kernel

        head = self.shared_lm_head
        if head is None or head.shape[1] % 32 or kernel() is None:
            return False
        self._shared_product = (head, _version(head), QuantizedLinear.from_weight(head.float(), 8).forward)
        return True

    def forward(self, hidden: torch.Tensor, count: int | None = None) -> torch.Tensor:
        """hidden [n, H] -> logits [count, n, vocab] (head i: the token at offset i+2); tokens
        outside a token map get -inf."""
        small = self.scores(hidden, count)  # [count, n, rows]
        if self.token_map is None:
            return small
        full = small.new_full((*small.shape[:-1], self.config.vocab_size), float("-inf"))  # [count, n, vocab]
        full[..., self.token_map] = small
        return full

    def top(self, hidden: torch.Tensor, count: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The `k` most probable tokens of each of the first `count` heads after the last row of
        hidden [n, H]: probabilities [count, k] (float32) and target token ids [count, k]."""
        logits = self.scores(hidden[-1:], count)[:, 0].float()  # [count, rows]
        probs, ids = logits.softmax(-1).topk(min(k, logits.shape[-1]), dim=-1)  # [count, k]
        return probs, (ids if self.token_map is None else self.token_map[ids])


def _version(tensor: torch.Tensor) -> int:
    """How often `tensor` was changed in place (an inference tensor, which tracks no changes: -1)."""
    return -1 if tensor.is_inference() else tensor._version


def random_medusa(
    config: MedusaConfig,
    seed: int = 0,
    *,
    scale: float = 0.3,
    shared_lm_head: torch.Tensor | None = None,
    token_map: torch.Tensor | None = None,
) -> MedusaHeads:
    """Heads with random weights (standard deviation `scale`; tests use a large one so that drafts vary)."""
    generator = torch.Generator().manual_seed(seed)
    heads = MedusaHeads(config, shared_lm_head=shared_lm_head, token_map=token_map)
    with torch.no_grad():
        for parameter in heads.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * scale)
    return heads.eval()


def target_output_weight(model: Any) -> torch.Tensor | None:
    """The target's LM head as a float [vocab, H] tensor (a quantized one de-quantized), or None
    where it holds no weights: what heads sharing the target's LM head score with."""
    from leapdecode.models.quantize import QuantizedLinear

    head = model.get_output_embeddings()
    if isinstance(head, QuantizedLinear):
        return head.weight_float()
    weight = getattr(head, "weight", None)
    return weight.detach() if isinstance(weight, torch.Tensor) and weight.dtype.is_floating_point else None
