"""What many tests share: tiny randomly initialised models, scripted drafters, random prompts,
and the sampling harness (empirical distributions against exactly computed ones)."""

from __future__ import annotations

import random
from collections.abc import Sequence

import torch

from leapdecode.drafters import Draft, Drafter
from leapdecode.drafters.base import StreamDrafter
from leapdecode.engine.drafting import CALL_ORDER, Delegating
from leapdecode.verifiers import SamplingParams, logits_to_probs, verify_greedy, verify_tree_greedy

TINY_VOCAB = 96


def make_tiny_model(arch: str = "llama", seed: int = 0, vocab: int = TINY_VOCAB, layers: int = 2):
    """A small random model (2 layers unless told) with a peaked output distribution, so greedy
    choices are not near-ties."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    common = dict(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=0.3,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=1,
        tie_word_embeddings=False,
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


class ScriptedDrafter(StreamDrafter):
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


# The greedy verifiers, chain and tree, for tests that run the decode loop directly.
GREEDY = (verify_greedy, verify_tree_greedy)


def prompts(
    count: int,
    seed: int = 0,
    *,
    repetitive_every: int = 3,
    repetitive_len: tuple[int, int] = (8, 40),
    random_len: tuple[int, int] = (1, 30),
    repeats: int = 12,
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


def sample_sequences(
    model, prompt: list[int], params: SamplingParams, make_drafter, *, draws: int = 600, length: int = 3, seed: int = 0
) -> dict[tuple[int, ...], int]:
    """How often each `length`-token continuation comes out of `draws` sampled generations through
    the decode loop, with a fresh drafter from `make_drafter()` each time (chain and tree verifiers),
    each generation with its own seed (per-position noise: `leapdecode.engine.noise`)."""
    counts: dict[tuple[int, ...], int] = {}
    for i in range(draws):
        key = tuple(sampled_tokens(model, prompt, params, make_drafter(), seed * 1_000_003 + i, length))
        counts[key] = counts.get(key, 0) + 1
    return counts


def sampled_tokens(model, prompt: list[int], params: SamplingParams, drafter, seed: int, length: int) -> list[int]:
    """One sampled generation of `length` tokens through the decode loop with `drafter`."""
    return [t for s in sampled_steps(model, prompt, params, drafter, seed, length) for t in s.tokens]


def sampled_steps(model, prompt: list[int], params: SamplingParams, drafter, seed: int, length: int) -> list:
    """The decode loop's steps for one sampled generation with `drafter`."""
    import functools

    from leapdecode.engine import StopCriteria, TorchBackend, decode
    from leapdecode.engine.noise import PositionNoise
    from leapdecode.verifiers import verify_speculative, verify_tree_speculative

    noise = PositionNoise(seed)
    verifiers = (
        functools.partial(verify_speculative, params=params, noise=noise),
        functools.partial(verify_tree_speculative, params=params, noise=noise),
    )
    with torch.inference_mode():
        return list(decode(TorchBackend(model), prompt, drafter, StopCriteria(frozenset(), length), *verifiers))


def assert_sampled_like_plain(
    model, prompt: list[int], params: SamplingParams, make_drafter, seeds, length: int
) -> int:
    """For each seed, sampled output with `make_drafter()` equals plain sampling's (the slow
    reference: no cache, no draft) token for token. Returns how many tokens were drafted."""
    from leapdecode.engine.noise import PositionNoise
    from leapdecode.engine.reference import sample_reference

    drafted = 0
    for seed in seeds:
        expected = sample_reference(model, prompt, length, params, PositionNoise(seed))
        steps = sampled_steps(model, prompt, params, make_drafter(), seed, length)
        assert [t for s in steps for t in s.tokens] == expected, (seed, params)
        drafted += sum(len(s.drafted) for s in steps)
    return drafted


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


class CheckedDrafter(Delegating):
    """Wraps a drafter and fails on any call out of the legal order (`engine.drafting.CALL_ORDER`),
    or on a pass result that does not fit the offer it answers."""

    def __init__(self, inner: Drafter) -> None:
        super().__init__(inner)
        self.state = "new"
        self.calls: list[str] = []
        self.last_offer = None

    def _call(self, name: str) -> None:
        legal = CALL_ORDER[self.state]
        assert name in legal, f"{name} in state {self.state} (after {self.calls[-6:]}); legal: {sorted(legal)}"
        self.calls.append(name)
        self.state = legal[name]

    def start(self, request):
        self._call("start")
        super().start(request)

    def offer(self, context):
        self._call("offer")
        assert context.max_tokens >= 0 and context.batch >= 1, context
        offer = yield from self.inner.offer(context)  # the inner drafter's own rounds and reach
        self.last_offer = offer
        return offer

    def hear(self, result):
        self._call("hear")
        kept = list(result.kept)
        assert kept == sorted(set(kept)) and all(0 <= i < len(self.last_offer.draft) for i in kept), kept
        assert 0 <= result.accepted <= len(kept) and len(result.tokens) >= 1, result
        super().hear(result)

    def finish(self):
        self._call("finish")
        super().finish()


def start(
    drafter: Drafter, prompt: Sequence[int], first: Sequence[int] | None = None, budget: int | None = None
) -> None:
    """Start `drafter` on `prompt`, the prompt's pass having emitted `first` (None: not yet)."""
    from leapdecode.engine.drafting import PassResult, Request

    drafter.start(Request(list(prompt), budget, prefill=None if first is None else PassResult(list(first), 0)))


def offer_alone(drafter: Drafter, max_tokens: int, exact: int | None = None, batch: int = 1, cost=None):
    """The drafter's offer for a pass (of its own: `cost` None) and the part the scheduler keeps
    (`engine.pass_plan.offer_alone`; for passes of `batch` sequences costing `cost` by rows, the
    whole offer up to `exact`): (offer, kept, draft)."""
    from leapdecode.engine import pass_plan
    from leapdecode.engine.drafting import DraftContext

    limit = max_tokens if exact is None else min(max_tokens, exact)
    offer, kept = pass_plan.offer_alone(drafter, DraftContext(limit, batch, cost), exact)
    if cost is not None:
        kept = list(range(len(offer.draft) if exact is None else min(len(offer.draft), exact)))
    return offer, kept, offer.draft.subset(kept)


def draft_alone(drafter: Drafter, max_tokens: int, exact: int | None = None) -> Draft:
    """What a pass of the drafter's own scores of its draft (`offer_alone`); `hear_pass` answers it."""
    _, kept, draft = offer_alone(drafter, max_tokens, exact)
    drafter._test_kept = kept  # type: ignore[attr-defined]  # for `hear_pass`
    return draft


def hear_pass(
    drafter: Drafter, tokens: Sequence[int], accepted: int, kept: Sequence[int] | None = None, **result
) -> None:
    """Tell the drafter what the pass over its last draft emitted (`kept`: the offered tokens it
    scored; by default what `draft_alone` kept)."""
    from leapdecode.engine.drafting import PassResult

    last = drafter.__dict__.pop("_test_kept", ())
    kept = kept if kept is not None else last
    drafter.hear(PassResult(list(tokens), accepted, list(kept), **result))


def length_parameter(method) -> str:
    """The integer parameter a chain method's draft length is (one more of it drafts one more
    token), or "" when there is none."""
    import dataclasses

    from leapdecode.errors import MethodError

    for field in dataclasses.fields(method):
        if field.type not in (int, "int") or getattr(method, field.name) != method.draft_length:
            continue
        try:
            bigger = dataclasses.replace(method, **{field.name: getattr(method, field.name) + 1})
        except MethodError:  # a bound of that parameter
            continue
        if bigger.draft_length == method.draft_length + 1:
            return field.name
    return ""
