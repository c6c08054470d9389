"""The garbage collector paused while a model loads (`leapdecode.gc_pause`): off inside, back on
after, nested pauses and other threads' pauses held open, a collector the caller disabled left
alone, and the places that load a model running inside a pause."""

from __future__ import annotations

import gc
import threading

import pytest

from leapdecode import wrap
from leapdecode.gc_pause import gc_paused
from leapdecode.methods import Autoregressive
from leapdecode.models import loading


@pytest.fixture(autouse=True)
def collector_on():
    was = gc.isenabled()
    gc.enable()
    yield
    gc.enable() if was else gc.disable()


def test_a_pause_turns_the_collector_off_and_back_on_even_on_an_error() -> None:
    with gc_paused():
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(ValueError), gc_paused():
        raise ValueError("a load that fails")
    assert gc.isenabled()


def test_nested_pauses_resume_only_when_the_outermost_ends() -> None:
    with gc_paused():
        with gc_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert gc.isenabled()


def test_a_collector_the_caller_disabled_stays_disabled() -> None:
    gc.disable()
    with gc_paused():
        pass
    assert not gc.isenabled()


def test_a_pause_in_another_thread_keeps_the_collector_off_until_it_ends() -> None:
    entered, release = threading.Event(), threading.Event()

    def other() -> None:
        with gc_paused():
            entered.set()
            release.wait(10)

    thread = threading.Thread(target=other)
    thread.start()
    assert entered.wait(10)
    with gc_paused():
        pass
    assert not gc.isenabled()  # the other thread's load is still running
    release.set()
    thread.join(10)
    assert gc.isenabled()


def test_loading_a_model_and_wrapping_it_run_with_the_collector_paused(monkeypatch, real_lm) -> None:
    seen: list[bool] = []
    real_config = loading._load_config

    def load_config(source):  # a step inside load_model
        seen.append(gc.isenabled())
        return real_config(source)

    monkeypatch.setattr(loading, "_load_config", load_config)
    loading.load_model("smollm2-135m", log=lambda msg: None, quantize="none", row_exact=False)
    decoder_seen: list[bool] = []
    real_prepare = Autoregressive.prepare

    def prepare(self, *args, **kwargs):
        decoder_seen.append(gc.isenabled())
        return real_prepare(self, *args, **kwargs)

    monkeypatch.setattr(Autoregressive, "prepare", prepare)
    wrap(real_lm, "ar")
    assert seen == [False] and decoder_seen == [False]
    assert gc.isenabled()
