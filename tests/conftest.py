"""Shared fixtures: tiny randomly initialised models (fast) and the real small model (CI too)."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest
import torch

from leapdecode.drafters import Draft, Drafter

TINY_VOCAB = 96


def make_tiny_model(arch: str = "llama", seed: int = 0, vocab: int = TINY_VOCAB, layers: int = 2):
    """A small random model (2 layers unless told) with a peaked output distribution, so greedy choices are not near-ties."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    common = dict(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        initializer_range=0.3, bos_token_id=0, eos_token_id=1, pad_token_id=1, tie_word_embeddings=False,
    )
    config = LlamaConfig(**common) if arch == "llama" else Qwen2Config(**common)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.eval()
    return model


@pytest.fixture(scope="session", params=["llama", "qwen2"])
def tiny_model(request):
    return make_tiny_model(request.param)


class ScriptedDrafter(Drafter):
    """Drafts from a known continuation: right, wrong, or right with some tokens corrupted.

    `reference` is the greedy continuation after the prompt; `wrong_every` corrupts every
    j-th drafted token (1: all wrong, 0: all right).
    """

    def __init__(self, reference: Sequence[int], k: int, vocab: int, wrong_every: int = 0, seed: int = 0) -> None:
        self.reference = list(reference)
        self.k = k
        self.vocab = vocab
        self.wrong_every = wrong_every
        self.rng = random.Random(seed)
        self.emitted = 0

    def reset(self, prompt_ids: Sequence[int]) -> None:
        self.emitted = 0

    def update(self, tokens: Sequence[int], num_accepted: int) -> None:
        self.emitted += len(tokens)

    def propose(self, max_tokens: int) -> Draft:
        # Vary the draft length too, so that every acceptance length is exercised.
        length = min(self.rng.randint(0, self.k), max_tokens)
        draft = []
        for i in range(length):
            pos = self.emitted + i
            token = self.reference[pos] if pos < len(self.reference) else self.rng.randrange(self.vocab)
            if self.wrong_every and (i + 1) % self.wrong_every == 0:
                token = (token + 1) % self.vocab
            draft.append(token)
        return Draft(draft)


@pytest.fixture(scope="session")
def real_lm():
    """The real `smollm2-135m` (pulled by `.ci/run` before the tests; pulled here if missing)."""
    from leapdecode.models import load_model

    return load_model("smollm2-135m", log=lambda msg: None)
