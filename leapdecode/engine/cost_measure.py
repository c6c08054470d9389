"""Measuring what a target pass costs on a backend: the curves `engine.cost` reasons over.

Timed rounds over every size, interleaved, so that a burst of other load on the machine lands on
one round of several sizes, not on every repeat of one; each size's fastest repeat is its cost
(other work only ever slows a pass), fitted non-decreasing. How far the sizes' second-fastest
repeats ran from their fastest (the median over sizes) is the curve's `spread`: wide when the
machine was busy for more than one round, which `engine.cost_store` refuses to keep.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

from leapdecode.engine.backend import Backend, Packer
from leapdecode.engine.cost import ForwardCost, nondecreasing_fit
from leapdecode.engine.tree import TreeLayout, compile_tree, full_tree_parents

Timer = Callable[[], float]
SPREAD_FLOOR_S = 0.005  # a pass's jitter below this is the timer's and the scheduler's, not another job's


def fastest(runs: Sequence[Sequence[float]]) -> tuple[list[float], float]:
    """Each size's fastest repeat, and the spread: the median, over sizes, of how much slower a
    size's second-fastest repeat ran than its fastest, relative to the fastest or to
    `SPREAD_FLOOR_S` if longer (a tiny model's sub-millisecond passes jitter by their timer);
    0 with one repeat. The median: a pass or two that a virtual machine's neighbour slowed is
    jitter, a busy minute slows every size of its rounds."""
    gaps = []
    for times in runs:
        ordered = sorted(times)
        if len(ordered) > 1:
            gaps.append((ordered[1] - ordered[0]) / max(ordered[0], SPREAD_FLOOR_S))
    return [min(times) for times in runs], statistics.median(gaps) if gaps else 0.0


def measure_forward_cost(
    backend: Backend,
    max_tokens: int,
    *,
    context: int = 64,
    repeats: int = 3,
    tree: bool = False,
    timer: Timer = time.perf_counter,
) -> ForwardCost:
    """Time passes of 1..max_tokens tokens after a `context`-token prompt on `backend`: `repeats`
    interleaved rounds over every size, the fastest per size, fitted non-decreasing
    (`nondecreasing_fit`), with their spread (see the module doc). `tree`: the drafted tokens
    form a breadth-first tree (a tree attention mask costs more than the causal one)."""
    vocab = backend.vocab_size
    tokens = [(1009 * i + 17) % vocab for i in range(context + max_tokens)]
    seq, _ = backend.prefill(tokens[:context])
    backend.forward(seq, tokens[context : context + 1])  # warm-up
    backend.rollback(seq, context)

    def layout(n: int) -> TreeLayout | None:  # the pending token, then n-1 drafted tokens
        return compile_tree(full_tree_parents(n - 1)) if tree and n > 2 else None

    runs: list[list[float]] = [[] for _ in range(max_tokens)]  # runs[n-1]: seconds of each round's n-token pass
    for _ in range(repeats):
        for n in range(1, max_tokens + 1):
            start = timer()
            backend.forward(seq, tokens[context : context + n], tree=layout(n))
            runs[n - 1].append(timer() - start)
            backend.rollback(seq, context)
    best, spread = fastest(runs)
    return ForwardCost(tuple(max(s, 1e-6) for s in nondecreasing_fit(best)), spread)


def measure_prefill_cost(
    backend: Backend, *, tokens: int = 128, repeats: int = 3, timer: Timer = time.perf_counter
) -> ForwardCost:
    """Seconds a prefill of `backend` takes per prompt token, as a one-point curve: a
    `tokens`-token prompt, the fastest of `repeats` after a warm-up, with their spread."""
    vocab = backend.vocab_size
    prompt = [(1009 * i + 17) % vocab for i in range(tokens)]
    backend.prefill(prompt[:8])  # warm-up
    runs = []
    for _ in range(repeats):
        start = timer()
        backend.prefill(prompt)
        runs.append(timer() - start)
    best, spread = fastest([runs])
    return ForwardCost((max(best[0] / tokens, 1e-9),), spread)


BATCH_SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)  # rows timed for a packed pass's curve


def measure_batch_cost(
    backend: Packer,
    max_rows: int,
    sequences: int,
    *,
    context: int = 64,
    repeats: int = 3,
    timer: Timer = time.perf_counter,
) -> ForwardCost:
    """Seconds of a pass over several sequences (`engine.batch`) by its rows, for 1..max_rows:
    `sequences` sequences of `context` cached tokens (fewer when the rows are fewer), the rows
    spread evenly over them as chains; timed at `BATCH_SIZES` in `repeats` rounds (the fastest per
    size, fitted non-decreasing, with their spread, as `measure_forward_cost`) and interpolated
    between them."""
    from leapdecode.engine.batch import BatchItem, forward_batch

    vocab = backend.vocab_size
    tokens = [(1009 * i + 17) % vocab for i in range(context + max_rows)]
    seqs = [backend.prefill([(t + s) % vocab for t in tokens[:context]])[0] for s in range(max(1, sequences))]
    sizes = sorted({n for n in BATCH_SIZES if n < max_rows} | {max_rows})

    def items(rows: int) -> list[BatchItem]:
        count = min(rows, len(seqs))
        share = [rows // count + (i < rows % count) for i in range(count)]
        return [BatchItem(seqs[i], tokens[context : context + share[i]]) for i in range(count)]

    forward_batch(backend, items(1))  # warm-up
    for seq in seqs:
        backend.rollback(seq, context)
    runs: list[list[float]] = [[] for _ in sizes]
    for _ in range(repeats):
        for j, rows in enumerate(sizes):
            start = timer()
            forward_batch(backend, items(rows))
            runs[j].append(timer() - start)
            for seq in seqs:
                backend.rollback(seq, context)
    best, spread = fastest(runs)
    fitted = nondecreasing_fit(best)
    seconds = []
    for rows in range(1, max_rows + 1):
        j = next(j for j, size in enumerate(sizes) if size >= rows)
        if sizes[j] == rows or j == 0:
            seconds.append(fitted[j])
        else:
            low, high = sizes[j - 1], sizes[j]
            seconds.append(fitted[j - 1] + (fitted[j] - fitted[j - 1]) * (rows - low) / (high - low))
    return ForwardCost(tuple(max(s, 1e-6) for s in seconds), spread)
