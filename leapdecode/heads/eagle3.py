"""The EAGLE-3 draft head (Li et al. 2503.01840): one decoder layer over the target's own states.

The head reads three of the target's residual-stream states at each position (`aux_layers`,
indices into Hugging Face's `hidden_states`: what enters layers 2, L//2 and L-3 unless a
checkpoint says otherwise, as EAGLE's and vLLM's code take them), fuses them with `fc`, and runs
one decoder layer whose attention input is [norm(embedding of the next token) ; norm(feature)].
Entry i of the head pairs the target's state at position i with token i+1 and sits at rotary
position i; its output predicts token i+2. A drafting step feeds the head its own pre-norm output
in place of the target's fused state (that skips `fc`), so a chain costs one small pass a token.

Logits cover a draft vocabulary (the most frequent target tokens); `d2t` maps a draft id to
its target id (target = draft + d2t[draft], the published convention), `t2d` marks the target
ids the draft vocabulary holds.

The same `attend` serves drafting (one sequence, a growing cache, a tree mask) and training
(a batch, the training-time test's masks), so what is trained is what drafts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn


def default_aux_layers(num_layers: int) -> tuple[int, ...]:
    """The target states EAGLE-3 fuses when a checkpoint names none: what enters layers 2, L//2
    and L-3 (vLLM's `aux_hidden_state_layers`; SpecForge's layer outputs 1, L//2-1, L-4). Small
    (test) models read layer inputs from 2 on too, so a saved list never starts at 1, which
    loaders read as SGLang's layer outputs."""
    if num_layers >= 6:
        return (2, num_layers // 2, num_layers - 3)
    return (2, max(2, num_layers // 2), max(2, num_layers - 1))


@dataclass(frozen=True)
class Eagle3Config:
    """The head's shape; `vocab_size` and `target_hidden_size` are the target's."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    draft_vocab_size: int
    aux_layers: tuple[int, ...]
    target_hidden_size: int = 0  # 0: hidden_size
    head_dim: int = 0  # 0: hidden_size // num_attention_heads
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False)
    max_position_embeddings: int = 32768
    norm_before_residual: bool = False  # the residual is the normed feature (speculators' option)

    def __post_init__(self) -> None:  # the defaults filled in, so that equal heads have equal configs
        object.__setattr__(self, "target_hidden_size", self.target_hidden_size or self.hidden_size)
        object.__setattr__(self, "head_dim", self.head_dim or self.hidden_size // self.num_attention_heads)

    @property
    def feature_size(self) -> int:
        return len(self.aux_layers) * self.target_hidden_size


@dataclass
class HeadCache:
    """The head's own keys and values for one sequence: [kv_heads, capacity, dim] buffers, the
    first `length` entries live. Drafted entries are dropped by `truncate`, as the target's are."""

    keys: torch.Tensor | None = None
    values: torch.Tensor | None = None
    length: int = 0

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v [kv_heads, n, dim] after the live entries; return all live entries."""
        end = self.length + k.shape[1]
        if self.keys is None or end > self.keys.shape[1]:
            capacity = end + max(256, end // 2)
            grown = [t.new_zeros((t.shape[0], capacity, t.shape[2])) for t in (k, v)]
            if self.keys is not None and self.values is not None and self.length:
                grown[0][:, : self.length] = self.keys[:, : self.length]
                grown[1][:, : self.length] = self.values[:, : self.length]
            self.keys, self.values = grown
        assert self.values is not None
        self.keys[:, self.length : end] = k
        self.values[:, self.length : end] = v
        self.length = end
        return self.keys[:, :end], self.values[:, :end]

    def truncate(self, length: int) -> None:
        """Keep the first `length` entries (the committed ones; a draft's are dropped)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot cut a head cache of {self.length} entries to {length}")
        self.length = length


class Eagle3Head(nn.Module):
    """EAGLE-3's head. `embed_tokens` is the target's input embedding (shared, not trained),
    unless a checkpoint brings its own."""

    def __init__(self, config: Eagle3Config, embed_tokens: nn.Module) -> None:
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaRMSNorm

        self.config = config
        h, d = config.hidden_size, config.head_dim
        # the target's embedding, held outside the module: never trained, saved, copied or cast
        object.__setattr__(self, "embed_tokens", embed_tokens)
        self.fc = nn.Linear(config.feature_size, h, bias=False)
        self.input_layernorm = LlamaRMSNorm(h, eps=config.rms_norm_eps)
        self.hidden_norm = LlamaRMSNorm(h, eps=config.rms_norm_eps)
        self.q_proj = nn.Linear(2 * h, config.num_attention_heads * d, bias=False)
        self.k_proj = nn.Linear(2 * h, config.num_key_value_heads * d, bias=False)
        self.v_proj = nn.Linear(2 * h, config.num_key_value_heads * d, bias=False)
        self.o_proj = nn.Linear(config.num_attention_heads * d, h, bias=False)
        self.post_attention_layernorm = LlamaRMSNorm(h, eps=config.rms_norm_eps)
        self.gate_proj = nn.Linear(h, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(h, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, h, bias=False)
        self.norm = LlamaRMSNorm(h, eps=config.rms_norm_eps)
        self.lm_head = nn.Linear(h, config.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.ones(config.vocab_size, dtype=torch.bool))
        self.rotary = _rotary(config)

    @property
    def dtype(self) -> torch.dtype:
        return self.norm.weight.dtype  # (the linear layers may be quantized)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """Target token ids [..., T] -> the head's input embeddings [..., T, hidden]."""
        with torch.no_grad():
            return self.embed_tokens(tokens).to(self.dtype)

    def attend(
        self,
        hidden: torch.Tensor,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        mask: torch.Tensor,
        *,
        fuse: bool,
        past: tuple[torch.Tensor, torch.Tensor] | None = None,
        cache: HeadCache | None = None,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """One pass of the layer. hidden [B, T, F] (the target's aux states, `fuse`d here by `fc`)
        or [B, T, hidden] (the head's own pre-norm outputs), tokens/positions [B, T], mask
        [B or 1, T, S] (True:
        attend) over S = past entries + these T. `past` (training: earlier steps' keys/values
        [B, kv, S-T, dim]) or `cache` (drafting, B = 1: appended to). Returns the pre-norm
        outputs [B, T, hidden] and this pass's keys/values [B, kv, T, dim]."""
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        c = self.config
        hidden = self.fc(hidden.to(self.dtype)) if fuse else hidden  # [B, T, hidden]
        embeds = self.input_layernorm(self.embed(tokens))  # [B, T, hidden]
        if c.norm_before_residual:
            hidden = self.hidden_norm(hidden)
            residual = hidden
        else:
            residual = hidden
            hidden = self.hidden_norm(hidden)
        x = torch.cat([embeds, hidden], dim=-1)  # [B, T, 2 hidden]
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, c.num_attention_heads, c.head_dim).transpose(1, 2)  # [B, heads, T, dim]
        k = self.k_proj(x).view(b, t, c.num_key_value_heads, c.head_dim).transpose(1, 2)  # [B, kv, T, dim]
        v = self.v_proj(x).view(b, t, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        cos, sin = self.rotary(x, positions)  # [B, T, dim]
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        if cache is not None:
            keys, values = cache.append(k[0], v[0])  # [kv, S, dim]
            keys, values = keys[None], values[None]
        elif past is not None:
            keys, values = torch.cat([past[0], k], dim=2), torch.cat([past[1], v], dim=2)  # [B, kv, S, dim]
        else:
            keys, values = k, v
        out = nn.functional.scaled_dot_product_attention(
            q, keys, values, attn_mask=mask[:, None], enable_gqa=True
        )  # [B, heads, T, dim]
        hidden = self.o_proj(out.transpose(1, 2).reshape(b, t, -1)) + residual  # [B, T, hidden]
        normed = self.post_attention_layernorm(hidden)
        hidden = hidden + self.down_proj(nn.functional.silu(self.gate_proj(normed)) * self.up_proj(normed))
        return hidden, (k, v)

    def logits(self, prenorm: torch.Tensor) -> torch.Tensor:
        """Pre-norm outputs [..., hidden] -> draft-vocabulary logits [..., draft_vocab]."""
        return self.lm_head(self.norm(prenorm))

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary ids -> target ids."""
        return draft_ids + self.d2t[draft_ids]


def _rotary(config: Eagle3Config) -> nn.Module:
    """The target family's rotary embedding for the head's positions (rope scaling included)."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": config.rope_theta}
    if config.rope_scaling:
        rope = {**rope, **config.rope_scaling}
        rope["rope_type"] = rope.pop("type", rope.get("rope_type", "default"))
    llama = LlamaConfig(
        hidden_size=config.hidden_size,
        num_attention_heads=config.num_attention_heads,
        head_dim=config.head_dim,
        max_position_embeddings=config.max_position_embeddings,
        rope_parameters=rope,
    )
    return LlamaRotaryEmbedding(llama)


def random_head(config: Eagle3Config, embed_tokens: nn.Module, *, seed: int = 0, scale: float = 0.02) -> Eagle3Head:
    """A head with random weights (tests, and the start of training); the identity vocabulary map."""
    generator = torch.Generator().manual_seed(seed)
    head = Eagle3Head(config, embed_tokens)
    with torch.no_grad():
        for name, parameter in head.named_parameters():
            if name.endswith("norm.weight"):
                parameter.fill_(1.0)
            else:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * scale)
        head.d2t.zero_()
        head.t2d.copy_(torch.arange(config.vocab_size) < config.draft_vocab_size)
    return head.eval()
