"""Run a causal LM's decoder layers one by one, through the model's own modules.

Early exiting and self-speculative drafting need what a plain forward hides: the hidden state
after any layer, runs over a subset of the layers, and a KV cache whose layers may hold
different numbers of tokens for a while (a drafted token cached in the layers that drafted
it only). `LayerRunner` does exactly that with the model's public pieces — embedding, rotary
embedding, each decoder layer's forward, final norm, LM head — and a `transformers` cache,
with no copied or patched modeling code.

Each call passes explicit position ids and, for more than one token, an explicit causal mask
sized from that layer's own cache length, so layers of different lengths stay correct.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from leapdecode.engine.backend import AttentionLayout, cache_argument
from leapdecode.engine.tree import TreeLayout, chain_parents, compile_tree
from leapdecode.errors import MethodError

# Decoder-only models whose layers take (hidden, mask, position ids, cache, rotary cos/sin) and
# whose model applies nothing between the embedding and the first layer (Gemma scales it, say).
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")


class LayerRunner:
    """Embedding, decoder layers, final norm and LM head of one model, callable separately."""

    def __init__(self, model: Any) -> None:
        config = model.config.get_text_config()
        inner = getattr(model, "model", None)
        parts = ("embed_tokens", "layers", "norm", "rotary_emb")
        if config.model_type not in SUPPORTED_MODEL_TYPES or inner is None or not all(hasattr(inner, p) for p in parts):
            raise MethodError(
                f"layer-level methods run {', '.join(SUPPORTED_MODEL_TYPES)} models; "
                f"this model is {config.model_type!r}"
            )
        if AttentionLayout(model.config).window is not None:
            raise MethodError(
                "layer-level methods build their own causal masks and do not apply sliding windows: "
                "this model has sliding-window layers; use a method that runs the whole model"
            )
        self.model = model
        self.config = config
        self.embed_tokens = inner.embed_tokens
        self.layers = inner.layers
        self.cache_argument = cache_argument(self.layers[0].forward)
        self.norm = inner.norm
        self.rotary_emb = inner.rotary_emb
        self.lm_head = model.get_output_embeddings()
        self.num_layers: int = config.num_hidden_layers
        self.device: torch.device = model.device
        self.dtype: torch.dtype = model.dtype
        attention = self.layers[0].self_attn
        self._rope = importlib.import_module(type(attention).__module__).apply_rotary_pos_emb
        self.head_dim: int = attention.head_dim

    def new_cache(self) -> Any:
        from transformers import DynamicCache

        return DynamicCache(config=self.model.config)

    @staticmethod
    def cached(cache: Any, layer: int) -> int:
        """Tokens that layer `layer` of the cache holds."""
        return int(cache.layers[layer].get_seq_length()) if layer < len(cache.layers) else 0

    def crop(self, cache: Any, layers: Sequence[int], length: int) -> None:
        """Cut the given layers of the cache back to `length` tokens (layers already shorter stay)."""
        for i in layers:
            extra = self.cached(cache, i) - length
            if extra > 0:
                cache.layers[i].crop(-extra)

    def embed(self, token_ids: Sequence[int]) -> torch.Tensor:
        ids = torch.tensor([list(token_ids)], dtype=torch.long, device=self.device)  # [1, n]
        return self.embed_tokens(ids)  # [1, n, hidden]

    def rotary(self, hidden: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rotary_emb(hidden, position_ids=position_ids)

    def run(
        self,
        cache: Any,
        hidden: torch.Tensor,
        layers: Sequence[int],
        position_ids: torch.Tensor,
        tree: TreeLayout | None = None,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Run `hidden` [1, n, hidden] at `position_ids` [1, n] through `layers` in order, each
        appending its n entries to its own cache layer; return the states after the last one.
        With `tree`, the n tokens are a tree's nodes and attend along their own paths.
        `position_embeddings` (rotary cos, sin) may be passed in when running layer by layer."""
        n = hidden.shape[1]
        if position_embeddings is None:
            position_embeddings = self.rotary(hidden, position_ids)
        masks: dict[int, torch.Tensor | None] = {}
        layout = tree if tree is not None else (compile_tree(chain_parents(n - 1)) if n > 1 else None)
        for i in layers:
            past = self.cached(cache, i)
            if past not in masks:
                masks[past] = (
                    None if layout is None else layout.attention_mask(past, self.dtype, self.device)
                )  # [1, 1, n, past+n]
            out = self.layers[i](
                hidden,
                attention_mask=masks[past],
                position_ids=position_ids,
                use_cache=True,
                position_embeddings=position_embeddings,
                **{self.cache_argument: cache},
            )
            hidden = out[0] if isinstance(out, tuple) else out
        return hidden

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head: [1, n, hidden] -> logits [n, vocab]."""
        return self.lm_head(self.norm(hidden))[0]

    def copy_state(self, cache: Any, hidden: torch.Tensor, layers: Sequence[int], position_ids: torch.Tensor) -> None:
        """CALM's state copying: cache, in each of `layers`, the keys and values that layer would
        compute if its input were `hidden` [1, n, hidden] (the state a token exited with), so that
        later tokens can attend to a token that skipped those layers. Costs two projections per
        layer, not the layer."""
        cos, sin = self.rotary(hidden, position_ids)
        shape = (1, hidden.shape[1], -1, self.head_dim)
        for i in layers:
            layer = self.layers[i]
            x = layer.input_layernorm(hidden)
            keys = layer.self_attn.k_proj(x).view(shape).transpose(1, 2)  # [1, kv_heads, n, head_dim]
            values = layer.self_attn.v_proj(x).view(shape).transpose(1, 2)
            keys, _ = self._rope(keys, keys, cos, sin)
            cache.update(keys, values, i)

    def states_by_layer(self, token_ids: Sequence[int]) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
        """Run `token_ids` as a fresh sequence through every layer in turn, yielding (layer, its
        input states, its output states), each [1, n, hidden]: what calibration measures."""
        cache = self.new_cache()
        positions = self.positions(0, len(token_ids))
        state = self.embed(token_ids)
        rope = self.rotary(state, positions)
        for i in range(self.num_layers):
            previous, state = state, self.run(cache, state, (i,), positions, position_embeddings=rope)
            yield i, previous, state

    def positions(self, start: int, n: int) -> torch.Tensor:
        return torch.arange(start, start + n, device=self.device)[None]  # [1, n]
