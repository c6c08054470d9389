"""The C++ kernels let other Python threads run while they compute: the server's event loop
answers (`/health`, new requests, streamed tokens) while its worker thread is in a long pass."""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable

import pytest
import torch

from leapdecode.models import quantize, row_exact


def others_ran_during(work: Callable[[], object]) -> bool:
    """Whether another Python thread ran while `work()` was inside its C++ call: with the switch
    interval made longer than the call, Python never hands the GIL over between bytecodes, so the
    waiting thread, woken just before the call, can only run during it if the call released the
    GIL (else it runs after, and sees the call over)."""
    state = {"in_call": False}
    woken, seen = threading.Event(), threading.Event()

    def watch() -> None:
        woken.wait()  # blocked without the GIL until the call is about to start
        if state["in_call"]:
            seen.set()

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    previous = sys.getswitchinterval()
    try:
        sys.setswitchinterval(30.0)
        state["in_call"] = True
        woken.set()
        work()
        state["in_call"] = False
    finally:
        sys.setswitchinterval(previous)
        woken.set()
    watcher.join()
    return seen.is_set()


@pytest.fixture(scope="module")
def exact() -> object:
    module = row_exact.kernel()
    assert module is not None, "the row-exact kernel must build where the tests run"
    return module


def test_attention_releases_the_gil(exact) -> None:
    query, key, value = torch.randn(1, 12, 256, 128), torch.randn(1, 2, 3000, 128), torch.randn(1, 2, 3000, 128)
    for _ in range(5):  # a call takes about 0.1 s: ample time for the watcher to be scheduled on a busy machine
        if others_ran_during(lambda: exact.row_exact_attention(query, key, value, None, 0.1, False)):
            return
    pytest.fail("no other thread ran during five attention calls: the kernel holds the GIL")


def test_linear_layers_release_the_gil(exact) -> None:
    x, w = torch.randn(256, 2048), torch.randn(4096, 2048)
    assert any(others_ran_during(lambda: exact.row_exact_linear(x, w, torch.empty(0), False)) for _ in range(5))
    quant = quantize.kernel()
    assert quant is not None
    layer = quantize.QuantizedLinear.from_weight(torch.randn(4096, 2048) / 50, 4)
    assert any(others_ran_during(lambda: layer(torch.randn(256, 2048))) for _ in range(5))
