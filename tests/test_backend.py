"""KV-cache rollback: the one operation by which a cache shrinks."""

from __future__ import annotations

import pytest
import torch

from leapdecode.engine import TorchBackend


def full_logits(model, ids):
    with torch.inference_mode():
        return model(input_ids=torch.tensor([ids]), use_cache=False).logits[0]


@pytest.mark.parametrize("keep", [0, 1, 3, 5])
def test_rollback_after_partial_acceptance_matches_a_fresh_computation(tiny_model, keep) -> None:
    backend = TorchBackend(tiny_model)
    prompt = [4, 8, 15, 16, 23, 42]
    seq, _ = backend.prefill(prompt)
    drafted = [7, 7, 9, 11, 13]
    backend.forward(seq, drafted)
    assert seq.length == len(prompt) + 5
    backend.rollback(seq, len(prompt) + keep)
    assert seq.length == len(prompt) + keep == seq.cache.get_seq_length()
    follow = [30, 31, 32]
    scores = backend.forward(seq, follow)
    expected = full_logits(tiny_model, prompt + drafted[:keep] + follow)[-3:]
    torch.testing.assert_close(scores.logits, expected, rtol=1e-4, atol=1e-4)


def test_rollback_refuses_to_grow_or_go_negative(tiny_model) -> None:
    backend = TorchBackend(tiny_model)
    seq, _ = backend.prefill([1, 2, 3])
    with pytest.raises(ValueError):
        backend.rollback(seq, 4)
    with pytest.raises(ValueError):
        backend.rollback(seq, -1)
    assert seq.length == 3


def test_prefill_scores_only_the_last_position_and_forward_can_return_hidden_states(tiny_model) -> None:
    backend = TorchBackend(tiny_model)
    seq, scores = backend.prefill([5, 6, 7, 8])
    assert scores.logits.shape == (1, backend.vocab_size)
    out = backend.forward(seq, [9, 10], hidden=True)
    assert out.logits.shape == (2, backend.vocab_size)
    assert out.hidden.shape == (2, tiny_model.config.hidden_size)
