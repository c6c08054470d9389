"""Measured pass costs kept on disk (`engine.cost_store`), and the draft model's int4 rounding kept
in the cache: what a decoder measures or computes at load, done once per machine and model."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

from leapdecode import wrap
from leapdecode.api import Decoder
from leapdecode.engine import cost_measure as cost_module
from leapdecode.engine.cache import CacheState
from leapdecode.engine.cost import ForwardCost
from leapdecode.engine.cost_store import MAX_AGE_S, WIDE_SPREAD, CostStore, CurveKey, default_store
from leapdecode.methods import parse_method
from leapdecode.models.quantize import QuantizedLinear
from tests.helpers import make_tiny_model, tiny_lm

KEY = CurveKey("model abc torch int4 TorchBackend", "chains", 2)


def test_a_kept_curve_is_read_back_by_another_store_and_measured_once(tmp_path) -> None:
    measured: list[int] = []

    def measure() -> ForwardCost:
        measured.append(1)
        return ForwardCost((0.02, 0.021, 0.03), 0.05)

    first, kept_before = CostStore(tmp_path).curve(KEY, measure, 3)
    second, kept = CostStore(tmp_path).curve(KEY, measure, 3)  # a later process
    assert first == second == ForwardCost((0.02, 0.021, 0.03), 0.05) and not kept_before and kept and measured == [1]
    # a longer need than the kept curve, other threads, another kind: each measured afresh
    CostStore(tmp_path).curve(KEY, measure, 4)
    CostStore(tmp_path).curve(CurveKey(KEY.what, KEY.kind, 1), measure, 3)
    CostStore(tmp_path).curve(CurveKey(KEY.what, "trees", 2), measure, 3)
    assert len(measured) == 4
    assert CostStore(tmp_path).get(CurveKey(KEY.what, "trees", 2)) == ForwardCost((0.02, 0.021, 0.03), 0.05)


@pytest.mark.parametrize(
    "content", ["{not json", "[1, 2]", '{"model abc torch int4 TorchBackend|chains|2": {"seconds": [0.1, -1]}}']
)
def test_a_file_that_cannot_be_read_is_measured_again_and_rewritten(tmp_path, content) -> None:
    store = CostStore(tmp_path)
    store.path.write_text(content)
    assert store.get(KEY) is None
    cost, kept = store.curve(KEY, lambda: ForwardCost((0.5,)))
    assert cost == ForwardCost((0.5,)) and not kept and CostStore(tmp_path).get(KEY) == ForwardCost((0.5,))


def test_a_store_that_cannot_write_still_gives_the_measured_curve(tmp_path, caplog) -> None:
    blocked = tmp_path / "a file"
    blocked.write_text("")
    store = CostStore(blocked / "costs")  # its folder cannot be made
    cost, kept = store.curve(KEY, lambda: ForwardCost((0.5, 0.6)))
    assert cost.seconds == (0.5, 0.6) and not kept and "could not keep" in caplog.text


def test_a_later_decoder_reads_the_target_curve_measured_by_an_earlier_one(monkeypatch) -> None:
    calls: list[int] = []
    measure = cost_module.measure_forward_cost

    def counted(*args, **kwargs):  # as measured on a quiet machine: kept at once
        calls.append(1)
        return dataclasses.replace(measure(*args, **kwargs), spread=0.0)

    monkeypatch.setattr(cost_module, "measure_forward_cost", counted)
    lines: list[str] = []
    # two loads of the same weights (each LoadedModel keeps its own curves in memory)
    first = Decoder(tiny_lm(make_tiny_model("llama", seed=7)), "anpd:k=3,cost_aware=true", log=lines.append)
    second = Decoder(tiny_lm(make_tiny_model("llama", seed=7)), "anpd:k=3,cost_aware=true", log=lines.append)
    assert len(calls) == 1 and any("as measured before on this machine" in line for line in lines)
    assert first.generate([5, 6, 7, 5, 6], max_new_tokens=8).token_ids == (
        second.generate([5, 6, 7, 5, 6], max_new_tokens=8).token_ids
    )
    Decoder(tiny_lm(make_tiny_model("llama", seed=8)), "anpd:k=3,cost_aware=true", log=lines.append)  # other weights
    assert len(calls) == 2


def test_a_later_draft_decoder_reads_the_draft_models_curves(monkeypatch) -> None:
    calls: list[str] = []
    for name in ("measure_forward_cost", "measure_batch_cost", "measure_prefill_cost"):
        original = getattr(cost_module, name)

        def counted(*args, _original=original, _name=name, **kwargs):  # a quiet machine's: kept at once
            calls.append(_name)
            return dataclasses.replace(_original(*args, **kwargs), spread=0.0)

        monkeypatch.setattr(cost_module, name, counted)
    costs, measured = [], []
    for _ in range(2):  # two loads of the same pair
        target, draft = tiny_lm(make_tiny_model("qwen2", seed=3)), tiny_lm(make_tiny_model("qwen2", seed=4))
        run = wrap(target, "draft:k=3", draft_model=draft).start([5, 6, 7, 8], max_new_tokens=4)
        assert run.drafter.cost is not None
        costs.append((run.drafter.cost.draft.base.seconds, run.drafter.cost.prefill, run.drafter.cost.target.base))
        measured.append(list(calls))
    # the target's curve, the draft model's passes and its prefill: measured by the first only
    assert "measure_prefill_cost" in measured[0] and len(measured[0]) == 3 and measured[1] == measured[0]
    assert costs[0] == costs[1] and default_store().path.is_file()
    # a curve the passes contradict is forgotten: the target's chains, then the draft model's passes
    before = {curve.key for curve in default_store().kept()}
    run.drafter.cost.target.on_misshapen()
    after_target = {curve.key for curve in default_store().kept()}
    run.drafter.cost.draft.on_misshapen()
    after_draft = {curve.key for curve in default_store().kept()}
    assert [key.rsplit("|", 2)[1] for key in before - after_target] == ["chains"]
    assert [key.rsplit("|", 2)[1] for key in after_target - after_draft] == ["draft pass"]  # tiny: no packing


def test_a_draft_model_is_rounded_once_then_read_back_with_the_same_records(monkeypatch, tmp_path) -> None:
    from leapdecode.models import loading

    monkeypatch.setattr(loading, "default_cache_dir", lambda: tmp_path)
    monkeypatch.setattr(loading, "load_model", lambda *args, **kwargs: tiny_lm(make_tiny_model("qwen2", seed=5)))
    method = parse_method("draft:model=tiny")
    target = tiny_lm(make_tiny_model("qwen2"))

    def records(lm) -> dict[str, torch.Tensor]:
        return {name: m.packed for name, m in lm.model.named_modules() if isinstance(m, QuantizedLinear)}

    first_log: list[str] = []
    first = method.load_draft(target, first_log.append)
    saved = list((tmp_path / "quantized").glob("*-draft-int4-*.safetensors"))
    second_log: list[str] = []
    second = method.load_draft(target, second_log.append)
    assert any("rounded its linear layers" in line for line in first_log) and len(saved) == 1
    assert any("as rounded before" in line for line in second_log)
    a, b = records(first), records(second)
    assert a.keys() == b.keys() and "lm_head" in a and all(torch.equal(a[n], b[n]) for n in a)
    assert second.quantize == "int4"
    # a file that holds only some of the layers: the rest rounded, and the file written whole again
    from safetensors.torch import load_file, save_file

    held = load_file(str(saved[0]))
    save_file({k: v for k, v in held.items() if not k.startswith("lm_head.")}, str(saved[0]))
    part_log: list[str] = []
    method.load_draft(target, part_log.append)
    assert any("rounded its linear layers" in line for line in part_log)
    assert load_file(str(saved[0])).keys() == held.keys()
    # a file cut short is not read: rounded again and written whole
    saved[0].write_bytes(saved[0].read_bytes()[:100])
    third_log: list[str] = []
    method.load_draft(target, third_log.append)
    assert any("rounded its linear layers" in line for line in third_log)
    assert all(torch.equal(records(method.load_draft(target, lambda _: None))[n], a[n]) for n in a)


class BusyMinuteBackend:
    """Passes of n tokens take 10 + n ms on a fake clock, and `busy` times that while the clock
    is inside the busy minute [busy_from, busy_from + 60 s): another job sharing the cores."""

    vocab_size = 100

    def __init__(self, clock: list[float], busy_from: float, busy: float) -> None:
        self.clock, self.busy_from, self.busy = clock, busy_from, busy

    def prefill(self, prompt_ids: list[int]) -> tuple[CacheState, None]:
        return CacheState(cache=None, length=len(prompt_ids)), None

    def forward(self, seq: CacheState, token_ids: list[int], **kwargs: object) -> None:
        quiet = 0.010 + 0.001 * len(token_ids)
        inside = self.busy_from <= self.clock[0] < self.busy_from + 60.0
        self.clock[0] += quiet * (self.busy if inside else 1.0)
        seq.length += len(token_ids)

    def rollback(self, seq: CacheState, length: int) -> None:
        seq.length = length


class RisingLoadBackend(BusyMinuteBackend):
    """Each pass a fifth slower than the one before."""

    passes = 0

    def forward(self, seq: CacheState, token_ids: list[int], **kwargs: object) -> None:
        self.passes += 1
        self.clock[0] += (0.010 + 0.001 * len(token_ids)) * (1.0 + 0.2 * self.passes)
        seq.length += len(token_ids)


QUIET = tuple(0.010 + 0.001 * n for n in range(1, 9))


def test_a_curve_measured_in_a_busy_minute_is_measured_again_and_the_quiet_one_kept(tmp_path, caplog) -> None:
    """The busy minute covers the first measurement's rounds but its last: each size's fastest
    repeat is quiet, yet the spread says the machine was busy, so it is measured again (the minute
    has passed) and the quiet curve is kept; a curve busy in every attempt is used, never kept."""
    clock = [0.0]

    def measure(backend: BusyMinuteBackend) -> ForwardCost:
        cost = cost_module.measure_forward_cost(backend, 8, context=4, repeats=3, timer=lambda: clock[0])  # type: ignore[arg-type]
        clock[0] += 30.0  # the next attempt starts half a minute later
        return cost

    caplog.set_level(logging.INFO, logger="leapdecode")
    backend = BusyMinuteBackend(clock, busy_from=-58.5, busy=6.0)  # busy until 1.5 s: two of three rounds
    store = CostStore(tmp_path, clock=lambda: 1000.0 + clock[0])
    cost, kept = store.curve(KEY, lambda: measure(backend), 8)
    assert not kept and cost.spread <= WIDE_SPREAD and cost.seconds == pytest.approx(QUIET)
    assert "machine was busy" in caplog.text
    assert CostStore(tmp_path, clock=lambda: 1000.0).get(KEY, 8).seconds == pytest.approx(QUIET)

    def rising_load() -> ForwardCost:  # a machine whose load only grows: each pass slower than the last
        backend = RisingLoadBackend(clock, busy_from=0.0, busy=1.0)
        return cost_module.measure_forward_cost(backend, 4, context=4, repeats=3, timer=lambda: clock[0])  # type: ignore[arg-type]

    other = CurveKey(KEY.what, "trees", 2)
    cost, kept = store.curve(other, rising_load, 4)
    assert cost.spread > WIDE_SPREAD and not kept and CostStore(tmp_path, clock=lambda: 1000.0).get(other) is None
    assert "not kept" in caplog.text


def test_a_kept_curve_past_its_age_is_measured_again(tmp_path) -> None:
    now = [0.0]
    store = CostStore(tmp_path, clock=lambda: now[0])
    store.put(KEY, ForwardCost((0.02, 0.03), 0.01))
    now[0] = MAX_AGE_S - 1
    assert store.get(KEY) == ForwardCost((0.02, 0.03), 0.01)
    now[0] = MAX_AGE_S + 1
    assert store.get(KEY) is None
    cost, kept = store.curve(KEY, lambda: ForwardCost((0.04, 0.05), 0.0))
    assert not kept and store.get(KEY) == ForwardCost((0.04, 0.05), 0.0)


def test_a_forgotten_curve_is_measured_again_and_clear_removes_them_all(tmp_path) -> None:
    store = CostStore(tmp_path)
    store.put(KEY, ForwardCost((0.02,), 0.0))
    store.put(CurveKey(KEY.what, "trees", 2), ForwardCost((0.03,), 0.0))
    store.forget(KEY)
    assert store.get(KEY) is None and len(store.kept()) == 1
    assert store.clear() == 1 and store.kept() == [] and not store.path.exists()


def test_costs_show_and_clear_from_the_command_line(tmp_path, monkeypatch) -> None:
    from typer.testing import CliRunner

    from leapdecode.cli import app

    monkeypatch.setenv("LEAPDECODE_HOME", str(tmp_path))
    default_store().put(KEY, ForwardCost((0.0123, 0.0456), 0.04))
    runner = CliRunner()
    shown = runner.invoke(app, ["costs", "show"], env={"COLUMNS": "240"})
    assert shown.exit_code == 0 and "chains" in shown.output and "12.30" in shown.output and "45.60" in shown.output
    cleared = runner.invoke(app, ["costs", "clear"])
    assert cleared.exit_code == 0 and "removed 1 curves" in cleared.output
    assert "no kept pass costs" in runner.invoke(app, ["costs", "show"]).output
