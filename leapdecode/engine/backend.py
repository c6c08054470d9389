"""The model side of the decode loop: score tokens over a KV cache, and cut the cache back.

A backend is stateless with respect to sequences: `prefill` returns a `CacheState` that owns
its KV cache, and every later call takes it. Nothing is stored on the model object, so one
loaded model can serve several sequences one after another.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import torch

from leapdecode.engine.cache import CacheState as CacheState
from leapdecode.engine.cache import cache_room as cache_room
from leapdecode.engine.cache import extend_cache as extend_cache
from leapdecode.engine.cache import keep_cache_entries as keep_cache_entries
from leapdecode.engine.cache import new_growing_cache as new_growing_cache
from leapdecode.engine.cache import rollback_cache as rollback_cache
from leapdecode.engine.lean_pass import attend_packed, lean_agrees, lean_packed_states, lean_states
from leapdecode.engine.tree import TreeLayout
from leapdecode.errors import InputError, ModelLoadError
from leapdecode.models.lean import LeanDecoder


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

    @property
    def packer(self) -> Packer | None:
        """This backend as one that packs several sequences into a pass and copies caches
        (`Packer`), or None when it cannot (llama.cpp's one context, the layered backends)."""
        ...


class Packer(Backend, Protocol):
    """A backend whose passes take several sequences' rows (`engine.batch`) and whose caches can
    be started empty and copied: what the scheduler's shared passes, a prompt in chunks and the
    prefix cache need. Its `model` names the weights: sequences share passes only over one."""

    model: Any

    def new_sequence(self) -> CacheState:
        """An empty sequence, for a packed pass to prefill."""
        ...

    def fork(self, seq: CacheState, length: int | None = None) -> CacheState:
        """A copy of `seq`'s first `length` tokens (None: all) with a cache of its own."""
        ...

    def prefill(
        self, prompt_ids: list[int], *, features: tuple[int, ...] = (), cached: CacheState | None = None
    ) -> tuple[CacheState, Scores]:
        """`Backend.prefill`, or the rest of the prompt after `cached`, a copy of a prefix of it."""
        ...

    def score_packed(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        cache: Any,
        rows: torch.Tensor,
        features: tuple[int, ...],
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One packed pass: the logits of `rows` [kept, vocab] and the `features` states [N, F]."""
        ...

    def batch_attention(self) -> Any:
        """The attention function a packed pass runs per sequence."""
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

    scores_trees: ClassVar[bool] = True  # token trees (a tree mask); False: chains only

    def __init__(self, model: Any, exact_tokens: int | None = None, *, lean: bool = True) -> None:
        """`exact_tokens`: on a row-exact model (every pass's rows bitwise one-token passes), the
        longest decoding pass to verify (`LoadedModel.exact_tokens`); drafts are kept one token
        shorter (the pending token). None: no row-exact guarantee. `lean`: passes without states
        on the lean forward where it gives bitwise this model's scores (`take_lean`)."""
        self.model = model
        self.exact_tokens = exact_tokens
        self.device: torch.device = model.device
        self.vocab_size: int = int(model.config.get_text_config().vocab_size)
        self.layout = AttentionLayout(model.config)
        self.attention = str(getattr(model.config, "_attn_implementation", None) or "eager")
        self.cache_argument = cache_argument(model.forward)
        self.lean: LeanDecoder | None = None
        self.lean_reason = "not asked for"  # why the model's own forward runs (empty on the lean one)
        if lean:
            self.take_lean()

    def take_lean(self) -> None:
        """Run passes without states on the lean forward (`models.lean`: the decoder layers in a few
        calls, in one C++ call a sequence's chain or tree where it builds) when it scores bitwise as
        the model's own forward (`engine.lean_pass.lean_agrees`); not with a sliding window."""
        if self.layout.window is not None:  # a window the short check would not reach
            self.lean, self.lean_reason = None, "sliding-window attention"
            return
        decoder, reason = LeanDecoder.build(self.model)
        if decoder is not None:
            lean = decoder
            if not lean_agrees(
                lambda ids, seq, tree: self._own_run(seq, ids, 0, tree).logits,
                lambda ids, seq, native, tree: self._lean_run(lean, seq, ids, 0, native=native, tree=tree).logits,
                self.vocab_size,
                trees=self.scores_trees,
            ):
                decoder, reason = None, "its scores differ from the model's own forward"
        self.lean, self.lean_reason = decoder, reason

    def head_logits(self, states: torch.Tensor) -> torch.Tensor:
        """The output layer over the final norm's states [k, hidden] -> [k, vocab]."""
        logits: torch.Tensor = self.model.get_output_embeddings()(states)
        return logits

    def _run(
        self,
        seq: CacheState,
        token_ids: list[int],
        logits_to_keep: int,
        tree: TreeLayout | None = None,
        features: tuple[int, ...] = (),
    ) -> Scores:
        if self.lean is not None and not features:
            return self._lean_run(self.lean, seq, token_ids, logits_to_keep, tree=tree)
        return self._own_run(seq, token_ids, logits_to_keep, tree, features)

    def _lean_run(
        self,
        decoder: LeanDecoder,
        seq: CacheState,
        token_ids: list[int],
        logits_to_keep: int,
        *,
        native: bool = True,
        tree: TreeLayout | None = None,
    ) -> Scores:
        tokens = torch.tensor(token_ids, dtype=torch.long, device=self.device)  # [n]
        states = lean_states(decoder, tokens, seq, native=native, tree=tree)  # [n, hidden]
        seq.length += len(token_ids)
        return Scores(logits=self.head_logits(states[-logits_to_keep:] if logits_to_keep else states))

    def _own_run(
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

        if self.lean is not None and not features:
            states = lean_packed_states(self.lean, input_ids[0], position_ids[0], cache)  # [N, hidden] or None
            if states is None:
                states = self.lean.forward(input_ids[0], position_ids[0], attend_packed(self.lean, cache))
            return self.head_logits(states[rows]), None

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
    def prefill(
        self, prompt_ids: list[int], *, features: tuple[int, ...] = (), cached: CacheState | None = None
    ) -> tuple[CacheState, Scores]:
        """`cached`: a cache that holds the prompt's first tokens already (a kept prefix,
        `engine.prefix_cache`, on a row-exact model): only the rest is scored, into it."""
        if cached is not None and (features or not 0 < cached.length < len(prompt_ids)):
            raise ValueError(
                f"a cached prefix of {cached.length} tokens must leave some of the {len(prompt_ids)} prompt tokens "
                f"to score, with no states asked for"
            )
        # Every layer keeps every position, sliding-window layers too (their window is applied by
        # the attention mask, by the model for chains and by `AttentionLayout` for trees): a
        # window-sized cache drops entries that rollback and tree compaction must keep, as Hugging
        # Face's assisted generation also finds.
        seq = cached if cached is not None else CacheState(cache=new_growing_cache(), length=0)
        # A row-exact model takes the prompt in chunks its kernels score row by row, so a prefill
        # cut anywhere else (a shared pass's chunk, `engine.scheduler`) gives the same bits.
        rest = prompt_ids[seq.length :]
        size = self.prefill_chunk or max(1, len(rest))
        chunks = [rest[i : i + size] for i in range(0, len(rest), size)] or [rest]
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

    @property
    def packer(self) -> TorchBackend:
        return self

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
    def fork(self, seq: CacheState, length: int | None = None) -> CacheState:
        """A copy of `seq`'s first `length` tokens (None: all) with a cache of its own: requests
        with the same prompt (`n` > 1 siblings) share one prefill and then decode apart, and a
        request starts from a kept sequence's prefix (`engine.prefix_cache`)."""
        length = seq.length if length is None else length
        if not 1 <= length <= seq.length:
            raise ValueError(f"cannot copy {length} tokens of a cache of {seq.length}")
        copy = new_growing_cache()
        for index, layer in enumerate(seq.cache.layers):
            # a `GrowingLayer` copies into fresh buffers
            copy.update(layer.keys[..., :length, :], layer.values[..., :length, :], index)  # [1, kv_heads, length, dim]
        return CacheState(cache=copy, length=length)


def _chosen_states(out: Any, features: tuple[int, ...]) -> torch.Tensor | None:
    """The `features` layers' states of a forward's output, side by side: [n, F], or None."""
    return torch.cat([out.hidden_states[i][0] for i in features], dim=-1) if features else None
