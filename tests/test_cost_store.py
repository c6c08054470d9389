"""Measured pass costs kept on disk (`engine.cost_store`), and the draft model's int4 rounding kept
in the cache: what a decoder measures or computes at load, done once per machine and model."""

from __future__ import annotations

import pytest
import torch

from leapdecode import wrap
from leapdecode.api import Decoder
from leapdecode.engine import cost_measure as cost_module
from leapdecode.engine.cost_store import CostStore, CurveKey, default_store
from leapdecode.methods import parse_method
from leapdecode.models.quantize import QuantizedLinear
from tests.helpers import make_tiny_model, tiny_lm

KEY = CurveKey("model abc torch int4 TorchBackend", "chains", 2)


def test_a_kept_curve_is_read_back_by_another_store_and_measured_once(tmp_path) -> None:
    measured: list[int] = []

    def measure() -> tuple[float, ...]:
        measured.append(1)
        return (0.02, 0.021, 0.03)

    first, kept_before = CostStore(tmp_path).curve(KEY, measure, 3)
    second, kept = CostStore(tmp_path).curve(KEY, measure, 3)  # a later process
    assert first == second == (0.02, 0.021, 0.03) and not kept_before and kept and measured == [1]
    # a longer need than the kept curve, other threads, another kind: each measured afresh
    CostStore(tmp_path).curve(KEY, measure, 4)
    CostStore(tmp_path).curve(CurveKey(KEY.what, KEY.kind, 1), measure, 3)
    CostStore(tmp_path).curve(CurveKey(KEY.what, "trees", 2), measure, 3)
    assert len(measured) == 4
    assert CostStore(tmp_path).get(CurveKey(KEY.what, "trees", 2)) == (0.02, 0.021, 0.03)


@pytest.mark.parametrize(
    "content", ["{not json", "[1, 2]", '{"model abc torch int4 TorchBackend|chains|2": {"seconds": [0.1, -1]}}']
)
def test_a_file_that_cannot_be_read_is_measured_again_and_rewritten(tmp_path, content) -> None:
    store = CostStore(tmp_path)
    store.path.write_text(content)
    assert store.get(KEY) is None
    seconds, kept = store.curve(KEY, lambda: (0.5,))
    assert seconds == (0.5,) and not kept and CostStore(tmp_path).get(KEY) == (0.5,)


def test_a_store_that_cannot_write_still_gives_the_measured_curve(tmp_path, caplog) -> None:
    blocked = tmp_path / "a file"
    blocked.write_text("")
    store = CostStore(blocked / "costs")  # its folder cannot be made
    seconds, kept = store.curve(KEY, lambda: (0.5, 0.6))
    assert seconds == (0.5, 0.6) and not kept and "could not keep" in caplog.text


def test_a_later_decoder_reads_the_target_curve_measured_by_an_earlier_one(monkeypatch) -> None:
    calls: list[int] = []
    measure = cost_module.measure_forward_cost

    def counted(*args, **kwargs):
        calls.append(1)
        return measure(*args, **kwargs)

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

        def counted(*args, _original=original, _name=name, **kwargs):
            calls.append(_name)
            return _original(*args, **kwargs)

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
