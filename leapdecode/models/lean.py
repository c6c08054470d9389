"""A lean forward: the decoder body of a Llama-family model on the quantized kernels, in few calls.

Why: on a CPU, transformers' forward runs ~40 small torch ops and a dozen module calls,
decorators and hooks a layer, and each small op between two weight streams waits for its code
to come back into the caches: 7 of the 0.5B's 23 ms a pass, and ~20 of the 1.5B's 75
(`docs/lossless.md`). This forward runs the same layers in the same float operations through the
same kernels, with the query, key and value projections fused into one quantized product and
the gate and up projections into another where their bits match (output blocks are computed
independently, so a fused product gives each output's bits unchanged): a Python loop of about
twenty calls a layer (`forward`, any pass) or one C++ call for all layers (`forward_native`:
chains and trees of one sequence or several packed side by side, `lean.cpp`).

It is built only for a model it reproduces: a decoder of RMS-normed layers, each attention (the
four projections, nothing else) then a SwiGLU MLP (gate, up, down and a SiLU), its norms and
linear layers on the row-exact and quantized kernels, and its own rotary module. `LeanDecoder.build`
checks that structure; a backend (`engine.lean_pass.lean_agrees`) then scores a short prompt and
a chain through both forwards and takes this one only where the scores are bitwise equal.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from leapdecode.models import packing, quantize, row_exact
from leapdecode.models.extensions import build
from leapdecode.models.quantize import QuantizedLinear
from leapdecode.models.row_exact import RowExactRMSNorm

# (layer index, query [1, heads, n, dim], key and value [1, kv_heads, n, dim]) -> [1, n, heads, dim]:
# writes the keys and values to the sequence's (or each packed sequence's) cache and attends there
Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

_LAYER_PARTS = {"self_attn", "mlp", "input_layernorm", "post_attention_layernorm"}
_ATTENTION_PARTS = {"q_proj", "k_proj", "v_proj", "o_proj"}
_MLP_PARTS = {"gate_proj", "up_proj", "down_proj", "act_fn"}


@dataclass(frozen=True)
class LeanLayer:
    """One decoder layer's parts. `attention_in`: the query, key and value projections fused into
    one product, or the three where they cannot share one (other bits); `mlp_in` likewise the gate
    and up projections (one or two)."""

    norm_in: RowExactRMSNorm
    attention_in: tuple[QuantizedLinear, ...]  # [hidden] -> [(heads + 2 kv_heads) * dim] side by side
    o: QuantizedLinear
    norm_post: RowExactRMSNorm
    mlp_in: tuple[QuantizedLinear, ...]  # [hidden] -> [2 * intermediate] side by side
    down: QuantizedLinear

    def linears(self) -> list[QuantizedLinear | None]:
        """The layer's products in `lean.cpp`'s slots (None: an empty slot, the part fused)."""
        a, m = self.attention_in, self.mlp_in
        return [a[0], *(a[1:] or (None, None)), self.o, m[0], *(m[1:] or (None,)), self.down]


@dataclass(frozen=True)
class NativeLayers:
    """Every layer's parts as `lean.cpp` takes them (its slot order), with the built extension."""

    module: Any
    weights: list[torch.Tensor]  # per layer: norms' weights and packed blocks (empty: a fused slot)
    biases: list[torch.Tensor]  # per linear slot (empty: none)
    outs: list[int]  # per linear slot: outputs (0: empty)
    bits: list[int]
    super_blocks: list[int]
    eps: float
    isa: int


@dataclass(frozen=True)
class NativeSequence:
    """One sequence's part of a C++ pass (`LeanDecoder.forward_native`): its `count` rows come after
    `length` cached tokens, whose per-layer key and value buffers [1, kv_heads, capacity, dim] have
    room for them; `visible` None for a chain, else a tree's [count, length + count] bool (the keys
    each node sees)."""

    length: int
    count: int
    buffers: list[tuple[torch.Tensor, torch.Tensor]]
    visible: torch.Tensor | None = None


class LeanDecoder:
    """The decoder body's forward (embeddings to the final norm) over one or several sequences."""

    def __init__(self, body: nn.Module, layers: list[LeanLayer], heads: int, kv_heads: int, head_dim: int) -> None:
        self.body = body
        self.layers = layers
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.scale = head_dim**-0.5
        self.quant = quantize.kernel()
        self.exact = row_exact.kernel()
        self.native = self._native_args()

    def _native_args(self) -> NativeLayers | None:
        """The layers as `lean.cpp` takes them, with the extension; None where they do not share
        one kernel path and norm epsilon (or it does not build): then the Python loop runs."""
        slots = [linear for layer in self.layers for linear in layer.linears()]
        linears = [linear for linear in slots if linear is not None]
        norms = [norm for layer in self.layers for norm in (layer.norm_in, layer.norm_post)]
        if len({linear.isa for linear in linears}) != 1 or len({norm.variance_epsilon for norm in norms}) != 1:
            return None
        module = kernel()
        if module is None:
            return None
        none = torch.empty(0)
        weights = []
        for layer in self.layers:
            packed = [none if linear is None else linear.packed for linear in layer.linears()]
            weights += [layer.norm_in.weight, *packed[:4], layer.norm_post.weight, *packed[4:]]
        return NativeLayers(
            module=module,
            weights=weights,
            biases=[none if linear is None or linear.bias is None else linear.bias for linear in slots],
            outs=[0 if linear is None else linear.out_features for linear in slots],
            bits=[0 if linear is None else linear.bits for linear in slots],
            super_blocks=[int(linear is not None and linear.super_blocks) for linear in slots],
            eps=norms[0].variance_epsilon,
            isa=linears[0].isa,
        )

    @classmethod
    def build(cls, model: Any) -> tuple[LeanDecoder | None, str]:
        """The lean forward of `model` (a transformers causal LM on the CPU kernels), or None and
        why it keeps its own forward. Its structure only: the caller checks the numbers."""
        body = model.get_decoder()
        parts = dict(body.named_children())
        if quantize.kernel() is None or row_exact.kernel() is None:
            return None, "the C++ kernels are not built"
        if not {"embed_tokens", "layers", "norm", "rotary_emb"} <= parts.keys() or not isinstance(
            parts["norm"], RowExactRMSNorm
        ):
            return None, "its decoder is not embeddings, layers, a final RMS norm and a rotary module"
        text = model.config.get_text_config()
        heads, kv_heads = int(text.num_attention_heads), int(text.num_key_value_heads)
        head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // heads)
        layers = []
        for layer in parts["layers"]:
            lean = _lean_layer(layer)
            if lean is None:
                return None, "a layer is not an RMS-normed attention and SwiGLU MLP on the quantized kernels"
            layers.append(lean)
        return cls(body, layers, heads, kv_heads, head_dim), ""

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attend: Attend) -> torch.Tensor:
        """input_ids, positions [n] -> the final norm's states [n, hidden]."""
        n = input_ids.shape[0]
        x = self.body.embed_tokens(input_ids[None])[0]  # [n, hidden]
        cos, sin = self.body.rotary_emb(x[None], positions[None])  # each [1, n, dim]
        cos, sin = cos[:, None], sin[:, None]  # [1, 1, n, dim]
        h, kv, d = self.heads, self.kv_heads, self.head_dim
        half = d // 2
        for index, layer in enumerate(self.layers):
            qkv = self._linears(layer.attention_in, layer.norm_in(x))  # [n, (h + 2 kv) d]
            qk = qkv[:, : (h + kv) * d].view(1, n, h + kv, d).transpose(1, 2)  # [1, h + kv, n, d]
            # rotary as transformers applies it (q * cos + rotate_half(q) * sin): the same bits
            turned = torch.cat((-qk[..., half:], qk[..., :half]), dim=-1)
            qk = (qk * cos) + (turned * sin)
            values = qkv[:, (h + kv) * d :].view(1, n, kv, d).transpose(1, 2)  # [1, kv, n, d]
            out = attend(index, qk[:, :h], qk[:, h:], values)  # [1, n, h, d]
            x = x + self._linear(layer.o, out.reshape(n, h * d))
            gate_up = self._linears(layer.mlp_in, layer.norm_post(x))  # [n, 2 * intermediate]
            width = gate_up.shape[1] // 2
            x = x + self._linear(layer.down, nn.functional.silu(gate_up[:, :width]) * gate_up[:, width:])
        states: torch.Tensor = self.body.norm(x)  # [n, hidden]
        return states

    def forward_native(
        self, input_ids: torch.Tensor, positions: torch.Tensor, sequences: list[NativeSequence]
    ) -> torch.Tensor:
        """`forward` in one C++ call (`native` set): the same states. input_ids, positions [N]: the
        rows of `sequences` side by side, each sequence's `count` of them; the products run over
        all N rows at once, attention per sequence over its own cache, whose buffers it writes
        (the caller then extends each cache)."""
        assert self.native is not None, "the layers take the C++ call"
        native = self.native
        x = self.body.embed_tokens(input_ids[None])[0]  # [N, hidden]
        cos, sin = self.body.rotary_emb(x[None], positions[None])  # each [1, N, dim]
        layers = len(self.layers)
        x = native.module.lean_layers(
            x,
            native.weights,
            native.biases,
            native.outs,
            [seq.buffers[layer][0] for layer in range(layers) for seq in sequences],
            [seq.buffers[layer][1] for layer in range(layers) for seq in sequences],
            [seq.length for seq in sequences],
            [seq.count for seq in sequences],
            cos[0],
            sin[0],
            [seq.visible for seq in sequences],
            self.heads,
            self.kv_heads,
            native.eps,
            self.scale,
            native.bits,
            native.super_blocks,
            native.isa,
        )  # [N, hidden]
        states: torch.Tensor = self.body.norm(x)
        return states

    def attend_cache(self, cache: Any, visible: torch.Tensor | None = None) -> Attend:
        """Attention for one sequence over `cache` (a transformers cache: `update` appends and
        returns the layer's keys and values): causal for a chain after the cached tokens, or over
        the keys `visible` [n, past + n] (bool) gives each row (a tree's nodes)."""

        def attend(index: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
            keys, values = cache.update(key, value, index)
            result: torch.Tensor = self.exact.row_exact_attention(query, keys, values, visible, self.scale, False)
            return result

        return attend

    def _linears(self, layers: tuple[QuantizedLinear, ...], x: torch.Tensor) -> torch.Tensor:
        """The products of `layers` (one fused, or several in one kernel call) side by side:
        [n, sum of outputs]."""
        if len(layers) == 1:
            return self._linear(layers[0], x)
        if len({layer.isa for layer in layers}) > 1:  # paths set per layer (tests): each its own call
            return torch.cat([self._linear(layer, x) for layer in layers], dim=-1)
        out: torch.Tensor = self.quant.quantized_linears(
            x,
            [layer.packed for layer in layers],
            [layer.bits for layer in layers],
            [int(layer.super_blocks) for layer in layers],
            [layer.out_features for layer in layers],
            [layer.bias for layer in layers],
            layers[0].isa,
        )
        return out

    def _linear(self, layer: QuantizedLinear, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.quant.quantized_linear(
            x, layer.packed, layer.bits, layer.super_blocks, layer.out_features, layer.bias, layer.isa
        )
        return out


def kernel() -> Any | None:
    """The compiled whole-pass extension (the quantized and row-exact kernels linked in), or None
    (logged) where it cannot be built."""
    return build("lean", "lean.cpp", "quant.cpp", "row_exact.cpp", defines=("LEAPDECODE_NO_MODULE",))


def _lean_layer(layer: nn.Module) -> LeanLayer | None:
    """One decoder layer's lean parts, or None where its structure is not the one this forward runs."""
    parts = dict(layer.named_children())
    if parts.keys() != _LAYER_PARTS or layer._forward_hooks or layer._forward_pre_hooks:
        return None
    attention, mlp = dict(parts["self_attn"].named_children()), dict(parts["mlp"].named_children())
    norms = (parts["input_layernorm"], parts["post_attention_layernorm"])
    if attention.keys() != _ATTENTION_PARTS or mlp.keys() != _MLP_PARTS:
        return None
    if not all(isinstance(norm, RowExactRMSNorm) for norm in norms):
        return None
    linears = [attention[name] for name in ("q_proj", "k_proj", "v_proj", "o_proj")]
    linears += [mlp[name] for name in ("gate_proj", "up_proj", "down_proj")]
    if not all(isinstance(linear, QuantizedLinear) and not linear._forward_hooks for linear in linears):
        return None
    if not _is_silu(mlp["act_fn"]):
        return None
    q, k, v, o, gate, up, down = linears
    return LeanLayer(norms[0], _fused([q, k, v]), o, norms[1], _fused([gate, up]), down)


def _fused(layers: list[QuantizedLinear]) -> tuple[QuantizedLinear, ...]:
    """One quantized layer computing `layers`' outputs side by side, or `layers` themselves where
    they cannot share one product (other bits or inputs, an output count off the kernel's blocks
    of 8, biases on some only). The layers then read their weights from the fused layer's memory
    (views of it), so the model's own forward keeps working, nothing is held twice, and a second
    build over the same model fuses without copying."""
    first = layers[0]
    if (
        any(
            (layer.bits, layer.super_blocks, layer.in_features) != (first.bits, first.super_blocks, first.in_features)
            or layer.out_features % packing.BLOCK
            for layer in layers
        )
        or len({layer.bias is None for layer in layers}) != 1
    ):
        return tuple(layers)
    bias = None if first.bias is None else torch.cat([layer.bias for layer in layers if layer.bias is not None])
    out = sum(layer.out_features for layer in layers)
    blocks = sum(layer.packed.shape[0] for layer in layers)
    if _side_by_side([layer.packed for layer in layers]):  # fused before: one view over them
        packed = first.packed.new_empty(0).set_(
            first.packed.untyped_storage(), first.packed.storage_offset(), (blocks, *first.packed.shape[1:])
        )
        return (QuantizedLinear(packed, first.bits, out, first.in_features, bias, first.super_blocks, copy=False),)
    packed = torch.cat([layer.packed for layer in layers])  # [blocks, ...]
    fused = QuantizedLinear(packed, first.bits, out, first.in_features, bias, super_blocks=first.super_blocks)
    start = 0
    for layer in layers:
        count = layer.packed.shape[0]
        layer.packed = fused.packed[start : start + count]
        start += count
    return (fused,)


def _side_by_side(tensors: list[torch.Tensor]) -> bool:
    """Whether `tensors` (contiguous) lie one right after another in one storage."""
    storage = tensors[0].untyped_storage().data_ptr()
    for before, after in zip(tensors, tensors[1:]):
        if after.untyped_storage().data_ptr() != storage or after.data_ptr() != before.data_ptr() + before.nbytes:
            return False
    return all(t.is_contiguous() for t in tensors)


def _is_silu(module: nn.Module) -> bool:
    """Whether `module` computes SiLU (checked on values, whatever its class)."""
    x = torch.linspace(-6, 6, 97)  # [97]
    with torch.inference_mode():
        try:
            return torch.equal(module(x), nn.functional.silu(x))
        except (RuntimeError, TypeError):
            return False
