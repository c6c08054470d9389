"""What the arguments of the draft path's one C++ call a pass cost to convert: `lean_layers` called
with the 0.5B's weight, bias, output-count, bit and form lists and its cache buffers, but no
sequence (so it fails at its first check, after pybind11 has converted everything), against the
same failing call with empty lists; medians of 2,000 each, after 300 cached tokens.

    python call_cost.py
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from leapdecode.bench.probes import CONTEXT, draft_path
from leapdecode.engine.cache import cache_room


def median_us(call: Callable[[], object], times: int = 2000) -> float:
    """Median microseconds of `times` calls of `call`, each failing with a RuntimeError or not."""
    seconds = []
    for _ in range(times):
        start = time.perf_counter()
        try:
            call()
        except RuntimeError:
            pass
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds) * 1e6


def main() -> None:
    torch.set_num_threads(2)
    _, backend = draft_path()
    decoder = backend.lean
    assert decoder is not None and decoder.native is not None
    native = decoder.native
    with torch.inference_mode():
        seq, _ = backend.prefill(CONTEXT)
        room = cache_room(seq, 1)
        assert room is not None
        keys, values = [r[0] for r in room], [r[1] for r in room]
        x, cos = torch.zeros(1, 896), torch.zeros(1, 64)
        scalars = (decoder.heads, decoder.kv_heads, native.eps, decoder.scale)

        def full() -> object:
            return native.module.lean_layers(
                x, native.weights, native.biases, native.outs, keys, values, [], [], cos, cos, [], *scalars,
                native.bits, native.super_blocks, native.isa,
            )  # fmt: skip

        def empty() -> object:
            return native.module.lean_layers(x, [], [], [], [], [], [], [], cos, cos, [], *scalars, [], [], native.isa)

        arguments = sum(map(len, (native.weights, native.biases, native.outs, keys, values, native.bits)))
        arguments += len(native.super_blocks)
        with_lists, without = median_us(full), median_us(empty)
    print(f"{arguments} list entries: {with_lists:.1f} us a call with them, {without:.1f} us without")
    print(f"converting them: {with_lists - without:.1f} us")


if __name__ == "__main__":
    main()
