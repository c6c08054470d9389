"""Bit-exact verification by construction: every row of a multi-token pass scores exactly as a
one-token pass does.

On a CPU, BLAS kernels round an M-row product differently from a 1-row product, and attention
over a masked block differs from attention over the visible keys alone; so a verified token is
plain decoding's only up to last-bit rounding (a near-tie could flip it). `use_row_exact` swaps
two things, through public interfaces only:
- every `nn.Linear` for a `RowExactLinear` sharing its parameters: up to `PASS_ROWS` rows go
  through a small C++ kernel (`row_exact.cpp`, built on first use with `torch.utils.cpp_extension`
  and cached) that loads each weight chunk once for all rows but keeps each row's reduction order
  fixed, so its cost stays nearly flat in the rows (a pass over several sequences, `engine.batch`,
  shares it); the backend prefills longer prompts in chunks of `PASS_ROWS` (`TorchBackend.prefill`);
- the attention implementation for `row_exact` (registered with transformers'
  `AttentionInterface`): each query row attends to exactly its visible keys, in cache order, as
  the one-token pass at that position would, in the same C++ extension (one call per layer for
  all rows and heads, reading the cache through its views; a bfloat16 cache widened to float per
  task, every sum in float, the output rounded once; without the extension, one SDPA call per
  row). Prefills too: a prompt scored whole or in chunks of any size, alone or beside other
  sequences, gives the same bits (chunked prefill, `engine.scheduler`). In a pass over several
  sequences (`BATCH_KEYWORD`) it runs once per sequence, over that sequence's own cache.
- every RMS-norm module (found by behaviour: same output as `RowExactRMSNorm` on random rows) for
  a `RowExactRMSNorm` sharing its weight: one C++ call per norm, each row on its own.
The rest of a decoder layer (rotary embeddings, activations; a bfloat16 model's own norms,
which compute each row alone) is computed row by row.
Measured: smollm2-135m's logits for 2, 4, 8 and 16 rows are bitwise those of one-token passes, in
float32 and in bfloat16 (there the linear layers take AVX512-BF16's `vdpbf16ps`: bf16 products,
float sums, one rounding to bf16 an output, as oneDNN's path that `nn.Linear` takes).

`load_model` turns this on by default on CPU, for float32 when the kernel builds and for
bfloat16 where the CPU also has AVX512-BF16 (measured: float32 plain decoding and ANPD as fast
as with the small-batch linear layers it replaces; bfloat16 plain decoding ~2x faster than with
`nn.Linear`'s one-row path); where it cannot build, the default falls back to those (logged: not
bit-exact), and an explicit `row_exact=True` to one `nn.Linear` call per row (exact, slower). A
CPU without AVX2/FMA (or, for bfloat16, AVX512-BF16) gets the kernel's portable scalar path (also
exact; slower, so bfloat16 is then row-exact only on request).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from leapdecode.models.extensions import build

logger = logging.getLogger("leapdecode")

# One sequence's decoding pass (the pending token and its draft): drafts are kept inside it, where
# the attention kernel's few-row paths are fast (every pass is row-exact; this bounds the draft).
EXACT_ROWS = range(1, 17)
# Rows the linear layers run through the kernel: a packed pass over several sequences (`engine.batch`),
# and a prompt's prefill chunk (`TorchBackend.prefill` cuts longer prompts into chunks of this size).
PASS_ROWS = 256
ATTENTION = "row_exact"
# The forward keyword that carries a packed pass's cache (`engine.batch.PackedCache`) to attention:
# with it, each sequence of the pass attends over its own cache (`attend`), through this function.
BATCH_KEYWORD = "leapdecode_batch"


def kernel() -> Any | None:
    """The compiled extension, or None (logged) when it cannot be built here."""
    module = build("row_exact", "row_exact.cpp")
    if module is None:
        logger.warning("row-exact verification falls back to one linear call per row")
    return module


class RowExactLinear(nn.Linear):
    """`nn.Linear` whose rows (up to `PASS_ROWS`) are each bit-identical to a one-row call: float32,
    or bfloat16 on a CPU with AVX512-BF16 (`bf16_linear_available`)."""

    portable: bool = False  # force the kernel's portable path (tests of machines without AVX2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        if (
            not 1 <= rows <= PASS_ROWS
            or x.device.type != "cpu"
            or x.dtype not in (torch.float32, torch.bfloat16)
            or x.dtype != self.weight.dtype
        ):
            return nn.functional.linear(x, self.weight, self.bias)
        flat = x.reshape(rows, x.shape[-1])  # [rows, in]
        module = kernel()
        if module is None:
            out = torch.cat([nn.functional.linear(flat[i : i + 1], self.weight, self.bias) for i in range(rows)])
        else:
            bias = self.bias if self.bias is not None else flat.new_empty(0)
            out = module.row_exact_linear(flat, self.weight, bias, self.portable)  # [rows, out]
        return out.reshape(*x.shape[:-1], out.shape[-1])


def bf16_linear_available() -> bool:
    """Whether bfloat16 linear layers can take the kernel's AVX512-BF16 path here (`vdpbf16ps`:
    measured on qwen2.5-coder-1.5b's shapes, one row 1.7x faster than `nn.Linear`'s oneDNN path,
    2 rows 1.5x, 8-16 rows level; rows bit-exact). Elsewhere its portable path is exact but slow,
    so bfloat16 models keep `nn.Linear`."""
    module = kernel()
    return module is not None and bool(module.bf16_path_available())


def row_exact_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Attention one query row at a time over exactly the keys it may see (see the module doc),
    prefills too: a prompt scored in chunks (`engine.batch`) then gives bitwise what it gives whole.

    query [batch, heads, q, dim]; key, value [batch, kv_heads, kv, dim]; attention_mask
    [batch, 1, q, kv] (boolean: True attends; or additive: 0 attends) or None (causal, the
    queries being the last q positions). Returns [batch, q, heads, dim]."""
    packed = kwargs.pop(BATCH_KEYWORD, None)
    if packed is not None:  # a pass over several sequences: each over its own keys, through this function
        return packed.attend(module, query, scaling, kwargs), None
    q_len, kv_len = query.shape[2], key.shape[2]
    if q_len > PASS_ROWS:  # a long input scored whole (a prefill outside the engine's chunks): by blocks of rows
        return _by_row_blocks(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        ), None
    if attention_mask is not None and attention_mask.shape[0] != 1:
        raise ValueError("row-exact attention decodes one sequence at a time")
    seen = None if attention_mask is None else attention_mask[0, 0]  # [q, kv]: True where a row attends
    if seen is not None and seen.dtype != torch.bool:
        seen = seen == 0
    compiled = (
        kernel()
        if query.dtype in (torch.float32, torch.bfloat16)
        and key.dtype == query.dtype
        and query.device.type == "cpu"
        and query.shape[0] == 1
        else None
    )
    if compiled is not None:  # the C++ kernel: no per-row Python, no host copy
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        return compiled.row_exact_attention(query, key, value, seen, scale, False), None  # [batch, q, heads, dim]
    rows: list[slice | torch.Tensor]
    if seen is None:
        rows = [slice(0, kv_len - q_len + i + 1) for i in range(q_len)]
    else:
        # a row whose visible keys are a prefix (a chain) takes a view; others (a tree) gather
        counts = torch.stack([seen.sum(-1), seen.int().cumprod(-1).sum(-1)]).tolist()  # [2, q]: one host copy per layer
        rows = [slice(0, n) if n == lead else seen[i].nonzero()[:, 0] for i, (n, lead) in enumerate(zip(*counts))]
    gqa = query.shape[1] != key.shape[1]
    outs = [
        nn.functional.scaled_dot_product_attention(
            query[:, :, i : i + 1],
            key[:, :, visible],
            value[:, :, visible],
            dropout_p=dropout,
            scale=scaling,
            enable_gqa=gqa,
        )
        for i, visible in enumerate(rows)
    ]  # each [batch, heads, 1, dim]
    return torch.cat(outs, dim=2).transpose(1, 2), None


def _by_row_blocks(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: Any,
) -> torch.Tensor:
    """`row_exact_attention` over blocks of `PASS_ROWS` query rows: each row is computed alone,
    so the bits are the same, and the kernel's scratch space stays [PASS_ROWS, keys] a task."""
    q_len, kv_len = query.shape[2], key.shape[2]
    outs = []
    for start in range(0, q_len, PASS_ROWS):
        end = min(q_len, start + PASS_ROWS)
        if attention_mask is None:  # causal: the block's rows see the keys up to their own position
            visible = kv_len - q_len + end
            out, _ = row_exact_attention(
                module, query[:, :, start:end], key[:, :, :visible], value[:, :, :visible], None, **kwargs
            )
        else:
            out, _ = row_exact_attention(
                module, query[:, :, start:end], key, value, attention_mask[:, :, start:end], **kwargs
            )
        outs.append(out)  # [batch, rows, heads, dim]
    return torch.cat(outs, dim=1)


class RowExactRMSNorm(nn.Module):
    """An RMS norm, y = weight * (x / sqrt(mean(x^2) + eps)), in one C++ call (float32 on CPU; the
    same formula in torch ops elsewhere). It stands in for a model's own RMS-norm modules
    (`use_row_exact` checks each one's output first): one call instead of seven small ops, each row
    computed alone, so rows stay bit-exact."""

    portable: bool = False

    def __init__(self, weight: nn.Parameter, eps: float) -> None:
        super().__init__()
        self.weight = weight
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        module = (
            kernel()
            if x.dtype == torch.float32 and x.device.type == "cpu" and self.weight.dtype == torch.float32
            else None
        )
        if module is not None:
            return module.rms_norm(x, self.weight, self.variance_epsilon, self.portable)
        variance = x.float().pow(2).mean(-1, keepdim=True)
        return self.weight * (x.float() * torch.rsqrt(variance + self.variance_epsilon)).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}"


def _as_rms_norm(module: nn.Module) -> RowExactRMSNorm | None:
    """`module` as a `RowExactRMSNorm` when it is one in behaviour: no children or hooks, a 1-D
    float32 weight, an epsilon, and the same output on random rows (a LayerNorm, or Gemma's
    1 + weight form, is left alone)."""
    weight = getattr(module, "weight", None)
    eps = next(
        (
            getattr(module, name)
            for name in ("variance_epsilon", "eps", "epsilon")
            if isinstance(getattr(module, name, None), float)
        ),
        None,
    )
    if (
        eps is None
        or not isinstance(weight, nn.Parameter)
        or weight.dim() != 1
        or weight.dtype != torch.float32
        or weight.device.type != "cpu"
        or getattr(module, "bias", None) is not None
        or next(module.children(), None) is not None
        or module._forward_hooks
        or module._forward_pre_hooks
    ):
        return None
    candidate = RowExactRMSNorm(weight, eps)
    x = torch.randn(3, weight.shape[0], generator=torch.Generator().manual_seed(0)) * 4  # [3, dim]
    with torch.inference_mode():
        try:
            same = torch.allclose(module(x), candidate(x), rtol=1e-5, atol=1e-6)
        except (RuntimeError, TypeError, ValueError):
            return None
    return candidate if same else None


def register_attention() -> None:
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    AttentionInterface.register(ATTENTION, row_exact_attention)
    AttentionMaskInterface.register(ATTENTION, sdpa_mask)


def use_row_exact(model: nn.Module) -> int:
    """Make `model`'s passes row-exact (float32 or bfloat16 on CPU): swap its `nn.Linear`s
    (sharing their parameters), its float32 RMS norms (`RowExactRMSNorm`; bfloat16 ones keep the
    model's own, which compute each row alone) and its attention implementation. Returns how many
    linear layers were swapped."""
    register_attention()
    fused_norms = kernel() is not None  # built (or found cached) now, not in the first decode step
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            norm = _as_rms_norm(child) if fused_norms else None
            if norm is not None:
                norm.train(child.training)
                setattr(parent, name, norm)
                continue
            if type(child) is not nn.Linear or child._forward_hooks or child._forward_pre_hooks:
                continue
            exact = RowExactLinear(child.in_features, child.out_features, bias=False, device="meta")
            exact.weight = child.weight
            exact.bias = child.bias
            exact.train(child.training)
            setattr(parent, name, exact)
            swapped += 1
    model.set_attn_implementation(ATTENTION)
    return swapped
