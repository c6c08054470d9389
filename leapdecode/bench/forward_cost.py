"""The cost of one forward pass against the number of tokens it scores: the curve that decides
how long a chain or how big a tree is worth drafting on a given machine.

Each size is timed over a fixed cached context (median of `repeats` passes, the cache rolled
back after each), through the same backend the decode loop uses: as a chain with the model's
own linear layers, as a chain with the small-batch swap (`leapdecode.models.linear`), and as a
token tree (a 4D tree attention mask instead of the causal one) with the swap.
"""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from leapdecode.engine import Backend, TorchBackend, compile_tree
from leapdecode.engine.tree import full_tree_parents
from leapdecode.models import LoadedModel
from leapdecode.models.linear import SmallBatchLinear
from leapdecode.models.row_exact import RowExactLinear


@dataclass(frozen=True)
class ForwardCost:
    tokens: int
    ms: float  # median wall time of one pass
    relative: float  # ms / ms of a one-token pass


def _plain_copy(model: torch.nn.Module) -> torch.nn.Module:
    """The model with `nn.Linear`'s own kernels (weights shared, not copied)."""
    plain = copy.copy(model)
    plain._modules = dict(model._modules)
    for name, child in list(plain.named_children()):
        setattr(plain, name, _plain_copy(child))
    if isinstance(model, (SmallBatchLinear, RowExactLinear)):
        plain.__class__ = torch.nn.Linear
    return plain


def measure(
    model: torch.nn.Module | Backend,
    sizes: Sequence[int],
    context: int = 300,
    repeats: int = 5,
    vocab: int = 1000,
    tree: bool = False,
) -> list[ForwardCost]:
    """Pass costs of `model` (a torch module, run by `TorchBackend`, or any backend)."""
    backend = TorchBackend(model) if isinstance(model, torch.nn.Module) else model
    generator = torch.Generator().manual_seed(0)
    prefix = torch.randint(10, vocab, (context,), generator=generator).tolist()
    out: list[ForwardCost] = []
    with torch.inference_mode():
        seq, _ = backend.prefill(prefix)
        for n in sizes:
            ids = torch.randint(10, vocab, (n,), generator=generator).tolist()
            layout = compile_tree(full_tree_parents(n - 1)) if tree and n > 2 else None  # n-1 nodes + the root
            times = []
            for _ in range(repeats + 1):  # the first pass of each size is a warm-up
                start = time.perf_counter()
                backend.forward(seq, ids, tree=layout)
                times.append(time.perf_counter() - start)
                backend.rollback(seq, context)
            ms = statistics.median(times[1:]) * 1000
            out.append(ForwardCost(n, ms, ms / out[0].ms if out else 1.0))
    return out


def compare(
    lm: LoadedModel, sizes: Sequence[int], context: int = 300, repeats: int = 5
) -> dict[str, list[ForwardCost]]:
    """Chain costs with the small-batch linear layers (as loaded) and with plain `nn.Linear`, and
    tree costs (tree attention mask) with the model as loaded. On llama.cpp: its chain and tree
    costs as the engine pays them (drafts scored in the chunks that stay exact)."""
    vocab = lm.vocab_size
    if lm.backend == "llama.cpp":
        from leapdecode.engine.llamacpp_backend import LlamaCppBackend

        backend = LlamaCppBackend(lm.model)
        return {
            "chain, llama.cpp": measure(backend, sizes, context, repeats, vocab),
            "tree, llama.cpp": measure(backend, [n for n in sizes if n <= 16], context, repeats, vocab, tree=True),
        }
    kinds = {type(m) for m in lm.model.modules()}
    if lm.quantize != "none":
        loaded = f"{lm.quantize}{' row-exact' if lm.row_exact else ''}"
        return {  # quantized layers have no nn.Linear to compare with
            f"chain, {loaded}": measure(lm.model, sizes, context, repeats, vocab),
            f"tree, {loaded}": measure(lm.model, sizes, context, repeats, vocab, tree=True),
        }
    loaded = (
        "row-exact"
        if lm.row_exact
        else f"{lm.dtype} row-exact linear"
        if RowExactLinear in kinds
        else "small-batch linear"
        if SmallBatchLinear in kinds
        else f"{lm.dtype} as loaded"
    )
    return {
        f"chain, {loaded}": measure(lm.model, sizes, context, repeats, vocab),
        "chain, nn.Linear": measure(_plain_copy(lm.model), sizes, context, repeats, vocab),
        f"tree, {loaded}": measure(lm.model, sizes, context, repeats, vocab, tree=True),
    }


def markdown(results: dict[str, list[ForwardCost]], title: str) -> str:
    labels = list(results)
    sizes = [c.tokens for c in results[labels[0]]]
    lines = [
        title,
        "",
        "| tokens scored | " + " | ".join(f"{label} (ms, × one token)" for label in labels) + " |",
        "|---:|" + "---:|" * len(labels),
    ]
    for i, n in enumerate(sizes):
        cells = [
            f"{results[label][i].ms:.0f} ({results[label][i].relative:.2f}x)" if i < len(results[label]) else "–"
            for label in labels
        ]
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
