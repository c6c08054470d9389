"""Shared fixtures: tiny randomly initialised models (fast) and the real small model (CI too)."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest
import torch

from leapdecode.drafters import Draft, Drafter
from leapdecode.verifiers import SamplingParams, logits_to_probs, verify_greedy, verify_tree_greedy

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


class TinyTokenizer:
    """Enough of a tokenizer for token-id prompts on the tiny models."""

    pad_token_id = 0

    def __len__(self) -> int:
        return TINY_VOCAB

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return " ".join(map(str, ids))

    def get_vocab(self) -> dict[str, int]:
        return {str(i): i for i in range(TINY_VOCAB)}


def tiny_lm(model, name: str = "tiny"):
    """A tiny model as the API loads models: a `LoadedModel` with a token-id tokenizer."""
    from leapdecode.models import LoadedModel

    return LoadedModel(model=model, tokenizer=TinyTokenizer(), name=name, eos_token_ids=frozenset(), max_context=512)


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


# The greedy verifiers, chain and tree, for tests that run the decode loop directly.
GREEDY = (verify_greedy, verify_tree_greedy)


def prompts(
    count: int, seed: int = 0, *, repetitive_every: int = 3, repetitive_len: tuple[int, int] = (8, 40),
    random_len: tuple[int, int] = (1, 30), repeats: int = 12,
) -> list[list[int]]:
    """Random tiny-vocabulary prompts, and every `repetitive_every`-th one a short unit repeated,
    where n-gram drafts run long."""
    rng = random.Random(seed)
    out = []
    for i in range(count):
        if i % repetitive_every == 0:
            unit = [rng.randrange(2, TINY_VOCAB) for _ in range(rng.randint(2, 5))]
            out.append((unit * repeats)[: rng.randint(*repetitive_len)])
        else:
            out.append([rng.randrange(2, TINY_VOCAB) for _ in range(rng.randint(*random_len))])
    return out


# --- the sampling harness: empirical distributions against exactly computed ones ---------

def tv(a: torch.Tensor, b: torch.Tensor) -> float:
    return 0.5 * float((a - b).abs().sum())


def tv_bound(p: torch.Tensor, n: int) -> float:
    """A loose high-probability bound on TV(empirical of n draws, p): 4 standard deviations per cell."""
    return 0.5 * float((4 * (p * (1 - p) / n).sqrt()).sum()) + 1e-9


def assert_follows_exact(counts: dict[tuple[int, ...], int], exact: dict[tuple[int, ...], float], draws: int) -> None:
    """Sequences drawn `draws` times stay in the exact support, and their empirical distribution is
    within the TV bound of the exact one."""
    support = sorted(exact)
    assert set(counts) <= set(support)
    p = torch.tensor([exact[k] for k in support])
    emp = torch.tensor([counts.get(k, 0) / draws for k in support])
    assert tv(emp, p) <= tv_bound(p, draws), tv(emp, p)


def exact_joint(model, prompt: list[int], params: SamplingParams, length: int) -> dict[tuple[int, ...], float]:
    """The exact probability of every continuation of `length` tokens (support cut by top_k)."""
    out: dict[tuple[int, ...], float] = {(): 1.0}
    for _ in range(length):
        nxt = {}
        for prefix, prob in out.items():
            with torch.inference_mode():
                logits = model(input_ids=torch.tensor([prompt + list(prefix)])).logits[0, -1:]
            probs = logits_to_probs(logits, params)[0]
            for token in torch.nonzero(probs).flatten().tolist():
                nxt[prefix + (token,)] = prob * float(probs[token])
        out = nxt
    return out


def sample_sequences(model, prompt: list[int], params: SamplingParams, make_drafter, *, draws: int = 600, length: int = 3, seed: int = 0) -> dict[tuple[int, ...], int]:
    """How often each `length`-token continuation comes out of `draws` sampled generations through
    the decode loop, with a fresh drafter from `make_drafter()` each time (chain and tree verifiers)."""
    import functools

    from leapdecode.engine import StopCriteria, TorchBackend, decode
    from leapdecode.verifiers import verify_speculative, verify_tree_speculative

    g = torch.Generator().manual_seed(seed)
    verifiers = (functools.partial(verify_speculative, params=params, generator=g),
                 functools.partial(verify_tree_speculative, params=params, generator=g))
    counts: dict[tuple[int, ...], int] = {}
    for _ in range(draws):
        steps = list(decode(TorchBackend(model), prompt, make_drafter(), StopCriteria(frozenset(), length), *verifiers))
        key = tuple(t for s in steps for t in s.tokens)
        counts[key] = counts.get(key, 0) + 1
    return counts


def drafted_matching_plain(lm, decoder, prompts: list[str], max_new_tokens: int) -> int:
    """Each chat prompt through `decoder` and through plain decoding: the tokens must be equal.
    Returns how many tokens `decoder` drafted over all of them."""
    from leapdecode import wrap

    drafted = 0
    for prompt in prompts:
        plain = wrap(lm, "ar").generate(prompt, max_new_tokens=max_new_tokens, chat=True)
        fast = decoder.generate(prompt, max_new_tokens=max_new_tokens, chat=True)
        assert fast.token_ids == plain.token_ids, (str(decoder.method), prompt)
        drafted += sum(len(s.drafted) for s in fast.steps)
    return drafted
