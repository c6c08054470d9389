"""The method a model gets when none is named: its preset's draft model where installed, else
anpd; the choice and its reason said; `models pull` offering the draft model."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from leapdecode.cli import app
from leapdecode.methods.defaults import FALLBACK, default_method
from leapdecode.models import LoadedModel
from leapdecode.models.presets import Preset, get_preset


def _lm(preset: str) -> LoadedModel:
    return LoadedModel(
        model=object(),
        tokenizer=None,
        name=preset or "folder",
        eos_token_ids=frozenset(),
        max_context=64,
        preset=preset,
    )


def _without(monkeypatch: pytest.MonkeyPatch, missing: str) -> None:
    """Preset `missing` reads as not installed, every other as its packages say."""
    installed = Preset.installed
    monkeypatch.setattr(Preset, "installed", property(lambda p: p.name != missing and installed.fget(p)))


def test_a_preset_with_its_draft_model_installed_defaults_to_the_draft_path(monkeypatch) -> None:
    monkeypatch.setattr(Preset, "installed", property(lambda p: True))
    choice = default_method(_lm("qwen2.5-coder-1.5b"))
    assert choice.method == "draft:model=qwen2.5-coder-0.5b" and "installed" in choice.reason
    assert get_preset("qwen2.5-coder-1.5b").draft == "qwen2.5-coder-0.5b"


def test_without_the_draft_model_or_a_preset_the_default_is_anpd(monkeypatch) -> None:
    _without(monkeypatch, "qwen2.5-coder-0.5b")
    choice = default_method(_lm("qwen2.5-coder-1.5b"))
    assert choice.method == FALLBACK and "leapdecode models pull qwen2.5-coder-0.5b" in choice.reason
    assert default_method(_lm("")).method == FALLBACK
    assert default_method(_lm("smollm2-135m")).method == FALLBACK  # names no draft model


def test_generate_without_a_method_says_what_it_chose() -> None:
    result = CliRunner().invoke(app, ["generate", "-n", "4", "def add(a, b):"])
    assert result.exit_code == 0, result.output
    assert "method: anpd (preset smollm2-135m names no draft model)" in result.output


def test_pulling_a_preset_offers_its_draft_model_unless_installed(monkeypatch) -> None:
    _without(monkeypatch, "qwen2.5-coder-0.5b")
    pulled: list[str] = []
    monkeypatch.setattr("leapdecode.models.pull", lambda name, cache, log: pulled.append(name) or name)
    result = CliRunner().invoke(app, ["models", "pull", "qwen2.5-coder-1.5b", "--no-load"])
    assert result.exit_code == 0, result.output
    assert pulled == ["qwen2.5-coder-1.5b"] and "leapdecode models pull qwen2.5-coder-0.5b" in result.output
    pulled.clear()
    result = CliRunner().invoke(app, ["models", "pull", "qwen2.5-coder-1.5b", "--no-load", "--with-draft"])
    assert result.exit_code == 0, result.output
    assert pulled == ["qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"] and "models pull" not in result.output
