"""Early exit and self-speculative decoding: the layer runner, lossless self-drafting, CALM.

Tiny random models (6 layers) for many prompts and every acceptance pattern; the real
`smollm2-135m` for the same guarantees on a real model.
"""

from __future__ import annotations

import pytest
import torch

from leapdecode.api import wrap
from leapdecode.drafters.self_draft import SelfDrafter
from leapdecode.early_exit.backend import LayerBackend, SelfDraftBackend
from leapdecode.early_exit.calibrate import block_influence, format_layer_set, parse_layer_set, skip_order
from leapdecode.early_exit.calm import CalmBackend, layer_confidences, pick_threshold, simulate_thresholds
from leapdecode.early_exit.runner import LayerRunner
from leapdecode.engine import StopCriteria, decode
from leapdecode.engine.reference import agreement, full_model_predictions, greedy_reference
from leapdecode.engine.sampling import SamplingParams
from leapdecode.errors import MethodError
from leapdecode.methods import parse_method
from leapdecode.models import LoadedModel
from tests.helpers import GREEDY, make_tiny_model
from tests.helpers import prompts as tiny_prompts

LAYERS = 6


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def deep_model(request):
    return make_tiny_model(request.param, seed=3, layers=LAYERS)


def tiny_lm(model) -> LoadedModel:
    return LoadedModel(model=model, tokenizer=None, name="tiny", eos_token_ids=frozenset(), max_context=512)


def prompts(count: int, seed: int = 0) -> list[list[int]]:
    return tiny_prompts(count, seed, repetitive_every=2, repetitive_len=(6, 30), random_len=(1, 25), repeats=10)


def run(backend, prompt, drafter, max_new_tokens=30):
    steps = list(decode(backend, prompt, drafter, StopCriteria(frozenset(), max_new_tokens), *GREEDY))
    return [t for s in steps for t in s.tokens], steps


# --- the layer runner ---------------------------------------------------------------------


@torch.inference_mode()
def test_runner_over_all_layers_equals_the_models_forward(deep_model) -> None:
    runner = LayerRunner(deep_model)
    ids = [5, 9, 13, 2, 40, 7, 7, 8]
    expected = deep_model(input_ids=torch.tensor([ids]), use_cache=False).logits[0]  # [n, vocab]
    # without a cache: one pass
    cache = runner.new_cache()
    got = runner.head(runner.run(cache, runner.embed(ids), range(LAYERS), runner.positions(0, len(ids))))
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    # with a cache: a prefix, then one token, then three tokens
    cache = runner.new_cache()
    pieces, start, rows = [ids[:4], ids[4:5], ids[5:]], 0, []
    for piece in pieces:
        rows.append(
            runner.head(runner.run(cache, runner.embed(piece), range(LAYERS), runner.positions(start, len(piece))))
        )
        start += len(piece)
    torch.testing.assert_close(torch.cat(rows), expected, atol=1e-4, rtol=1e-4)
    assert all(runner.cached(cache, i) == len(ids) for i in range(LAYERS))


@torch.inference_mode()
def test_a_skipped_set_leaves_the_cache_consistent(deep_model) -> None:
    """Draft with layers skipped, then verify: the cache ends exactly as plain decoding's."""
    backend = SelfDraftBackend(deep_model, draft_layers=(0, 1, 3, 5))  # skips 2 and 4; exact prefix 0..1
    plain = LayerBackend(deep_model)
    prompt = [4, 8, 15, 16, 23, 42]
    seq, _ = backend.prefill(prompt)
    ref, _ = plain.prefill(prompt)
    backend.draft(seq, [11])
    backend.draft(seq, [12])
    counts = [LayerRunner.cached(seq.cache, i) for i in range(LAYERS)]
    assert counts == [8, 8, 6, 8, 6, 8]  # draft layers ran ahead; skipped layers did not
    scores = backend.forward(seq, [11, 12, 13])  # reuses two tokens' prefix work, runs the third
    expected = plain.forward(ref, [11, 12, 13])
    torch.testing.assert_close(scores.logits, expected.logits, atol=1e-4, rtol=1e-4)
    # the drafted rows' keys came from one-row passes, the reference's from a three-row one: float32
    # products of other widths round differently (up to 1.2e-5 on an AVX-512 CPU, one thread)
    for i in range(LAYERS):
        torch.testing.assert_close(seq.cache.layers[i].keys, ref.cache.layers[i].keys, atol=1e-4, rtol=1e-4)
    backend.rollback(seq, 7)
    assert all(LayerRunner.cached(seq.cache, i) == 7 for i in range(LAYERS)) and not seq.drafted


def test_layer_sets_parse_and_format() -> None:
    assert parse_layer_set("4-6/9/2") == (2, 4, 5, 6, 9)
    assert format_layer_set((2, 4, 5, 6, 9)) == "2/4-6/9"
    for bad in ("", "a", "5-3", "1,2"):
        with pytest.raises(MethodError):
            parse_layer_set(bad)


def test_unsupported_architecture_is_refused() -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64))
    with pytest.raises(MethodError, match="gpt2"):
        LayerRunner(model)


# --- lossless self-drafting ---------------------------------------------------------------


@pytest.mark.parametrize(
    "draft_layers",
    [(0, 1, 2), (0,), (0, 2, 4), (1, 2, 3, 4, 5), (0, 1, 2, 3, 5)],
    ids=["exit3", "exit1", "skip-odd", "skip-first", "skip-4"],
)
@pytest.mark.parametrize("threshold", [0.0, 0.6])
def test_self_drafting_equals_plain_greedy(deep_model, draft_layers, threshold) -> None:
    backend = SelfDraftBackend(deep_model, draft_layers)
    accepted = 0
    for prompt in prompts(8):
        got, steps = run(backend, prompt, SelfDrafter(k=4, threshold=threshold))
        assert got == greedy_reference(deep_model, prompt, 30), f"prompt {prompt}"
        accepted += sum(s.num_accepted for s in steps)
    assert accepted >= 0


def identity_layer_model(arch: str):
    """Layers 3..5 add nothing (their output projections are zero): skipping them drafts
    exactly the target's tokens, so every draft is accepted."""
    model = make_tiny_model(arch, seed=5, layers=LAYERS)
    with torch.no_grad():
        for layer in model.model.layers[3:]:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    return model


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_drafts_all_right_when_skipped_layers_do_nothing(arch) -> None:
    model = identity_layer_model(arch)
    for draft_layers in [(0, 1, 2), (0, 1, 2, 4)]:
        backend = SelfDraftBackend(model, draft_layers)
        for prompt in prompts(4, seed=1):
            got, steps = run(backend, prompt, SelfDrafter(k=4), max_new_tokens=25)
            assert got == greedy_reference(model, prompt, 25)
            # every full draft is accepted: 4 drafted + 1 bonus per pass
            assert all(s.num_accepted == len(s.drafted) for s in steps)
            assert len(steps) <= 1 + -(-25 // 5)


def test_drafts_mostly_wrong_still_lossless() -> None:
    """A 1-layer draft of a random 6-layer model rarely agrees; output is unchanged anyway."""
    model = make_tiny_model("llama", seed=11, layers=LAYERS)
    backend = SelfDraftBackend(model, (0,))
    drafted = accepted = 0
    for prompt in prompts(6, seed=2):
        got, steps = run(backend, prompt, SelfDrafter(k=3))
        assert got == greedy_reference(model, prompt, 30)
        drafted += sum(len(s.drafted) for s in steps)
        accepted += sum(s.num_accepted for s in steps)
    assert accepted < drafted


def test_methods_build_backends_and_refuse_bad_layers(deep_model) -> None:
    lm = tiny_lm(deep_model)
    assert isinstance(parse_method("layerskip:exit=2").make_backend(lm), SelfDraftBackend)
    assert isinstance(parse_method("self-spec:skip=2-3").make_backend(lm), SelfDraftBackend)
    assert isinstance(parse_method("calm:threshold=0.5,measure=state").make_backend(lm), CalmBackend)
    for bad in ("layerskip:exit=6", "self-spec:skip=4-9", "self-spec:skip=0-5", "calm:first=9"):
        with pytest.raises(MethodError):
            parse_method(bad).make_backend(lm)
    for bad in ("layerskip", "layerskip:exit=0", "self-spec:skip=x", "calm:threshold=1.5", "calm:measure=entropy"):
        with pytest.raises(MethodError):
            parse_method(bad)


def test_self_spec_without_a_calibration_skips_the_middle_layers_and_says_what_to_run(
    deep_model, tmp_path, monkeypatch, caplog
) -> None:
    monkeypatch.setattr("leapdecode.models.default_cache_dir", lambda: tmp_path)
    method = parse_method("self-spec")
    with caplog.at_level("INFO", logger="leapdecode"):
        skip = method.skip_layers(tiny_lm(deep_model))
    assert skip == (2,) and "calibrate layer-skip" in caplog.text  # 6 layers: ceil(6/10) = 1 layer, the middle
    lm = tiny_lm(deep_model)
    backend = method.make_backend(lm)
    new_drafter = method.prepare(lm, backend=backend)
    for prompt in prompts(3):
        got, _ = run(backend, prompt, new_drafter(SamplingParams(), None), 20)
        assert got == greedy_reference(deep_model, prompt, 20)


def test_block_influence_ranks_do_nothing_layers_first() -> None:
    model = identity_layer_model("llama")
    influence = block_influence(LayerBackend(model), prompts(3))
    assert influence.shape == (LAYERS,)
    assert torch.allclose(influence[3:].float(), torch.zeros(3), atol=1e-5)
    assert skip_order(influence)[:2] == [3, 4]  # layer 5 is the last, never skipped


# --- CALM ---------------------------------------------------------------------------------


@pytest.mark.parametrize("measure", ["softmax", "state"])
def test_calm_threshold_one_is_plain_decoding(deep_model, measure) -> None:
    from leapdecode.drafters import NoDrafter

    backend = CalmBackend(deep_model, measure, threshold=1.0)
    for prompt in prompts(5):
        got, _ = run(backend, prompt, NoDrafter())
        assert got == greedy_reference(deep_model, prompt, 30)


@torch.inference_mode()
def test_calm_exits_copy_state_and_agreement_is_hand_checked(deep_model) -> None:
    """A low threshold exits early; each token's exit matches a by-hand recomputation, and the
    reported agreement equals a by-hand count against the full model on the same prefixes."""
    from leapdecode.drafters import NoDrafter

    backend = CalmBackend(deep_model, "softmax", threshold=0.05, first=1)
    prompt = [3, 14, 15, 92, 65]
    got, _ = run(backend, prompt, NoDrafter(), max_new_tokens=12)
    seq, _ = backend.prefill(prompt)  # rerun to read the per-token exit layers
    exits = []
    pending = got[0]
    for token in got[1:]:
        backend.forward(seq, [pending])
        exits.append(seq.exit_layers[-1])
        pending = token
    assert min(exits) < LAYERS, "threshold 0.05 should let some tokens exit early"
    # by hand: the full model's greedy token after each prefix, one uncached pass each
    by_hand = [greedy_reference(deep_model, prompt + got[:i], 1)[0] for i in range(len(got))]
    expected = sum(a == b for a, b in zip(by_hand, got)) / len(got)
    measured = agreement(full_model_predictions(deep_model, prompt, got), torch.tensor(got))
    assert measured == pytest.approx(expected)
    assert agreement(torch.tensor([1, 2, 3, 4]), torch.tensor([1, 0, 3, 0])) == 0.5


def test_threshold_simulation_on_a_hand_made_case() -> None:
    # two candidate layers (after layers 0 and 1) of a 3-layer model, three tokens
    confs = torch.tensor([[0.9, 0.2, 0.5], [0.95, 0.8, 0.4]])
    preds = torch.tensor([[7, 1, 2], [7, 5, 9]])
    final = torch.tensor([7, 5, 3])
    points = simulate_thresholds(confs, preds, final, candidates=(0, 1), num_layers=3, thresholds=[0.3, 0.6, 1.0])
    # t=0.3: token0 exits after layer 0 (7 ok), token1 after layer 1 (5 ok), token2 after layer 0 (2 wrong)
    assert points[0].agreement == pytest.approx(2 / 3) and points[0].mean_layers == pytest.approx((1 + 2 + 1) / 3)
    # t=0.6: token0 layer 0 (ok), token1 layer 1 (ok), token2 runs all 3 layers (ok)
    assert points[1].agreement == 1.0 and points[1].mean_layers == pytest.approx((1 + 2 + 3) / 3)
    assert points[2].agreement == 1.0 and points[2].mean_layers == 3.0
    assert pick_threshold(points, epsilon=0.05).threshold == 0.6
    assert pick_threshold(points, epsilon=0.5).threshold == 0.3


def test_layer_confidences_shapes(deep_model) -> None:
    backend = LayerBackend(deep_model)
    confs, preds, final = layer_confidences(backend, [5, 6, 7, 8], "state", candidates=(1, 3))
    assert confs.shape == (2, 4) and preds.shape == (2, 4) and final.shape == (4,)
    assert final.tolist() == deep_model(input_ids=torch.tensor([[5, 6, 7, 8]])).logits[0].argmax(-1).tolist()


# --- the real small model -----------------------------------------------------------------

REAL_PROMPTS = [
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "The capital of France is Paris. The capital of Germany is",
    "for i in range(10):\n    print(i)\nfor j in range(10):\n   ",
]


@pytest.mark.parametrize("method", ["layerskip:exit=12,k=3", "self-spec:skip=8-19,k=4,threshold=0.3"])
def test_real_model_self_drafting_is_lossless(real_lm, method) -> None:
    plain = wrap(real_lm, "ar")
    fast = wrap(real_lm, method)
    accepted = 0
    for prompt in REAL_PROMPTS:
        expected = plain.generate(prompt, max_new_tokens=24)
        got = fast.generate(prompt, max_new_tokens=24)
        assert got.token_ids == expected.token_ids, prompt
        accepted += got.stats.accepted_tokens
    assert accepted > 0


def test_real_model_layer_runner_matches_forward(real_lm) -> None:
    ids = real_lm.tokenizer("def add(a, b):\n    return a + b", add_special_tokens=False)["input_ids"]
    backend = LayerBackend(real_lm.model)
    _, scores = backend.prefill(ids)
    with torch.inference_mode():
        expected = real_lm.model(input_ids=torch.tensor([ids])).logits[0, -1:]
    torch.testing.assert_close(scores.logits, expected, atol=1e-3, rtol=1e-3)


def test_real_model_calm_never_exiting_is_plain(real_lm) -> None:
    prompt = REAL_PROMPTS[0]
    expected = wrap(real_lm, "ar").generate(prompt, max_new_tokens=16).token_ids
    assert wrap(real_lm, "calm:threshold=1.0").generate(prompt, max_new_tokens=16).token_ids == expected


def test_calibrate_commands_on_the_real_model(real_lm, tmp_path, monkeypatch) -> None:
    """Both calibrations run end to end (tiny budgets); self-spec then uses the saved skip set."""
    import json

    from typer.testing import CliRunner

    from leapdecode.cli import app

    monkeypatch.setattr("leapdecode.models.default_cache_dir", lambda: tmp_path)
    runner = CliRunner()
    out = tmp_path / "calibration.json"
    result = runner.invoke(app, ["calibrate", "layer-skip", "-n", "4", "--fractions", "0.1", "--out", str(out)])
    assert result.exit_code == 0, result.output
    saved = json.loads(out.read_text())
    assert saved["num_layers"] == 30 and len(saved["trials"]) == 1 and saved["skip"]
    assert (tmp_path / "layer-skip" / f"{real_lm.fingerprint}.json").is_file()  # keyed by the weights
    assert saved["fingerprint"] == real_lm.fingerprint
    fast = wrap(real_lm, "self-spec")
    assert fast.backend.draft_layers == tuple(i for i in range(30) if i not in parse_layer_set(saved["skip"]))
    assert (
        fast.generate(REAL_PROMPTS[0], max_new_tokens=12).token_ids
        == wrap(real_lm, "ar").generate(REAL_PROMPTS[0], max_new_tokens=12).token_ids
    )
    result = runner.invoke(app, ["calibrate", "calm", "-n", "4", "--first", "20", "--every", "4", "--epsilon", "0.1"])
    assert result.exit_code == 0, result.output
    assert "calm:threshold=" in result.stdout
    bad = runner.invoke(app, ["calibrate", "calm", "--measure", "entropy"])
    assert bad.exit_code == 2 and "measure" in bad.stderr


@pytest.mark.slow  # a distribution test: thousands of sampled draws
def test_self_drafting_with_sampling_keeps_the_distribution(deep_model) -> None:
    """Sampled drafts from the skipped-layer model, verified by speculative sampling: the first
    three tokens follow the target's exact distribution."""
    import functools

    from leapdecode.verifiers import SamplingParams, verify_speculative
    from tests.helpers import assert_follows_exact, exact_joint

    prompt = [5, 17, 33, 5, 17, 40, 8]
    params = SamplingParams(temperature=1.5, top_k=3)
    exact = exact_joint(deep_model, prompt, params, 3)
    from leapdecode.engine.noise import PositionNoise

    draws = 500
    backend = SelfDraftBackend(deep_model, (0, 1, 2, 4))
    counts: dict[tuple[int, ...], int] = {}
    drafted = 0
    for i in range(draws):
        noise = PositionNoise(3_000 + i)
        verifier = functools.partial(verify_speculative, params=params, noise=noise)
        drafter = SelfDrafter(k=3, sampling=params, noise=noise, coupled=i % 2 == 0)
        steps = list(decode(backend, prompt, drafter, StopCriteria(frozenset(), 3), verifier, GREEDY[1]))
        key = tuple(t for s in steps for t in s.tokens)
        counts[key] = counts.get(key, 0) + 1
        drafted += sum(len(s.drafted) for s in steps)
    assert drafted > 0
    assert_follows_exact(counts, exact, draws)
