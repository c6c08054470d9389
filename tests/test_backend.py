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


def test_prefill_scores_only_the_last_position_and_forward_can_return_layer_states(tiny_model) -> None:
    backend = TorchBackend(tiny_model)
    seq, scores = backend.prefill([5, 6, 7, 8])
    assert scores.logits.shape == (1, backend.vocab_size)
    out = backend.forward(seq, [9, 10], features=(1, 2))
    assert out.logits.shape == (2, backend.vocab_size)
    assert out.features.shape == (2, 2 * tiny_model.config.hidden_size)


def test_the_cache_appends_in_place_and_grows_past_its_capacity(tiny_model) -> None:
    """Decode steps write into one buffer per layer (no copy of the context each step), rollbacks
    only narrow the views, and growing past the buffer keeps every entry: after 300 steps with
    rollbacks the logits equal a fresh computation of the same sequence."""
    backend = TorchBackend(tiny_model)
    prompt = [4, 8, 15, 16, 23, 42]
    seq, _ = backend.prefill(prompt)
    layer = seq.cache.layers[0]
    buffer = layer.keys.data_ptr()
    sequence = list(prompt)
    for step in range(300):
        drafted = [(step * 7 + i) % 50 + 2 for i in range(3)]
        backend.forward(seq, drafted)
        keep = step % 4
        backend.rollback(seq, len(sequence) + min(keep, 3))
        sequence += drafted[: min(keep, 3)]
        if step == 10:
            assert layer.keys.data_ptr() == buffer  # still the first buffer: appended in place
    assert layer.keys.data_ptr() != buffer  # it grew (the first buffer held 256 more than the prompt)
    assert seq.cache.get_seq_length() == seq.length == len(sequence)
    scores = backend.forward(seq, [30, 31])
    expected = full_logits(tiny_model, sequence + [30, 31])[-2:]
    torch.testing.assert_close(scores.logits, expected, rtol=1e-4, atol=1e-4)


def test_the_cache_goes_under_the_name_the_model_takes() -> None:
    """transformers 5.24 renamed `past_key_values` to `cache` (the old name warns): the backend
    passes whichever the model's forward has, so no call of ours is deprecated."""
    from leapdecode.engine.backend import cache_argument
    from tests.helpers import make_tiny_model

    def old(input_ids=None, past_key_values=None, use_cache=None):  # noqa: ANN001, ANN202
        return None

    def new(input_ids=None, cache=None, use_cache=None):  # noqa: ANN001, ANN202
        return None

    assert cache_argument(old) == "past_key_values" and cache_argument(new) == "cache"
    model = make_tiny_model()
    import transformers
    from packaging.version import Version

    expected = "cache" if Version(transformers.__version__) >= Version("5.24") else "past_key_values"
    assert cache_argument(model.forward) == expected == cache_argument(model.model.layers[0].forward)
