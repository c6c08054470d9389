"""The model side of the decode loop: score tokens over a KV cache, and cut the cache back.

A backend is stateless with respect to sequences: `prefill` returns a `CacheState` that owns
its KV cache, and every later call takes it. Nothing is stored on the model object, so one
loaded model can serve several sequences one after another.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from leapdecode.engine.tree import TreeLayout, TreeMaskBuffer
from leapdecode.errors import InputError, ModelLoadError


@dataclass
class CacheState:
    """One sequence's KV cache. `length` is how many tokens the cache holds."""

    cache: Any
    length: int
    tree_mask: TreeMaskBuffer = field(default_factory=TreeMaskBuffer)  # reused by every tree pass


@dataclass(frozen=True)
class Scores:
    """What one forward pass returns."""

    logits: torch.Tensor  # [n, vocab]: logits[i] predicts the token after input i
    # [n, len(layers) * hidden]: the states named by `features=` side by side, for every input
    # position (a prefill's too), when asked for
    features: torch.Tensor | None = None


class Backend(Protocol):
    """What the decode loop needs from a model."""

    vocab_size: int
    device: torch.device

    def prefill(self, prompt_ids: list[int], *, features: tuple[int, ...] = ()) -> tuple[CacheState, Scores]:
        """Run the prompt; return its cache and the scores of the last prompt position only
        (with `features`, those states for every prompt position)."""
        ...

    def forward(
        self,
        seq: CacheState,
        token_ids: list[int],
        *,
        tree: TreeLayout | None = None,
        features: tuple[int, ...] = (),
    ) -> Scores:
        """Append `token_ids` to the cache and score every one of them; with `tree`, the tokens
        are a tree's nodes (root first) and each attends only to its own path; with `features`,
        the states of those layers (indices into Hugging Face's `hidden_states`) come back too."""
        ...

    def rollback(self, seq: CacheState, length: int) -> None:
        """Cut the cache back to its first `length` tokens (drop rejected drafts)."""
        ...

    def keep(self, seq: CacheState, start: int, nodes: list[int]) -> None:
        """Keep the cache entries at `start + i` for i in `nodes` (in order) right after the first
        `start` tokens, and drop everything else after `start` (an accepted tree path)."""
        ...

    def draft_limit(self, seq: CacheState) -> int | None:
        """The most drafted tokens the next pass should hold (a row-exact model scores any pass
        exactly; this keeps verification in the kernel's fast range), or None: any number."""
        ...

    @property
    def batchable(self) -> str | None:
        """Why this backend cannot score several sequences in one pass (`engine.batch`), or None
        when it can: its requests then share the scheduler's passes."""
        ...


class AttentionLayout:
    """Which layers attend to everything and which to a sliding window, read from the config
    (`layer_types` where the model has them; else `sliding_window` applies to every layer, as in
    Mistral, Phi-3 or Starcoder2)."""

    def __init__(self, config: Any) -> None:
        text = config.get_text_config()
        window = getattr(text, "sliding_window", None)
        types = getattr(text, "layer_types", None)
        if types is not None:
            unknown = set(types) - {"full_attention", "sliding_attention"}
            if unknown:
                raise ModelLoadError(
                    f"layers of type {sorted(unknown)} are not supported (full or sliding-window attention only)"
                )
            sliding = sum(t == "sliding_attention" for t in types)
            self.window: int | None = int(window) if sliding and window else None
            self.mixed = bool(self.window) and sliding < len(types)
        else:
            self.window = int(window) if window else None
            self.mixed = False

    def tree_mask(self, full: torch.Tensor, tree: TreeLayout, past: int) -> torch.Tensor | dict[str, torch.Tensor]:
        """The tree mask [1, 1, n, past+n] as the model's layers need it: unchanged without a
        sliding window; else also hiding what lies a window or more behind each node (a node at
        position past+depth sees position j when past+depth-j < window), per layer type."""
        if self.window is None:
            return full
        positions = past + tree.depth_on(full.device)  # [n]
        columns = torch.arange(full.shape[-1], device=full.device)  # [past+n]
        too_far = positions[:, None] - columns[None, :] >= self.window  # [n, past+n]
        sliding = full.masked_fill(too_far[None, None], torch.finfo(full.dtype).min)
        return {"full_attention": full, "sliding_attention": sliding} if self.mixed else sliding


def no_features(features: tuple[int, ...]) -> None:
    """A backend that cannot return the target's hidden states refuses a request for them."""
    if features:
        raise InputError(
            "this backend does not return the target's hidden states: trained heads (eagle3, medusa) run on the torch "
            "backend"
        )


def cache_argument(forward: Any) -> str:
    """The name under which `forward` takes its KV cache: `cache` (transformers 5.24 on, where
    `past_key_values` is deprecated), else `past_key_values` (earlier releases, which vLLM's CPU
    build pins, and models with their own modeling code). Read from the signature, once per model."""
    try:
        parameters = inspect.signature(forward).parameters
    except (TypeError, ValueError):
        return "past_key_values"
    return "cache" if "cache" in parameters else "past_key_values"


class TorchBackend:
    """A `transformers` causal LM, driven only through its public forward and cache objects."""

    def __init__(self, model: Any, exact_tokens: int | None = None) -> None:
        """`exact_tokens`: on a row-exact model (every pass's rows bitwise one-token passes), the
        longest decoding pass to verify (`LoadedModel.exact_tokens`); drafts are kept one token
        shorter (the pending token). None: no row-exact guarantee."""
        self.model = model
        self.exact_tokens = exact_tokens
        self.device: torch.device = model.device
        self.vocab_size: int = int(model.config.get_text_config().vocab_size)
        self.layout = AttentionLayout(model.config)
        self.attention = str(getattr(model.config, "_attn_implementation", None) or "eager")
        self.cache_argument = cache_argument(model.forward)

    def _run(
        self,
        seq: CacheState,
        token_ids: list[int],
        logits_to_keep: int,
        tree: TreeLayout | None = None,
        features: tuple[int, ...] = (),
    ) -> Scores:
        input_ids = torch.tensor([token_ids], dtype=torch.long, device=self.device)  # [1, n]
        extra: dict[str, Any] = {}
        mask: torch.Tensor | dict[str, torch.Tensor]
        if tree is not None and not tree.is_chain:
            if "flash" in self.attention:
                raise InputError(
                    f"token trees need an attention implementation that takes a custom mask (sdpa or eager), "
                    f"not {self.attention}: load the model with attn_implementation='sdpa', or use a chain method"
                )
            if self.layout.window is None:  # the cached prefix is all visible: only the draft's block is written
                mask = seq.tree_mask.mask(tree, seq.length, self.model.dtype, self.device)  # [1, 1, n, past+n]
            else:
                full = tree.attention_mask(seq.length, self.model.dtype, self.device)  # [1, 1, n, past+n]
                mask = self.layout.tree_mask(full, tree, seq.length)
            extra["attention_mask"] = mask
            extra["position_ids"] = (seq.length + tree.depth_on(self.device))[None]  # [1, n]
        out = self.model(
            input_ids=input_ids,
            use_cache=True,
            logits_to_keep=logits_to_keep,
            output_hidden_states=bool(features),
            **{self.cache_argument: seq.cache},
            **extra,
        )
        seq.length += len(token_ids)
        return Scores(logits=out.logits[0], features=_chosen_states(out, features))  # logits: [n or 1, vocab]

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
        """One packed pass (`engine.batch.forward_batch`: `cache` a `PackedCache`, also handed to
        attention): the logits of `rows` [kept, vocab] and the `features` layers' states [N, F]."""
        from leapdecode.models.row_exact import BATCH_KEYWORD

        out = self.model(
            input_ids=input_ids,  # [1, N]
            position_ids=position_ids,  # [1, N]
            attention_mask=attention_mask,
            use_cache=True,
            logits_to_keep=rows,
            output_hidden_states=bool(features),
            **{self.cache_argument: cache, BATCH_KEYWORD: cache},
        )
        return out.logits[0], _chosen_states(out, features)

    @torch.inference_mode()
    def prefill(self, prompt_ids: list[int], *, features: tuple[int, ...] = ()) -> tuple[CacheState, Scores]:
        # Every layer keeps every position, sliding-window layers too (their window is applied by
        # the attention mask, by the model for chains and by `AttentionLayout` for trees): a
        # window-sized cache drops entries that rollback and tree compaction must keep, as Hugging
        # Face's assisted generation also finds.
        seq = CacheState(cache=new_growing_cache(), length=0)
        # A row-exact model takes the prompt in chunks its kernels score row by row, so a prefill
        # cut anywhere else (a shared pass's chunk, `engine.scheduler`) gives the same bits.
        size = self.prefill_chunk or max(1, len(prompt_ids))
        chunks = [prompt_ids[i : i + size] for i in range(0, len(prompt_ids), size)] or [prompt_ids]
        # Only the last position's logits are needed: skips a [prompt, vocab] matmul.
        scored = [self._run(seq, chunk, logits_to_keep=1, features=features) for chunk in chunks]
        if len(scored) == 1:
            return seq, scored[0]
        states = torch.cat([s.features for s in scored if s.features is not None]) if features else None  # [prompt, F]
        return seq, Scores(logits=scored[-1].logits, features=states)

    @property
    def prefill_chunk(self) -> int | None:
        """The longest prompt chunk one prefill pass takes (row-exact models), or None: whole."""
        from leapdecode.models.row_exact import ATTENTION, PASS_ROWS

        return PASS_ROWS if self.attention == ATTENTION and self.exact_tokens is not None else None

    @torch.inference_mode()
    def forward(
        self,
        seq: CacheState,
        token_ids: list[int],
        *,
        tree: TreeLayout | None = None,
        features: tuple[int, ...] = (),
    ) -> Scores:
        return self._run(seq, token_ids, logits_to_keep=0, tree=tree, features=features)

    def rollback(self, seq: CacheState, length: int) -> None:
        rollback_cache(seq, length)

    def draft_limit(self, seq: CacheState) -> int | None:
        return None if self.exact_tokens is None else self.exact_tokens - 1

    @torch.inference_mode()
    def keep(self, seq: CacheState, start: int, nodes: list[int]) -> None:
        keep_cache_entries(seq, start, nodes)

    @property
    def batchable(self) -> str | None:
        """Why this model cannot score several sequences in one pass (`engine.batch`), or None
        when it can: that needs the row-exact attention (each sequence over its own cache) and
        full attention in every layer."""
        from leapdecode.models.row_exact import ATTENTION

        if self.attention != ATTENTION or self.exact_tokens is None:
            return "batching needs the row-exact kernels (float32, bfloat16 or int8/int4 on CPU)"
        if self.layout.window is not None:
            return "batching does not run sliding-window attention yet"
        rope = self.rope_type
        if rope in ("dynamic", "longrope"):  # their frequencies follow the longest position in the pass
            return (
                f"batching does not run {rope} rotary scaling (its frequencies depend on the other sequences' "
                f"positions)"
            )
        return None

    @property
    def rope_type(self) -> str:
        """The model's rotary scaling type, `default` when it has none."""
        text = self.model.config.get_text_config()
        for name in ("rope_parameters", "rope_scaling"):
            params = getattr(text, name, None)
            if isinstance(params, dict):
                return str(params.get("rope_type", params.get("type", "default")))
        return "default"

    def batch_attention(self) -> Any:
        """The attention function a packed pass runs per sequence (the model's own row-exact one)."""
        reason = self.batchable
        if reason is not None:
            raise InputError(reason)
        from leapdecode.models.row_exact import row_exact_attention

        return row_exact_attention

    def new_sequence(self) -> CacheState:
        """An empty sequence, for a packed pass to prefill (`engine.batch`)."""
        return CacheState(cache=new_growing_cache(), length=0)

    @torch.inference_mode()
    def fork(self, seq: CacheState) -> CacheState:
        """A copy of `seq` with a cache of its own: requests with the same prompt (`n` > 1
        siblings) share one prefill and then decode apart."""
        copy = new_growing_cache()
        for index, layer in enumerate(seq.cache.layers):
            copy.update(layer.keys, layer.values, index)  # a `GrowingLayer` copies into fresh buffers
        return CacheState(cache=copy, length=seq.length)


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


def _chosen_states(out: Any, features: tuple[int, ...]) -> torch.Tensor | None:
    """The `features` layers' states of a forward's output, side by side: [n, F], or None."""
    return torch.cat([out.hidden_states[i][0] for i in features], dim=-1) if features else None


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
