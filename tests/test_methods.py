"""Method strings: one factory, frozen dataclasses, clear errors."""

from __future__ import annotations

import dataclasses

import pytest

from leapdecode.errors import MethodError
from leapdecode.methods import Anpd, Autoregressive, HfAssisted, HfPromptLookup, PromptLookup, parse_method


def test_parse_defaults_and_parameters() -> None:
    assert parse_method("ar") == Autoregressive()
    assert parse_method("anpd") == Anpd(n=5, k=7)
    assert parse_method("anpd:n=4,k=9") == Anpd(n=4, k=9)
    assert parse_method(" ANPD : k=3 ") == Anpd(n=5, k=3)
    assert parse_method("pld:k=5,max_ngram=4") == PromptLookup(k=5, max_ngram=4)
    assert parse_method("hf-pld:tokens=10") == HfPromptLookup(tokens=10)
    assert parse_method("hf-assisted:model=qwen2.5-coder-0.5b") == HfAssisted(model="qwen2.5-coder-0.5b")


def test_round_trip_through_the_canonical_string() -> None:
    for text in ("ar", "anpd:n=3,k=2", "pld:k=4,max_ngram=2,min_ngram=1", "hf-pld:tokens=5,max_ngram=2"):
        method = parse_method(text)
        assert parse_method(str(method)) == method


def test_methods_are_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        parse_method("anpd").k = 3  # type: ignore[misc]


@pytest.mark.parametrize(
    "text, fragment",
    [
        ("anpd:n=1", "n must be >= 2"),
        ("anpd:k=0", "k must be >= 1"),
        ("anpd:k=-3", "k must be >= 1"),
        ("anpd:n=five", "must be int"),
        ("anpd:q=3", "unknown parameter 'q'"),
        ("anpd:n", "name=value"),
        ("anpd:n=3,n=4", "given twice"),
        ("hydra", "unknown method 'hydra'"),
        ("medusa:depth=0", "depth must be between 1 and 16"),
        ("eagle3:min_prob=1.5", "min_prob must be in"),
        ("", "unknown method"),
        ("pld:min_ngram=3,max_ngram=2", "min_ngram <= max_ngram"),
        ("hf-assisted", "needs model="),
    ],
)
def test_bad_method_strings_say_what_is_wrong(text: str, fragment: str) -> None:
    with pytest.raises(MethodError, match=fragment.replace("(", r"\(")):
        parse_method(text)


def test_unknown_method_lists_the_known_ones() -> None:
    with pytest.raises(MethodError) as info:
        parse_method("nope")
    for name in ("ar", "anpd", "pld", "hf", "hf-pld"):
        assert f"  {name} " in str(info.value)
