"""The SuffixDecoding peer (arctic-inference's own code drafting in our engine): greedy decoding
with its drafts equals plain decoding, and a clear error without the package. The package is
built by `make peers`, which `make test` runs."""

from __future__ import annotations

import sys

import pytest

from leapdecode import wrap
from leapdecode.errors import MethodError
from tests.helpers import prompts, tiny_lm

pytest.importorskip("arctic_inference.suffix_decoding", reason="built by `make peers` (part of `make test`)")
pytestmark = pytest.mark.peers


@pytest.mark.parametrize("method", ["arctic-suffix", "arctic-suffix:tree=false,factor=2", "arctic-suffix:shared=true"])
def test_greedy_with_arctic_drafts_is_plain_decoding(tiny_model, method) -> None:
    lm = tiny_lm(tiny_model)
    decoder, plain = wrap(lm, method), wrap(lm, "ar")
    accepted = 0
    for prompt in prompts(8, seed=9):
        fast = decoder.generate(prompt, max_new_tokens=32)
        assert fast.token_ids == plain.generate(prompt, max_new_tokens=32).token_ids
        accepted += fast.stats.accepted_tokens
    assert accepted > 0


def test_arctic_peer_on_the_real_model_is_plain_decoding(real_lm) -> None:
    prompt = "Repeat this sentence twice: the quick brown fox jumps over the lazy dog."
    plain = wrap(real_lm, "ar").generate(prompt, max_new_tokens=40, chat=True)
    fast = wrap(real_lm, "arctic-suffix").generate(prompt, max_new_tokens=40, chat=True)
    assert fast.token_ids == plain.token_ids and fast.stats.drafted_tokens > 0


def test_without_the_package_the_error_says_how_to_build_it(real_lm, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "arctic_inference.suffix_decoding", None)
    with pytest.raises(MethodError, match="make peers"):
        wrap(real_lm, "arctic-suffix")
