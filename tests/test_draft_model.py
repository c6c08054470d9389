"""Draft-model speculative decoding: greedy equality with plain decoding (a draft model that is
the target itself, a random one, and the real Qwen pair), the vertical cascade, adaptive draft
length, the target distribution under sampling, reproducible seeds, and vocabulary checks."""

from __future__ import annotations

import copy
import functools

import pytest
import torch

from leapdecode import wrap
from leapdecode.drafters import DraftModelDrafter
from leapdecode.engine import StopCriteria, TorchBackend, decode
from leapdecode.engine.cost import ForwardCost
from leapdecode.engine.noise import PositionNoise
from leapdecode.engine.reference import greedy_reference, sample_reference
from leapdecode.engine.scheduler import BatchScheduler
from leapdecode.engine.submission import Submission
from leapdecode.errors import InputError, MethodError, ModelLoadError
from leapdecode.methods import DraftModel, parse_method
from leapdecode.models import LoadedModel
from leapdecode.verifiers import SamplingParams, verify_speculative
from tests.helpers import (
    GREEDY,
    TINY_VOCAB,
    assert_follows_exact,
    draft_alone,
    exact_joint,
    hear_pass,
    make_tiny_model,
    offer_alone,
    prompts,
    sampled_tokens,
    start,
    tiny_lm,
)

VARIANTS = [
    dict(k=4),
    dict(k=1),
    dict(k=6, cascade_n=5),
    dict(k=3, schedule="heuristic"),
    dict(k=5, threshold=0.3),
    dict(k=5, schedule="heuristic", threshold=0.2, cascade_n=3),
    dict(k=4, window=10),
]
IDS = ["k4", "k1", "cascade", "heuristic", "threshold", "all-options", "window"]


@pytest.fixture(scope="module")
def random_draft():
    """Same architecture and vocabulary as the llama tiny target, other weights: mostly rejected."""
    return make_tiny_model("llama", seed=1)


def run(target, draft, prompt, max_new_tokens, **options):
    drafter = DraftModelDrafter(TorchBackend(draft), **options)
    steps = list(decode(TorchBackend(target), prompt, drafter, StopCriteria(frozenset(), max_new_tokens), *GREEDY))
    return [t for s in steps for t in s.tokens], steps, drafter


@pytest.mark.parametrize("options", VARIANTS, ids=IDS)
def test_target_as_its_own_draft_model_accepts_every_draft(tiny_model, options) -> None:
    for prompt in prompts(6):
        got, steps, _ = run(tiny_model, tiny_model, prompt, 30, **options)
        assert got == greedy_reference(tiny_model, prompt, 30)
        drafted = sum(len(s.drafted) for s in steps)
        # a windowed draft model reads less of a long context than the target (at its first pass:
        # the prompt and the token its prefill emitted): not every draft holds
        exact = "window" not in options or len(prompt) + 1 <= options["window"]
        assert drafted > 0 and (sum(s.num_accepted for s in steps) == drafted or not exact)


@pytest.mark.parametrize("options", VARIANTS, ids=IDS)
def test_random_draft_model_is_still_lossless(random_draft, options) -> None:
    target = make_tiny_model("llama", seed=0)
    accepted = drafted = 0
    for prompt in prompts(8, seed=3):
        got, steps, _ = run(target, random_draft, prompt, 30, **options)
        assert got == greedy_reference(target, prompt, 30), prompt
        accepted += sum(s.num_accepted for s in steps)
        drafted += sum(len(s.drafted) for s in steps)
    assert drafted > 0 and accepted < drafted  # drafts were really rejected, and recovered from


def test_without_cascade_each_drafted_token_costs_one_draft_pass(tiny_model) -> None:
    _, steps, drafter = run(tiny_model, tiny_model, prompts(1)[0], 30, k=4)
    assert drafter.draft_passes == sum(len(s.drafted) for s in steps)


def test_cascade_drafts_several_tokens_per_draft_pass_on_repetitive_text(tiny_model) -> None:
    passes = {}
    for cascade_n in (0, 4):
        prompt = [5, 6, 7, 8, 9, 10] * 6
        got, steps, drafter = run(tiny_model, tiny_model, prompt, 60, k=8, cascade_n=cascade_n)
        assert got == greedy_reference(tiny_model, prompt, 60)
        passes[cascade_n] = drafter.draft_passes
    assert passes[4] < passes[0]


def test_heuristic_schedule_grows_after_full_acceptance_and_shrinks_after_rejection(tiny_model, random_draft) -> None:
    prompt = prompts(1)[0]
    _, steps, _ = run(tiny_model, tiny_model, prompt, 40, k=2, schedule="heuristic")
    lengths = [len(s.drafted) for s in steps[1:]]
    assert lengths[:3] == [2, 4, 6]  # every draft accepted: +2 each time
    target = make_tiny_model("llama", seed=0)
    _, steps, _ = run(target, random_draft, prompts(3, seed=5)[1], 30, k=3, schedule="heuristic")
    for before, after in zip(steps[1:], steps[2:]):
        if before.drafted and before.num_accepted < len(before.drafted) and after.drafted:
            assert len(after.drafted) == max(1, len(before.drafted) - 1) or len(after.drafted) < len(before.drafted)


def test_threshold_stops_the_draft_after_a_doubtful_token(random_draft) -> None:
    target = make_tiny_model("llama", seed=0)
    _, steps, _ = run(target, random_draft, prompts(2, seed=7)[1], 30, k=8, threshold=0.99)
    lengths = [len(s.drafted) for s in steps[1:]]
    assert max(lengths) < 8  # a random draft model is rarely 99% sure


def _noisy_copy(model, scale: float = 1.0):
    """q close to p but not equal: the model with noise on its output layer."""
    draft = copy.deepcopy(model)
    with torch.no_grad():
        head = draft.get_output_embeddings().weight
        head.add_(torch.randn(head.shape, generator=torch.Generator().manual_seed(2)) * head.std() * scale)
    return draft


@pytest.mark.slow  # a distribution test: thousands of sampled draws
@pytest.mark.parametrize("coupled", [True, False])
def test_draft_model_sampling_keeps_the_target_distribution(tiny_model, coupled: bool) -> None:
    draft = _noisy_copy(tiny_model)
    prompt = list(range(2, TINY_VOCAB)) + [7, 8, 9]
    params = SamplingParams(temperature=1.5, top_k=3)
    exact = exact_joint(tiny_model, prompt, params, 3)
    counts: dict[tuple[int, ...], int] = {}
    draws = 600
    accepted = drafted = 0
    for i in range(draws):
        noise = PositionNoise(11_000 + i)
        verifier = functools.partial(verify_speculative, params=params, noise=noise)
        drafter = DraftModelDrafter(
            TorchBackend(draft), k=3, sampling=params, noise=noise, coupled=coupled, cascade_n=3 if i % 2 else 0
        )
        steps = list(
            decode(TorchBackend(tiny_model), prompt, drafter, StopCriteria(frozenset(), 3), verifier, GREEDY[1])
        )
        key = tuple(t for s in steps for t in s.tokens)
        counts[key] = counts.get(key, 0) + 1
        accepted += sum(s.num_accepted for s in steps)
        drafted += sum(len(s.drafted) for s in steps)
    assert_follows_exact(counts, exact, draws)
    assert drafted > 0 and 0 < accepted < drafted


def test_coupled_draft_model_sampling_equals_plain_sampling(tiny_model) -> None:
    """Coupled, the draft model chooses with the target's own uniforms: the text is plain
    sampling's with the same seed, token for token (with and without the cascade)."""
    draft = _noisy_copy(tiny_model, 0.5)
    for i, prompt in enumerate(prompts(3, seed=31)):
        params = SamplingParams(0.8, top_k=8) if i % 2 else SamplingParams(1.0, top_p=0.9)
        for seed in range(40 * i, 40 * i + 2):  # the drafter shares the request's noise: one per seed
            expected = sample_reference(tiny_model, prompt, 20, params, PositionNoise(seed))
            drafter = DraftModelDrafter(
                TorchBackend(draft),
                k=4,
                sampling=params,
                noise=PositionNoise(seed),
                coupled=True,
                cascade_n=3 * (i % 2),
            )
            assert sampled_tokens(tiny_model, prompt, params, drafter, seed, 20) == expected


def test_sampled_drafts_carry_q_rows_of_the_draft_distribution(tiny_model) -> None:
    params = SamplingParams(temperature=0.8, top_p=0.9)
    drafter = DraftModelDrafter(TorchBackend(tiny_model), k=4, sampling=params, noise=PositionNoise(0), coupled=False)
    start(drafter, [3, 4, 5])
    with torch.inference_mode():
        draft = draft_alone(drafter, 10)
    assert draft.q is not None and draft.q.shape == (4, TINY_VOCAB)
    torch.testing.assert_close(draft.q.sum(-1), torch.ones(4))
    assert all(float(draft.q[i, t]) > 0 for i, t in enumerate(draft.tokens))


def whole_offer(drafter, max_tokens: int, batch: int = 1, cost=None):
    """The drafter's whole offer, before any cut: its rounds run alone (`cost` None: for a pass of
    its own; else for passes of `batch` sequences whose rows cost `cost`)."""
    return offer_alone(drafter, max_tokens, batch=batch, cost=cost)[0]


def tiny_loaded(model, name: str) -> LoadedModel:
    return LoadedModel(model=model, tokenizer=None, name=name, eos_token_ids=frozenset({1}), max_context=512)


def test_a_draft_model_with_another_vocabulary_is_refused(tiny_model) -> None:
    other = make_tiny_model("llama", seed=0, vocab=TINY_VOCAB + 8)
    with pytest.raises(ModelLoadError, match="share the target's tokenizer"):
        DraftModel(k=3).prepare(tiny_loaded(tiny_model, "target"), draft_model=tiny_loaded(other, "draft"))


def test_draft_method_parameters_are_validated() -> None:
    assert str(parse_method("draft:model=qwen2.5-coder-0.5b,k=5,cascade=true")) == (
        "draft:model=qwen2.5-coder-0.5b,k=5,schedule=constant,threshold=0.0,cascade=True,coupled=True,precision=int4,vocab=32768,lean=True,"
        "cost_aware=True,live_cost=True,suffix=True,suffix_k=16,suffix_min=1,suffix_tree=True,window=128,prefix_cache=8192"
    )
    for bad in (
        "draft:k=0",
        "draft:suffix_k=0",
        "draft:suffix_min=17",
        "draft:schedule=sometimes",
        "draft:threshold=1.5",
        "draft:cascade=maybe",
        "draft:precision=fp8",
        "draft:vocab=100",
        "draft:vocab=-1",
        "draft:prefix_cache=-1",
    ):
        with pytest.raises(MethodError):
            parse_method(bad)
    with pytest.raises(MethodError, match="needs model=NAME"):
        DraftModel(k=3).prepare(tiny_loaded(make_tiny_model(), "target"))


@pytest.mark.real_model
def test_real_model_as_its_own_draft_greedy_and_seeded(real_lm) -> None:
    prompt = "def is_palindrome(s):\n"
    plain = wrap(real_lm, "ar").generate(prompt, max_new_tokens=24)
    decoder = wrap(real_lm, "draft:k=4,cascade=true", draft_model=real_lm)
    out = decoder.generate(prompt, max_new_tokens=24)
    assert out.token_ids == plain.token_ids
    assert out.stats.accepted_tokens == out.stats.drafted_tokens > 0
    first = decoder.generate(prompt, max_new_tokens=16, temperature=0.9, top_p=0.95, seed=3)
    second = decoder.generate(prompt, max_new_tokens=16, temperature=0.9, top_p=0.95, seed=3)
    assert first.token_ids == second.token_ids


@pytest.mark.real_model
def test_real_qwen_pair_greedy_equals_plain_decoding(monkeypatch, tmp_path) -> None:
    from leapdecode.api import Decoder
    from leapdecode.heads import vocabulary
    from leapdecode.models import load_model

    monkeypatch.setattr(vocabulary, "ranking_path", lambda cache, tokenizer: tmp_path / "none counted here.json")

    target = load_model("qwen2.5-coder-1.5b", log=lambda msg: None)
    draft = load_model("qwen2.5-coder-0.5b", log=lambda msg: None)
    prompts_ = ['def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n', "Write a haiku about the sea."]
    # the pair as loaded, drafting every step (the cost cut's decisions follow the machine's timings)
    decoders = {m: wrap(target, m, draft_model=draft) for m in ("draft:k=5,cost_aware=false", "draft:k=5,cascade=true")}
    # the draft's own cheapest path: int4 rounded from its float weights, a 32,768-token draft
    # vocabulary, the cost cut (with a slow cost curve, it may draft or not at any step), and the
    # same path drafting every step (the cut's decisions follow the machine's timings)
    lines: list[str] = []
    decoders["default path"] = Decoder(target, "draft:model=qwen2.5-coder-0.5b,k=5", log=lines.append)
    # a fresh machine's default path drafts from the ranking shipped for the presets' tokenizer
    assert any(
        line.startswith("draft vocabulary: 32768 of 151936 tokens (counted on qwen2.5-coder-1.5b") for line in lines
    )
    decoders["default path, uncut"] = wrap(target, "draft:model=qwen2.5-coder-0.5b,k=5,cost_aware=false")
    # a window shorter than the prompts: the draft model reads their first 4 and last 12 tokens
    decoders["windowed, uncut"] = wrap(target, "draft:model=qwen2.5-coder-0.5b,k=5,cost_aware=false,window=16")
    plain = wrap(target, "ar")
    expected = []
    for prompt, chat in zip(prompts_, (False, True)):
        expected.append(plain.generate(prompt, max_new_tokens=20, chat=chat).token_ids)
        for method, decoder in decoders.items():
            out = decoder.generate(prompt, max_new_tokens=20, chat=chat)
            assert out.token_ids == expected[-1], (method, prompt)
            assert out.stats.accepted_tokens > 0 or method == "default path", (method, prompt)
    # both prompts at once on the default path, drafting every step: the draft model drafts for
    # both in shared passes
    uncut = decoders["default path, uncut"]
    runs = [uncut.start(p, max_new_tokens=20, chat=c) for p, c in zip(prompts_, (False, True))]
    backend = runs[0].drafter.needs.draft_backend
    assert backend is not None and backend.batchable is None
    packed: list[int] = []
    score_packed = backend.score_packed
    backend.score_packed = lambda *args: packed.append(len(args[3].items)) or score_packed(*args)
    scheduler = BatchScheduler(plain.backend, ForwardCost(tuple(0.07 for _ in range(64))), max_batch=2, max_rows=32)
    outputs: list[list[int]] = [[], []]
    for i, run in enumerate(runs):
        scheduler.submit(Submission(run, lambda s, i=i: outputs[i].extend(s.tokens), lambda r: None))
    while not scheduler.idle:
        scheduler.step()
    assert outputs == expected and packed and max(packed) == 2


# A draft model on its cheapest path: int4 whatever its weights, and an output layer cut to a
# draft vocabulary. Its numerics never reach the output: every variant decodes as plain decoding.
HALF = tuple(range(0, TINY_VOCAB, 2)) + (1, 3, 5, 7)  # 52 of the 96 tokens


def int4_copy(model):
    from leapdecode.models.quantize import quantize_model

    draft = copy.deepcopy(model)
    quantize_model(draft, "int4")
    return draft


def test_a_draft_vocabulary_scores_its_rows_as_the_whole_head_does_and_nothing_else(tiny_model) -> None:
    from leapdecode.engine.draft_head import DraftHeadBackend

    trimmed, whole = DraftHeadBackend(tiny_model, HALF), TorchBackend(tiny_model)
    prompt = prompts(1, seed=4)[0]
    with torch.inference_mode():
        (seq_t, first_t), (seq_w, first_w) = trimmed.prefill(prompt), whole.prefill(prompt)
        rows_t, rows_w = trimmed.forward(seq_t, [5, 6, 7]), whole.forward(seq_w, [5, 6, 7])
    ids = torch.tensor(sorted(set(HALF)))
    outside = torch.ones(TINY_VOCAB, dtype=torch.bool)
    outside[ids] = False
    for got, full in ((first_t.logits, first_w.logits), (rows_t.logits, rows_w.logits)):
        assert got.shape == full.shape
        torch.testing.assert_close(got[:, ids], full[:, ids], rtol=1e-5, atol=1e-5)
        assert torch.isneginf(got[:, outside]).all()


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("form", ["super-blocks", "per group"])
def test_a_quantized_heads_draft_vocabulary_keeps_its_rows_records_bitwise(bits, form) -> None:
    """The cut head holds the kept rows' own records (no second rounding): each of its outputs is
    bitwise that row of the whole head's."""
    from types import SimpleNamespace

    from leapdecode.engine.draft_head import trimmed_head
    from leapdecode.models.quantize import QuantizedLinear
    from leapdecode.models.rounding import quantize_weight

    g = torch.Generator().manual_seed(bits)
    weight, bias = torch.randn(TINY_VOCAB, 64, generator=g), torch.randn(TINY_VOCAB, generator=g)
    if form == "super-blocks":
        head = QuantizedLinear.from_weight(weight, bits, bias)
    else:
        head = QuantizedLinear.from_groups(*quantize_weight(weight, bits), bits, bias)
    ids = torch.tensor(sorted(set(HALF)))
    cut = trimmed_head(SimpleNamespace(get_output_embeddings=lambda: head), ids)
    assert isinstance(cut, QuantizedLinear) and cut.super_blocks == head.super_blocks and cut.bits == bits
    x = torch.randn(3, 64, generator=g)
    assert torch.equal(cut(x), head(x)[:, ids])


@pytest.mark.parametrize(
    "make_draft",
    [lambda m: m, lambda m: make_tiny_model("llama", seed=1), int4_copy],
    ids=["itself", "random", "itself-int4"],
)
@pytest.mark.parametrize(
    "options", [dict(k=4), dict(k=6, cascade_n=3), dict(k=5, threshold=0.3)], ids=["k4", "cascade", "threshold"]
)
def test_an_int4_or_vocabulary_cut_draft_model_decodes_as_plain_greedy(tiny_model, make_draft, options) -> None:
    from leapdecode.engine.draft_head import DraftHeadBackend

    draft = make_draft(tiny_model)
    for vocab in (HALF, tuple(range(TINY_VOCAB))):
        drafted = 0
        for prompt in prompts(4, seed=9):
            drafter = DraftModelDrafter(DraftHeadBackend(draft, vocab), **options)
            steps = list(decode(TorchBackend(tiny_model), prompt, drafter, StopCriteria(frozenset(), 30), *GREEDY))
            assert [t for s in steps for t in s.tokens] == greedy_reference(tiny_model, prompt, 30), (vocab, prompt)
            assert all(t in vocab for s in steps for t in s.drafted)  # the draft proposes nothing outside it
            drafted += sum(len(s.drafted) for s in steps)
        assert drafted > 0


@pytest.mark.slow  # a distribution test: thousands of sampled draws
def test_a_vocabulary_cut_draft_model_samples_as_plain_sampling(tiny_model) -> None:
    """Coupled: plain sampling's text, seed for seed. Uncoupled (min(1, p/q)): the target
    distribution, with q's support narrowed to the draft vocabulary."""
    from leapdecode.engine.draft_head import DraftHeadBackend

    draft = int4_copy(_noisy_copy(tiny_model, 0.5))
    for i, prompt in enumerate(prompts(2, seed=33)):
        params = SamplingParams(0.8, top_k=8) if i % 2 else SamplingParams(1.0, top_p=0.9)
        for seed in range(2):
            expected = sample_reference(tiny_model, prompt, 16, params, PositionNoise(seed))
            drafter = DraftModelDrafter(
                DraftHeadBackend(draft, HALF), k=4, sampling=params, noise=PositionNoise(seed), coupled=True
            )
            assert sampled_tokens(tiny_model, prompt, params, drafter, seed, 16) == expected
    prompt = list(range(2, TINY_VOCAB)) + [7, 8, 9]
    params = SamplingParams(temperature=1.5, top_k=3)
    exact = exact_joint(tiny_model, prompt, params, 3)
    counts: dict[tuple[int, ...], int] = {}
    draws = 600
    for i in range(draws):
        noise = PositionNoise(21_000 + i)
        verifier = functools.partial(verify_speculative, params=params, noise=noise)
        drafter = DraftModelDrafter(DraftHeadBackend(draft, HALF), k=3, sampling=params, noise=noise, coupled=False)
        steps = list(
            decode(TorchBackend(tiny_model), prompt, drafter, StopCriteria(frozenset(), 3), verifier, GREEDY[1])
        )
        key = tuple(t for s in steps for t in s.tokens)
        counts[key] = counts.get(key, 0) + 1
    assert_follows_exact(counts, exact, draws)


def test_the_draft_vocabulary_is_the_most_used_tokens_by_a_brute_force_count(tmp_path) -> None:
    import random

    from leapdecode.heads.vocabulary import (
        DraftVocabulary,
        count_ranking,
        draft_vocabulary,
        ranking_path,
        save_ranking,
        shipped_ranking_path,
    )
    from tests.helpers import TinyTokenizer

    rng = random.Random(0)
    texts = [[min(int(rng.expovariate(0.05)), TINY_VOCAB - 1) for _ in range(rng.randrange(1, 60))] for _ in range(50)]
    tally = {t: sum(text.count(t) for text in texts) for t in range(TINY_VOCAB)}
    brute = sorted((t for t in tally if tally[t]), key=lambda t: (-tally[t], t))
    assert count_ranking(texts) == brute
    vocab = DraftVocabulary.from_ranking(brute, 20, TINY_VOCAB, always=[95])
    assert set(vocab.ids) == {*brute[:19], 95} and list(vocab.ids) == sorted(vocab.ids)
    assert (torch.tensor(vocab.ids) == torch.arange(len(vocab.ids)) + vocab.d2t()).all()  # EAGLE's d2t form
    assert vocab.to_draft()[list(vocab.ids)].tolist() == list(range(20)) and int(vocab.t2d().sum()) == 20
    tokenizer = TinyTokenizer()
    shipped = tmp_path / "shipped"
    by_order, source = draft_vocabulary(tokenizer, 10, TINY_VOCAB, [1], tmp_path, shipped)  # nothing counted yet
    assert by_order.ids == (0, 1, *range(2, 10)) and "own order" in source and "leapdecode draft-vocab" in source
    save_ranking(shipped_ranking_path(tokenizer, shipped), list(reversed(brute)), "the package's texts")
    from_package, source = draft_vocabulary(tokenizer, 20, TINY_VOCAB, [95], tmp_path, shipped)
    assert source == "counted on the package's texts" and from_package != vocab
    save_ranking(ranking_path(tmp_path, tokenizer), brute, "test texts")  # counted here: before the shipped one
    counted, source = draft_vocabulary(tokenizer, 20, TINY_VOCAB, [95], tmp_path, shipped)
    assert counted == vocab and source == "counted on test texts"


def learnt(accepted: bool):
    """A shared estimate that has seen 200 drafts at every depth and confidence decile, all
    accepted or all rejected."""
    from leapdecode.drafters.cost_aware import AcceptanceEstimate
    from leapdecode.drafters.draft_pricing import depth_bucket

    estimate = AcceptanceEstimate()
    for _ in range(200):
        for depth in range(1, 9):
            estimate.observe(depth_bucket(depth), accepted)
            for decile in range(10):
                estimate.observe(("prob", depth, decile), accepted)
    return estimate


def cost_run(target, draft, prompt, cost, **options):
    from leapdecode.drafters.draft_pricing import DraftCost

    drafter = DraftModelDrafter(
        TorchBackend(draft), cost=DraftCost(ForwardCost((cost[0],)), ForwardCost(cost[1])), **options
    )
    steps = list(decode(TorchBackend(target), prompt, drafter, StopCriteria(frozenset(), 40), *GREEDY))
    return [t for s in steps for t in s.tokens], steps


def test_the_cost_cut_drafts_while_tokens_pay_and_never_changes_the_output(tiny_model, random_draft) -> None:
    from leapdecode.drafters.draft_pricing import PROBE_EVERY

    flat = (0.030,) * 8
    for prompt in prompts(3, seed=12):
        expected = greedy_reference(tiny_model, prompt, 40)
        free, steps = cost_run(
            tiny_model, tiny_model, prompt, (1e-6, flat), k=4
        )  # drafting costs nothing: k every step
        assert free == expected and all(len(s.drafted) == 4 for s in steps[1:-2])
        dear, steps = cost_run(
            tiny_model, tiny_model, prompt, (1.0, flat), k=4
        )  # a draft pass dearer than many target passes
        assert dear == expected
        assert (
            all(len(s.drafted) <= 1 for s in steps)
            and sum(len(s.drafted) > 0 for s in steps) <= len(steps) // PROBE_EVERY + 1
        )
        # a draft pass a third of the target's, a draft that is mostly wrong: lengths vary, the output does not
        mixed, steps = cost_run(tiny_model, random_draft, prompt, (0.010, (0.030, 0.031, 0.032, 0.034, 0.036)), k=5)
        assert mixed == expected
    assert len({len(s.drafted) for s in steps[1:]}) > 1


def test_the_cost_cut_learns_per_depth_and_confidence_and_hears_the_loops_cut(tiny_model) -> None:
    from leapdecode.drafters.draft_pricing import DraftCost

    drafter = DraftModelDrafter(
        TorchBackend(tiny_model), k=6, cost=DraftCost(ForwardCost((1e-6,)), ForwardCost((0.03,) * 8))
    )
    start(drafter, prompts(1, seed=2)[0])
    with torch.inference_mode():
        draft = draft_alone(drafter, 10)
    assert len(draft) == 6 and len(drafter.buckets) == 6
    hear_pass(drafter, [*draft.tokens[:2], 5], 2, kept=range(2))  # the loop scored only two of them, both accepted
    seen = drafter.rates.local.counts
    assert seen[("depth", 1)][0] == seen[("depth", 2)][0] == 1.0 and ("depth", 3) not in seen


def test_alone_the_draft_is_cut_by_the_shared_passes_rule(tiny_model) -> None:
    """Drafted while its depth's rate promised enough, a token whose calibrated chance then falls
    short is dropped before the pass: alone (an offer cut by its own curve) exactly as a shared pass's cut
    (`allocate` over the offer) drops it, and the drafter hears the cut."""
    from leapdecode.drafters.cost_aware import AcceptanceEstimate
    from leapdecode.drafters.draft_pricing import DraftCost, depth_bucket
    from leapdecode.engine.cost import allocate

    estimate = AcceptanceEstimate()
    for _ in range(200):  # every depth accepted so far; every probability bucket of depths 3+ rejected
        for depth in range(1, 9):
            estimate.observe(depth_bucket(depth), True)
            for decile in range(10):
                estimate.observe(("prob", depth, decile), depth < 3)
    cost = DraftCost(ForwardCost((1e-6,)), ForwardCost((0.030, 0.031, 0.032, 0.034, 0.036, 0.038, 0.040)))
    prompt = prompts(1, seed=2)[0]
    alone, shared = (DraftModelDrafter(TorchBackend(tiny_model), k=6, cost=cost, estimate=estimate) for _ in range(2))
    start(alone, prompt)
    start(shared, prompt)
    with torch.inference_mode():
        draft = draft_alone(alone, 10)
        offer = whole_offer(shared, 10)
    # the third drafted as its depth promised; its calibrated chance then stops the drafting
    assert len(offer.draft) == 3 and offer.reach is not None and offer.reach[2] < 0.05
    (keep,) = allocate([offer], [3], 1, 1, cost.target, 4)
    assert draft.tokens == offer.draft.subset(keep).tokens and len(draft) == 2  # the calibrated chances cut it
    hear_pass(alone, [*draft.tokens, 7], 2)  # the pass heard: the cut with it
    assert alone.last_draft == draft.tokens and len(alone.buckets) == 2


def test_a_probe_is_verified_whole_alone_and_in_a_shared_pass(tiny_model) -> None:
    """Where nothing pays the draft model is silent, and every `PROBE_EVERY` silent steps it
    drafts one token anyway: that probe offers no reach, so neither cut drops it and the rates
    learn from its verdict. In a batch of four each request probes four times as seldom, so the
    shared passes carry about as many probes as a request's own passes do."""
    from leapdecode.drafters.draft_pricing import PROBE_EVERY, DraftCost
    from leapdecode.engine.cost import allocate

    estimate = learnt(False)  # everything rejected so far
    cost = DraftCost(ForwardCost((0.01,)), ForwardCost((0.030, 0.040, 0.050)))
    drafter = DraftModelDrafter(TorchBackend(tiny_model), k=4, cost=cost, estimate=estimate)
    start(drafter, prompts(1, seed=2)[0])
    with torch.inference_mode():
        assert len(draft_alone(drafter, 10)) == 0  # silent: the first token does not pay
        drafter.silent = PROBE_EVERY
        probe = draft_alone(drafter, 10)
        assert len(probe) == 1 and len(drafter.buckets) == 1  # kept, though its chance is ~0
        drafter.update([*probe.tokens, 3], 1)
        drafter.silent = PROBE_EVERY
        early = whole_offer(drafter, 10, 4)
        drafter.silent = 4 * PROBE_EVERY
        offer = whole_offer(drafter, 10, 4)
    assert len(early.draft) == 0  # one of four: not yet
    assert len(offer.draft) == 1 and offer.reach is None
    assert allocate([offer], [1], 4, 4, cost.target, 8) == [[0]]  # a shared pass keeps it too


def test_a_probe_never_feeds_a_long_catch_up(tiny_model) -> None:
    """A probe feeds at most a round of silent steps' tokens: a draft model whose cache lags
    further (silent in a batch for `PROBE_EVERY` x B steps, or started from a kept prefix) would
    hold up every request of a shared pass with a prefill no price paid for. It stays silent,
    alone and in a batch, until the lag is fed by a draft that pays."""
    from leapdecode.drafters.draft_pricing import PROBE_EVERY, PROBE_LAG, DraftCost

    cost = DraftCost(ForwardCost((0.01,)), ForwardCost((0.030, 0.040, 0.050)), prefill=0.005)
    drafter = DraftModelDrafter(TorchBackend(tiny_model), k=4, cost=cost, estimate=learnt(False))
    start(drafter, prompts(1, seed=2)[0])
    with torch.inference_mode():
        drafter.silent = PROBE_EVERY
        probe = draft_alone(drafter, 10)  # started: a probe, the draft model's prefill unpriced here (no budget)
        drafter.update([*probe.tokens, 3], 1)
        drafter.max_new_tokens = 64
        passes = drafter.draft_passes
        for token in range(4, 4 + PROBE_LAG):  # silent steps: the cache lags behind
            drafter.update([token], 0)
        drafter.silent = 4 * PROBE_EVERY
        offer = whole_offer(drafter, 10, 4)
        alone = draft_alone(drafter, 10)
    assert len(offer.draft) == 0 and len(alone) == 0 and drafter.draft_passes == passes


def test_in_a_batch_a_drafted_token_costs_a_row_per_sequence(tiny_model) -> None:
    """Rows free up to 16, then each as dear as a pass: alone the draft model drafts its whole
    budget; with 8 sequences in the target's pass (each drafting as it does), a token costs 8
    rows, and it drafts one (16 rows); with 16 sequences, none."""
    from leapdecode.drafters.draft_pricing import DraftCost

    estimate = learnt(True)
    cost = DraftCost(ForwardCost((1e-4,)), ForwardCost(tuple(0.030 * max(1, n - 15) for n in range(1, 65))))
    lengths = []
    for batch in (1, 8, 16):
        drafter = DraftModelDrafter(TorchBackend(tiny_model), k=4, cost=cost, estimate=estimate)
        start(drafter, prompts(1, seed=2)[0])
        with torch.inference_mode():
            offer = whole_offer(drafter, 10, batch)
        lengths.append(len(offer.draft))
    assert lengths == [4, 1, 0]


def test_in_shared_passes_rows_are_priced_by_the_schedulers_curve(tiny_model) -> None:
    """A drafter's own target curve is a single sequence's; in shared passes the scheduler hands
    it the curve of the passes themselves, and where that says rows are dear it drafts less."""
    from leapdecode.drafters.draft_pricing import DraftCost

    estimate = learnt(True)
    cost = DraftCost(ForwardCost((1e-4,)), ForwardCost((0.030,) * 64))  # its own curve: rows free
    dear = ForwardCost(tuple(0.030 * max(1, n - 7) for n in range(1, 65)))  # the passes': dear past 8 rows
    lengths = []
    for shared in (None, dear):
        drafter = DraftModelDrafter(TorchBackend(tiny_model), k=4, cost=cost, estimate=estimate)
        start(drafter, prompts(1, seed=2)[0])
        with torch.inference_mode():
            offer = whole_offer(drafter, 10, 8, shared)
        lengths.append(len(offer.draft))
    assert lengths == [4, 0]


def test_the_draft_models_prefill_is_priced_against_the_steps_left(tiny_model) -> None:
    """Before its first draft the draft model's cache lacks the whole prompt: fed once, it serves
    the rest of the request, so the first token is charged that feed spread over the steps left.
    A long budget repays it and the model drafts; a short one does not, and the draft model never
    runs, not even for a probe; an unknown budget is not charged. The output never changes."""
    from leapdecode.drafters.draft_pricing import PROBE_EVERY, DraftCost

    estimate = learnt(True)  # every draft accepted so far
    # a 40-token prompt's feed: 39 x 10 ms against a 30 ms target pass and a 10 ms draft pass
    cost = DraftCost(ForwardCost((0.010,)), ForwardCost((0.030,) * 8), prefill=0.010)
    prompt = [(7 * i + 3) % 90 + 4 for i in range(40)]

    def first_draft(horizon: int | None, silent: int = 0) -> tuple[int, int]:
        drafter = DraftModelDrafter(TorchBackend(tiny_model), k=4, cost=cost, estimate=estimate)
        start(drafter, prompt)
        if horizon is not None:
            drafter.max_new_tokens = horizon
        drafter.silent = silent
        with torch.inference_mode():
            draft = draft_alone(drafter, 4)
        return len(draft), drafter.draft_passes

    assert first_draft(None) == (4, 4)  # budget unknown: not charged
    assert first_draft(1000) == (4, 4)  # 500 steps repay 0.39 s
    assert first_draft(8) == (0, 0)  # 4 steps do not: the draft model never runs
    assert first_draft(8, silent=PROBE_EVERY) == (0, 0)  # nor probes into the prefill
    expected = greedy_reference(tiny_model, prompt, 8)
    drafter = DraftModelDrafter(TorchBackend(tiny_model), k=4, cost=cost, estimate=estimate)
    steps = list(decode(TorchBackend(tiny_model), prompt, drafter, StopCriteria(frozenset(), 8), *GREEDY))
    assert [t for s in steps for t in s.tokens] == expected and drafter.draft_passes == 0


def test_the_length_estimate_is_the_mean_of_what_longer_finished_requests_emitted_beyond() -> None:
    """A request is counted on for the mean, over the finished requests that ran past its length,
    of what they emitted beyond it, capped at the budget left; with no history for its whole
    budget, and when longer than all before it for as many tokens again as it has emitted; one
    stopped by its budget past its length runs on, one stopped before says nothing."""
    from leapdecode.drafters.cost_aware import LengthEstimate

    lengths = LengthEstimate(keep=4)
    assert lengths.ahead(0, 100) == 100.0
    for emitted in (10, 30, 500):
        lengths.observe(emitted, budget_reached=False)
    assert lengths.ahead(0, 100) == (10 + 30 + 100) / 3
    assert lengths.ahead(20, 100) == (10 + 100) / 2  # only those that ran past 20
    assert lengths.ahead(600, 50) == 50.0 and lengths.ahead(600, 1000) == 600.0  # none did: as long again
    lengths.observe(50, budget_reached=True)
    assert lengths.ahead(20, 100) == (10 + 100 + 100) / 3  # stopped by its budget past 20: runs on
    assert lengths.ahead(60, 1000) == 440.0  # stopped by its budget before 60: says nothing
    lengths.observe(7, budget_reached=False)  # keeps the last four: 10 drops out
    assert list(lengths.finished) == [(30, False), (500, False), (50, True), (7, False)]


def test_a_decoder_whose_answers_run_short_stops_paying_for_draft_prefills(tiny_model) -> None:
    """A budget of 1,000 tokens repays a 40-token prompt's draft prefill, but once the decoder's
    finished requests (recorded by `finish`) show answers of about 8 tokens, a new request is
    counted on for little more and its draft model never runs; one that has already run far past
    them drafts again. The output is plain decoding's throughout."""
    from leapdecode.drafters.cost_aware import LengthEstimate
    from leapdecode.drafters.draft_pricing import DraftCost
    from leapdecode.drafters.draft_window import SINK_TOKENS

    estimate, lengths = learnt(True), LengthEstimate()
    cost = DraftCost(ForwardCost((0.010,)), ForwardCost((0.030,) * 8), prefill=0.010)
    prompt = [(7 * i + 3) % 90 + 4 for i in range(40)]

    def drafter() -> DraftModelDrafter:  # a 32-token window: a late start feeds no more than an early one
        return DraftModelDrafter(
            TorchBackend(tiny_model), k=4, cost=cost, estimate=estimate, lengths=lengths, window=32
        )

    def first_draft(emitted: int = 0) -> int:
        d = drafter()
        start(d, prompt)
        d.max_new_tokens = 1000
        d.update([(5 * i + 1) % 90 + 4 for i in range(emitted)], 0)  # as if it had emitted them
        with torch.inference_mode():
            return len(draft_alone(d, 4))

    assert first_draft() == 4
    expected = greedy_reference(tiny_model, prompt, 8)
    for _ in range(3):  # three answers of 8 tokens, each ended by a stop token
        d = drafter()
        stop = StopCriteria(frozenset({expected[-1]}), 1000)
        steps = list(decode(TorchBackend(tiny_model), prompt, d, stop, *GREEDY))
        assert [t for s in steps for t in s.tokens][: len(expected)] == expected
    # what the drafter heard: the pass that emitted the stop token may have scored a few past it
    assert all(8 <= emitted <= 8 + 4 and not capped for emitted, capped in lengths.finished)
    assert lengths.ahead(0, 1000) <= 12
    assert first_draft() == 0
    assert first_draft(emitted=20) == 0  # counted on for 20 more: not yet
    assert first_draft(emitted=200) == 4  # for 200 more: the prefill pays
    # decoding on: it starts late, over the window of everything so far, and changes nothing
    d = drafter()
    fed: list[list[int]] = []
    prefill = d.backend.prefill
    d.backend.prefill = lambda tokens: fed.append(list(tokens)) or prefill(tokens)  # type: ignore[method-assign]
    steps = list(decode(TorchBackend(tiny_model), prompt, d, StopCriteria(frozenset(), 96), *GREEDY))
    assert [t for s in steps for t in s.tokens] == greedy_reference(tiny_model, prompt, 96)
    first = next(i for i, s in enumerate(steps) if s.drafted)
    before = prompt + [t for s in steps[:first] for t in s.tokens]  # the stream at its first pass
    assert first > 8 and d.draft_passes > 0 and fed[0] == before[:SINK_TOKENS] + before[-(32 - SINK_TOKENS) :]
    assert d.seq is not None and d.seq.length + d.view.skip <= len(d.stream)


def test_in_a_batch_the_draft_models_prefill_is_charged_to_the_whole_pass(tiny_model) -> None:
    """A draft model's prefill holds up every request of the batch: with rows free, a feed that a
    request alone repays over its steps left is charged as if each of eight requests fed as much,
    and does not pay; the same request whose draft cache holds its prompt drafts."""
    from leapdecode.drafters.draft_pricing import DraftCost

    estimate = learnt(True)
    # a 40-token prompt's feed (39 x 10 ms) over ~50 steps: 7.8 ms a step, against a 30 ms pass
    cost = DraftCost(ForwardCost((0.010,) * 64), ForwardCost((0.030,) * 64), prefill=0.010)
    prompt = [(7 * i + 3) % 90 + 4 for i in range(40)]

    def offered(batch: int, fed: bool) -> int:
        drafter = DraftModelDrafter(TorchBackend(tiny_model), k=4, cost=cost, estimate=estimate)
        start(drafter, prompt)
        drafter.max_new_tokens = 100
        with torch.inference_mode():
            if fed:  # the draft model's cache holds all but the last token (as after a step)
                drafter.seq, _ = drafter.backend.prefill(prompt[:-1])
            offer = whole_offer(drafter, 4, batch, cost.target)
        return len(offer.draft)

    assert offered(1, fed=False) > 0  # alone: 7.8 ms more a step repays
    assert offered(8, fed=False) == 0  # eight feeding as much: 62 ms a step does not
    assert offered(8, fed=True) > 0


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
@pytest.mark.parametrize("draft_pass", [1e-6, 0.010, 1.0], ids=["free", "a-third", "dear"])
def test_retrieval_first_drafts_from_a_long_match_and_never_changes_the_output(
    tiny_model, random_draft, draft_pass, tree
) -> None:
    """A suffix match drafts instead of the draft model where it promises more tokens per second:
    when a draft pass is dear, seldom when drafting is free and the draft model is the target
    itself; greedy output is plain decoding's in every case, and the draft model's cache
    catches up on the tokens it skipped in its next pass."""
    from leapdecode.drafters.draft_pricing import DraftCost
    from leapdecode.drafters.suffix import SuffixDrafter

    costs = (
        0.030,
        0.031,
        0.032,
        0.034,
        0.036,
        0.038,
        0.040,
        0.042,
        0.044,
        0.046,
        0.048,
        0.05,
        0.052,
        0.054,
        0.056,
        0.058,
        0.06,
    )
    retrieved = as_trees = 0
    for seed, prompt in enumerate(prompts(6, seed=14)):
        expected = greedy_reference(tiny_model, prompt, 48)
        for draft in (tiny_model, random_draft):
            drafter = DraftModelDrafter(
                TorchBackend(draft),
                k=4,
                cost=DraftCost(ForwardCost((draft_pass,)), ForwardCost(costs)),
                retrieval=SuffixDrafter(16, min_match=1 if tree else 3, tree=tree),
            )
            steps = list(decode(TorchBackend(tiny_model), prompt, drafter, StopCriteria(frozenset(), 48), *GREEDY))
            assert [t for s in steps for t in s.tokens] == expected, (draft_pass, seed)
            retrieved += drafter.retrieved_steps
            as_trees += sum(s.parents is not None for s in steps)
            if draft_pass == 1e-6 and draft is tiny_model:  # the draft model is always right and free: it drafts
                assert drafter.retrieved_steps < len(steps) // 4  # once its rates are learned, the match loses
    if draft_pass == 1.0:
        assert retrieved > 0  # random models fall into loops: long matches, and a draft pass is dear
        assert (as_trees > 0) == tree  # a tree of what followed the match, verified as one


def test_retrieval_is_off_where_the_draft_models_q_is_needed(tiny_model) -> None:
    from leapdecode.drafters.draft_pricing import DraftCost
    from leapdecode.drafters.suffix import SuffixDrafter

    cost = DraftCost(ForwardCost((1.0,)), ForwardCost((0.03,) * 8))
    uncoupled = DraftModelDrafter(
        TorchBackend(tiny_model),
        sampling=SamplingParams(temperature=0.8),
        coupled=False,
        cost=cost,
        retrieval=SuffixDrafter(16, tree=False),
    )
    doubting = DraftModelDrafter(
        TorchBackend(tiny_model), threshold=0.3, cost=cost, retrieval=SuffixDrafter(16, tree=False)
    )
    assert uncoupled.retrieval is None and doubting.retrieval is None


def _row_exact(model) -> LoadedModel:
    """A tiny model made row-exact, as the API loads it, so its passes can pack sequences."""
    import dataclasses

    from leapdecode.models.row_exact import use_row_exact
    from tests.helpers import tiny_lm

    use_row_exact(model)
    return dataclasses.replace(tiny_lm(model), row_exact=True)


@pytest.mark.parametrize("draft_seed", [0, 1], ids=["draft-is-target", "random-draft"])
@pytest.mark.parametrize("spec", ["draft:k=3,cost_aware=false", "draft:k=4"])
def test_requests_in_a_batch_draft_in_shared_passes_and_each_equals_plain_decoding(draft_seed, spec) -> None:
    """The scheduler runs the requests' draft rounds together: one packed pass of the draft model
    drafts for every sequence still drafting, and each output is still plain greedy decoding's."""

    target = _row_exact(make_tiny_model("qwen2"))
    draft = _row_exact(make_tiny_model("qwen2", seed=draft_seed))
    plain = wrap(target, "ar")
    decoder = wrap(target, spec, draft_model=draft)
    scheduler = BatchScheduler(plain.backend, ForwardCost(tuple(0.01 for _ in range(64))), max_batch=4, max_rows=32)
    prompts_ = [[5, 6, 7, 8, 5, 6, 7, 8], [9, 3, 9, 3, 9], [4, 4, 2, 4, 4, 2, 11, 12], [7, 1, 7, 1]]
    outputs: list[list[int]] = [[] for _ in prompts_]
    runs = [decoder.start(prompt, max_new_tokens=24) for prompt in prompts_]
    backend = runs[0].drafter.needs.draft_backend
    assert backend is not None and all(run.drafter.needs.draft_backend is backend for run in runs)
    if "cost_aware=false" not in spec:  # costs where drafting pays, not the tiny models' timings
        from leapdecode.drafters.draft_pricing import DraftCost

        for run in runs:
            assert isinstance(run.drafter, DraftModelDrafter) and run.drafter.cost is not None
            run.drafter.cost = DraftCost(ForwardCost((1e-4,)), ForwardCost((0.01,) * 64), prefill=1e-4)
    packed: list[int] = []  # sequences per packed draft pass
    score_packed = backend.score_packed

    def counted(input_ids, position_ids, mask, cache, rows, features):
        packed.append(len(cache.items))
        return score_packed(input_ids, position_ids, mask, cache, rows, features)

    backend.score_packed = counted
    alone: list[int] = []  # draft passes of one sequence (a prefill, or a round only it drafted in)
    forward, prefill = backend.forward, backend.prefill
    backend.forward = lambda seq, tokens: alone.append(1) or forward(seq, tokens)
    backend.prefill = lambda tokens: alone.append(1) or prefill(tokens)
    batches: list[int] = []  # how many requests decoded in the pass, as each drafter heard it
    for run in runs:
        offer = run.drafter.offer
        run.drafter.offer = lambda context, f=offer: batches.append(context.batch) or f(context)
    for i, run in enumerate(runs):
        scheduler.submit(Submission(run, lambda s, i=i: outputs[i].extend(s.tokens), lambda r: None))
    while not scheduler.idle:
        scheduler.step()
    for prompt, got in zip(prompts_, outputs):
        assert got == greedy_reference(target.model, prompt, 24)
    assert packed and max(packed) >= 2
    assert max(batches) == len(prompts_) and min(batches) >= 1  # the scheduler tells each drafter its batch
    if "cost_aware=false" in spec:  # every sequence drafts each step: all in one draft pass
        assert max(packed) == len(prompts_)
    drafted_in = sum(run.drafter.draft_passes for run in runs)  # the draft passes each request needed
    assert drafted_in == sum(packed) + len(alone) > len(packed) + len(alone)  # fewer passes ran


def test_a_drafter_whose_rounds_fail_leaves_alone_and_the_others_share_on() -> None:
    """`drive_rounds`: a drafter that raises gets its error back; a failed packed pass fails the
    drafters in it; alone, each feed is an ordinary forward."""
    from leapdecode.engine.batch import drive_rounds
    from leapdecode.engine.drafting import DraftFeed

    model = _row_exact(make_tiny_model("qwen2")).model
    backend = TorchBackend(model, exact_tokens=16)

    def rounds(prompt, fail_after=None):
        seq, scores = yield DraftFeed(None, prompt)
        tokens = []
        for step in range(3):
            if step == fail_after:
                raise ValueError("drafter failed")
            tokens.append(int(scores.logits[-1].argmax()))
            seq, scores = yield DraftFeed(seq, tokens[-1:])
        return tokens

    got = drive_rounds(backend, [rounds([5, 6, 7]), rounds([9, 3, 9], fail_after=1), rounds([4, 4])])
    assert isinstance(got[1], ValueError)
    assert got[0] == greedy_reference(model, [5, 6, 7], 3) and got[2] == greedy_reference(model, [4, 4], 3)
    assert isinstance(drive_rounds(None, [rounds([5, 6])])[0], InputError)

    # a packed pass that fails part-way (after some layers wrote their keys) is rolled back and its
    # feeds scored one by one: every drafter still gets exactly its own results
    score_packed, failures = backend.score_packed, []

    def failing(input_ids, position_ids, mask, cache, rows, features):
        for item in cache.items:  # as a forward that failed after its first layer
            layer = item.seq.cache.layers[0]
            layer.update(layer.keys[:, :, -1:].clone(), layer.values[:, :, -1:].clone())
        failures.append(len(cache.items))
        raise RuntimeError("packed pass failed")

    backend.score_packed = failing
    got = drive_rounds(backend, [rounds([5, 6, 7]), rounds([4, 4])])
    backend.score_packed = score_packed
    assert failures and got == [greedy_reference(model, [5, 6, 7], 3), greedy_reference(model, [4, 4], 3)]


def test_a_draft_vocabularys_packed_pass_scores_each_sequence_as_its_own_pass() -> None:
    """On the draft path (int4, its head too: row-exact), exactly; a float head's product would
    round by the rows it scores."""
    from leapdecode.engine.batch import BatchItem, forward_batch
    from leapdecode.engine.draft_head import DraftHeadBackend
    from leapdecode.models.quantize import quantize_model

    model = make_tiny_model("qwen2")
    quantize_model(model, "int4", head_bits=4)
    model = _row_exact(model).model
    backend = DraftHeadBackend(model, HALF, exact_tokens=16)
    assert backend.batchable is None
    first, second = prompts(2, seed=5)
    with torch.inference_mode():
        alone = [backend.prefill(p)[0] for p in (first, second)]
        packed = [backend.prefill(p)[0] for p in (first, second)]
        want = [backend.forward(alone[0], [5, 6, 7]).logits, backend.forward(alone[1], [9]).logits]
        got = forward_batch(backend, [BatchItem(packed[0], [5, 6, 7]), BatchItem(packed[1], [9])])
    for g, w in zip(got, want):
        assert torch.equal(g.logits, w)
    with pytest.raises(InputError, match="without states"):
        forward_batch(backend, [BatchItem(packed[0], [1]), BatchItem(packed[1], [2])], features=(1,))


def test_a_cost_aware_draft_offers_each_token_with_its_reach_for_the_shared_cut(tiny_model) -> None:
    """In a shared pass, the draft model's tokens carry their chance to be accepted (parents
    first, never rising), so `allocate` cuts its draft by the same rule as every other request's."""
    from leapdecode.drafters.draft_pricing import DraftCost

    backend = TorchBackend(tiny_model)
    cheap = DraftCost(ForwardCost((1e-4,)), ForwardCost(tuple(0.01 for _ in range(64))))
    drafter = DraftModelDrafter(backend, k=4, cost=cheap)
    start(drafter, prompts(1, seed=6)[0])
    offer = whole_offer(drafter, 4)
    assert len(offer.draft) > 0 and offer.reach is not None and len(offer.reach) == len(offer.draft)
    assert all(0.0 < b <= a <= 1.0 for a, b in zip((1.0, *offer.reach), offer.reach))
    plain = DraftModelDrafter(backend, k=4)  # no costs: no estimate, the draft is taken whole
    start(plain, prompts(1, seed=6)[0])
    whole = whole_offer(plain, 4)
    assert whole.reach is None and len(whole.draft) == 4


def test_a_windowed_draft_model_reads_the_prompts_sinks_and_tail_and_never_changes_the_output(
    tiny_model, random_draft
) -> None:
    """With `window`, the draft model's first pass feeds the stream's first SINK_TOKENS and its
    last tokens (the prompt, and the token the target's prefill emitted), `window` in all, and its
    cache stays that far behind the stream: rollbacks and catch-ups land on the right tokens,
    alone and in shared passes, right drafts or wrong."""
    from leapdecode.drafters.draft_window import SINK_TOKENS

    prompt = [(7 * i + 3) % TINY_VOCAB for i in range(40)]
    for draft in (tiny_model, random_draft):
        backend = TorchBackend(draft)
        fed: list[list[int]] = []
        prefill = backend.prefill
        backend.prefill = lambda tokens, fed=fed, prefill=prefill: fed.append(list(tokens)) or prefill(tokens)
        drafter = DraftModelDrafter(backend, k=4, window=16)
        steps = list(decode(TorchBackend(tiny_model), prompt, drafter, StopCriteria(frozenset(), 30), *GREEDY))
        assert [t for s in steps for t in s.tokens] == greedy_reference(tiny_model, prompt, 30)
        first, stream = fed[0], prompt + list(steps[0].tokens)  # the prefill's token comes first
        assert first[:16] == stream[:SINK_TOKENS] + stream[-(16 - SINK_TOKENS) :]
        assert drafter.seq is not None and drafter.seq.length <= len(drafter.stream) - drafter.view.skip
    accepted = 0  # the target as its own draft: some of its windowed drafts still hold
    for shift in range(4):
        other = [(7 * i + 3 + 11 * shift) % TINY_VOCAB for i in range(40)]
        steps = list(
            decode(
                TorchBackend(tiny_model),
                other,
                DraftModelDrafter(TorchBackend(tiny_model), k=4, window=16),
                StopCriteria(frozenset(), 30),
                *GREEDY,
            )
        )
        assert [t for s in steps for t in s.tokens] == greedy_reference(tiny_model, other, 30)
        accepted += sum(s.num_accepted for s in steps)
    assert accepted > 0
    with pytest.raises(ValueError, match="window"):
        DraftModelDrafter(TorchBackend(tiny_model), window=2 * SINK_TOKENS)
    with pytest.raises(MethodError, match="window"):
        parse_method("draft:window=8")
    target = _row_exact(make_tiny_model("qwen2"))
    draft = _row_exact(make_tiny_model("qwen2", seed=1))
    decoder = wrap(target, "draft:k=3,cost_aware=false,window=16", draft_model=draft)
    scheduler = BatchScheduler(wrap(target, "ar").backend, ForwardCost((0.01,) * 64), max_batch=4, max_rows=32)
    long_prompts = [[(5 * i + s) % TINY_VOCAB for i in range(24 + 5 * s)] for s in range(3)]

    def wave(prompts: list[list[int]]) -> None:
        """The prompts in shared passes, each output plain greedy's."""
        outputs: list[list[int]] = [[] for _ in prompts]
        for i, prompt in enumerate(prompts):
            run_ = decoder.start(prompt, max_new_tokens=16)
            scheduler.submit(Submission(run_, lambda s, i=i: outputs[i].extend(s.tokens), lambda r: None))
        while not scheduler.idle:
            scheduler.step()
        for prompt, got in zip(prompts, outputs):
            assert got == greedy_reference(target.model, prompt, 16)

    wave(long_prompts)
    # a second wave after the same long prompts, in shared passes: the windowed draft caches the
    # first left (with their holes) start its draft model, and the output is still plain greedy's
    kept = decoder.start([5], max_new_tokens=1).drafter.prefix_cache
    assert kept is not None and all(entry.holes for entry in kept.entries) and kept.hits == 0
    follow = [prompt + [(3 * s + 1) % TINY_VOCAB, 2] for s, prompt in enumerate(long_prompts)]
    wave(follow)
    assert kept.hits == len(follow)


def test_a_draft_window_follows_the_stream_until_its_first_read() -> None:
    """Before its first read a draft model's window covers the stream as it is then (a draft model
    that starts late reads no more), from the sinks or from a kept copy with its holes; after it,
    the holes are fixed and it reads what came since."""
    from leapdecode.drafters.draft_window import DraftWindow
    from leapdecode.engine import CacheState
    from leapdecode.engine.prefix_cache import Taken

    stream = list(range(100))
    view = DraftWindow(16)
    view.unstarted(40)
    assert view.holes == ((4, 24),) and view.unread(stream[:40], None, [99]) == [0, 1, 2, 3, *range(28, 40), 99]
    view.grown(45)
    assert view.holes == ((4, 29),) and len(view.unread(stream[:45], None, [])) == 16
    view.copied(Taken(CacheState(cache=None, length=20), 30, ((4, 10),)), 60)  # 20 positions for 30 tokens
    assert view.holes == ((4, 10), (30, 14)) and view.unread(stream[:60], 20, []) == stream[44:60]
    view.grown(70)
    assert view.holes == ((4, 10), (30, 24)) and view.covered(20) == 54
    view.read()
    view.grown(80)
    assert view.holes == ((4, 10), (30, 24)) and view.unread(stream[:80], 36, [7]) == [*stream[70:80], 7]
    view.copied(Taken(CacheState(cache=None, length=20), 30, ((4, 10),)), 40)  # the rest within the window
    assert view.holes == ((4, 10),) and view.skip == 10
    unwindowed = DraftWindow(0)
    unwindowed.unstarted(100)
    assert unwindowed.holes == () and unwindowed.unread(stream, None, []) == stream
    with pytest.raises(ValueError, match="window"):
        DraftWindow(8)


def test_a_chats_next_turn_starts_the_draft_model_from_its_kept_cache_and_never_changes_the_output(
    tiny_model, random_draft
) -> None:
    """The draft model's prefix cache: a request whose cache holds its stream in order leaves it;
    the next turn (its prompt that stream and more) starts the draft model from a copy, and its
    first draft pass feeds only the new tokens; right drafts or wrong, the output is plain
    greedy's. A request whose window skipped part of its prompt leaves its cache with those holes,
    and the next turn starts from it too."""
    from leapdecode.engine.prefix_cache import PrefixCache

    for draft in (tiny_model, random_draft):
        backend = TorchBackend(draft)
        fed: list[list[int]] = []
        prefill, forward = backend.prefill, backend.forward
        backend.prefill = lambda tokens, fed=fed, prefill=prefill: fed.append(["prefill", *tokens]) or prefill(tokens)
        backend.forward = lambda seq, tokens, fed=fed, forward=forward, **kw: (
            fed.append(list(tokens)) or forward(seq, tokens, **kw)
        )
        kept = PrefixCache(4096)
        prompt = [(3 * i + 5) % TINY_VOCAB for i in range(10)]
        held = 0  # tokens of the kept entry the next turn copies
        for turn in range(3):
            fed.clear()
            drafter = DraftModelDrafter(backend, k=4, window=16, prefix_cache=kept)
            steps = list(decode(TorchBackend(tiny_model), prompt, drafter, StopCriteria(frozenset(), 20), *GREEDY))
            output = [t for s in steps for t in s.tokens]
            assert output == greedy_reference(tiny_model, prompt, 20), turn
            if turn:
                assert fed[0][0] != "prefill" and fed[0][: len(prompt) - held] == prompt[held:]
            assert len(kept.entries) == 1 and kept.entries[0].tokens == tuple((prompt + output)[: kept.tokens])
            held = kept.tokens
            prompt = prompt + output + [7, 8, 9]
        assert kept.hits == 2
    for draft in (tiny_model, random_draft):  # a window's holes: kept, and served to the next turns
        backend = TorchBackend(draft)
        fed = []
        forward = backend.forward
        backend.forward = lambda seq, tokens, fed=fed, forward=forward, **kw: (
            fed.append(list(tokens)) or forward(seq, tokens, **kw)
        )
        holed = PrefixCache(4096)
        prompt = [(3 * i + 5) % TINY_VOCAB for i in range(40)]
        for turn, new in enumerate(([], [7, 8, 9], [(5 * i + 1) % TINY_VOCAB for i in range(30)])):
            prompt = prompt + new
            fed.clear()
            before = len(holed.entries[0].tokens) if holed.entries else 0  # the tokens the turn starts from
            drafter = DraftModelDrafter(backend, k=4, window=16, prefix_cache=holed)
            steps = list(decode(TorchBackend(tiny_model), prompt, drafter, StopCriteria(frozenset(), 8), *GREEDY))
            output = [t for s in steps for t in s.tokens]
            assert output == greedy_reference(tiny_model, prompt, 8), turn
            (entry,) = holed.entries  # each turn's entry serves the last one's whole
            assert entry.tokens == tuple(prompt + output)[: len(entry.tokens)] and entry.seq.length == entry.size
            if turn == 1:  # the whole stream but the first turn's window hole: only the new tokens are fed
                assert len(drafter.view.holes) == 1 and fed[0][: len(prompt) - before] == prompt[before:]
            if turn == 2:  # the new tokens and the first one emitted, through a window of 16: a second hole
                assert len(drafter.view.holes) == 2 and drafter.view.holes[1] == (before, len(prompt) + 1 - before - 16)
            prompt = prompt + output
        assert holed.hits == 2
    target, draft = _row_exact(make_tiny_model("qwen2")), _row_exact(make_tiny_model("qwen2", seed=1))
    decoder = wrap(target, "draft:k=3,cost_aware=false", draft_model=draft)
    kept = decoder.start([5], max_new_tokens=1).drafter.prefix_cache  # one for the decoder's requests
    first = decoder.generate([5, 6, 7, 8], max_new_tokens=6).token_ids
    second = decoder.generate([5, 6, 7, 8, *first, 9], max_new_tokens=6).token_ids
    assert second == greedy_reference(target.model, [5, 6, 7, 8, *first, 9], 6)
    assert kept is not None and kept.hits == 1
    with pytest.raises(MethodError, match="prefix_cache"):
        parse_method("draft:prefix_cache=-1")


def test_a_drafted_token_pays_exactly_when_the_steps_rate_rises() -> None:
    """`pays` against the rate it stands for, computed the long way: (tokens expected) / (seconds
    of the draft passes and the verification pass), with and without the token."""
    from leapdecode.drafters.cost_aware import LengthEstimate
    from leapdecode.drafters.draft_pricing import DraftCost, catch_up_charge, model_rate, pays

    target = ForwardCost((0.030, 0.031, 0.034, 0.038, 0.044, 0.052, 0.060, 0.070, 0.080))
    cost = DraftCost(ForwardCost((0.008, 0.010)), target, prefill=0.004)
    for drafted in range(3):
        for batch in (1, 2):
            for guess in (0.05, 0.3, 0.6, 0.95):
                for catch_up in (0.0, 0.2):
                    expected = 1.0 + 0.7 * drafted
                    spent = drafted * cost.draft.of(batch) + target.of(batch * (drafted + 1))
                    more = spent + cost.draft.of(batch) + batch * catch_up
                    more += target.of(batch * (drafted + 2)) - target.of(batch * (drafted + 1))
                    want = (expected + guess) / more > expected / spent
                    assert pays(cost, target, drafted, guess, expected, batch, catch_up) == want
    assert pays(cost, target, 0, 0.9, 1.0, 1, 0.0) and not pays(cost, target, 0, 0.9, 1.0, 1, 0.5)
    # the catch-up feed: its tokens but one, spread over the steps still to come (none: nothing known)
    lengths = LengthEstimate()
    assert catch_up_charge(cost, 1, 0, 64, lengths, lambda b: 0.5) == 0.0
    assert catch_up_charge(cost, 9, 0, None, lengths, lambda b: 0.5) == 0.0
    assert catch_up_charge(cost, 9, 0, 64, lengths, lambda b: 0.5) == pytest.approx(8 * 0.004 / (64 / 1.5))
    # drafting nothing is always an option; at rate 1 and near-free draft passes, the deepest draft wins
    assert model_rate(cost, lambda b: 0.0, 4, 0.0) == pytest.approx(1 / 0.030)
    cheap = DraftCost(ForwardCost((1e-9,)), target)
    assert model_rate(cheap, lambda b: 1.0, 4, 0.0) == pytest.approx(5 / (4e-9 + target.of(5)))


def test_a_draft_model_is_loaded_offering_the_targets_tokenizer(monkeypatch, tmp_path) -> None:
    """The draft model's load may take the target's tokenizer (`load_model` shares it only where
    both were read from the same files): both precision paths offer it."""
    from leapdecode.models import loading

    asked: list[dict] = []

    def load(*args, **kwargs):
        asked.append(kwargs)
        return tiny_lm(make_tiny_model("qwen2", seed=5))

    monkeypatch.setattr(loading, "default_cache_dir", lambda: tmp_path)
    monkeypatch.setattr(loading, "load_model", load)
    target = tiny_lm(make_tiny_model("qwen2"))
    for method in ("draft:model=tiny", "draft:model=tiny,precision=own"):
        parse_method(method).load_draft(target, lambda _: None)
    assert [kwargs["share_tokenizer"] for kwargs in asked] == [target, target]
