"""Faster verification passes on CPU: linear layers that score a few tokens at the cost of one.

A verification pass scores 2-16 tokens. On CPU BLAS, `nn.Linear` on a [n, in] input with
n >= 2 takes the GEMM path, which packs the whole weight matrix first: measured here (2 cores,
float32) a 2-token pass of Qwen2.5-Coder-1.5B costs 1.9x a 1-token pass, and the LM head alone
2.2x. Computing the same product as W @ x^T (weights as the left operand, the few tokens as a
thin right operand) avoids the packing: the 2-token pass costs ~1.05x. One token and long
inputs (prefill) keep `nn.Linear`'s own path, so plain decoding is unchanged.

The swap replaces `nn.Linear` children with `SmallBatchLinear` modules that share the same
parameter tensors: parameter names, `state_dict` and `save_pretrained` are unchanged.
"""

from __future__ import annotations

import torch
from torch import nn

SMALL_BATCH_ROWS = range(2, 17)  # token counts that take the thin-operand product


class SmallBatchLinear(nn.Linear):
    """`nn.Linear` with a different kernel choice for 2-16 rows; same parameters, same result
    up to float rounding."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        if rows not in SMALL_BATCH_ROWS or x.device.type != "cpu":
            return nn.functional.linear(x, self.weight, self.bias)
        flat = x.reshape(rows, x.shape[-1])  # [rows, in]
        out = torch.mm(self.weight, flat.T).T  # [rows, out]
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], out.shape[-1])


def use_small_batch_linear(model: nn.Module) -> int:
    """Swap every plain `nn.Linear` of `model` for a `SmallBatchLinear` sharing its parameters.
    Modules with hooks (e.g. accelerate offloading) are left alone. Returns how many were swapped."""
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is not nn.Linear or child._forward_hooks or child._forward_pre_hooks:
                continue
            fast = SmallBatchLinear(child.in_features, child.out_features, bias=False, device="meta")
            fast.weight = child.weight
            fast.bias = child.bias
            fast.train(child.training)
            setattr(parent, name, fast)
            swapped += 1
    return swapped
