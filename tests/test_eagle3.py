"""EAGLE-3 heads: greedy output equal to plain decoding whatever the head drafts (chains and trees,
random and trained heads, long generations), sampled output equal to plain sampling's, the target
states the loop hands over, both published formats saved and loaded back to the same logits, the
loader's errors, and a short training run whose loss falls and whose acceptance rises."""

from __future__ import annotations

import json

import pytest
import torch

from leapdecode.drafters.cost_aware import CostAwareDrafter
from leapdecode.drafters.eagle3 import Eagle3Drafter
from leapdecode.engine import StopCriteria, TorchBackend, decode
from leapdecode.engine.cost import ForwardCost
from leapdecode.engine.drafting import PassResult
from leapdecode.engine.reference import greedy_reference
from leapdecode.errors import MethodError, ModelLoadError
from leapdecode.heads.eagle3 import Eagle3Config, Eagle3Head, HeadCache, default_aux_layers, random_head
from leapdecode.heads.eagle3_format import load_eagle3, save_eagle3
from leapdecode.methods import Eagle3, parse_method
from leapdecode.verifiers import SamplingParams
from tests.helpers import GREEDY, TINY_VOCAB, assert_sampled_like_plain, make_tiny_model, prompts

LAYERS = 4


def tiny_config(draft_vocab: int = TINY_VOCAB, **overrides) -> Eagle3Config:
    base = dict(
        hidden_size=64,
        intermediate_size=96,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=TINY_VOCAB,
        draft_vocab_size=draft_vocab,
        aux_layers=default_aux_layers(LAYERS),
    )
    return Eagle3Config(**{**base, **overrides})


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def target(request):
    return make_tiny_model(request.param, layers=LAYERS)


def make_head(model, seed: int = 0, draft_vocab: int = TINY_VOCAB) -> Eagle3Head:
    head = random_head(tiny_config(draft_vocab), model.get_input_embeddings(), seed=seed, scale=0.3)
    if draft_vocab < TINY_VOCAB:  # a draft vocabulary of every other token, from 1
        ids = torch.arange(1, 2 * draft_vocab, 2)[:draft_vocab]
        head.d2t.copy_(ids - torch.arange(draft_vocab))
        head.t2d.zero_()
        head.t2d[ids] = True
    return head


def run(model, prompt, drafter, n):
    steps = list(decode(TorchBackend(model), prompt, drafter, StopCriteria(frozenset(), n), *GREEDY))
    return [t for s in steps for t in s.tokens], steps


@pytest.mark.parametrize(
    "shape",
    [dict(depth=5), dict(depth=1), dict(depth=4, width=3, nodes=10), dict(depth=6, width=2, nodes=24)],
    ids=["chain5", "chain1", "tree10", "tree24"],
)
@pytest.mark.parametrize("draft_vocab", [TINY_VOCAB, 40], ids=["full-vocab", "draft-vocab"])
def test_random_head_is_lossless(target, shape, draft_vocab) -> None:
    drafted = 0
    for i, prompt in enumerate(prompts(5, seed=3)):
        head = make_head(target, seed=i, draft_vocab=draft_vocab)
        got, steps = run(target, prompt, Eagle3Drafter(head, **shape), 60)
        assert got == greedy_reference(target, prompt, 60), (shape, prompt)
        drafted += sum(len(s.drafted) for s in steps)
        if shape.get("width", 1) > 1:
            assert any(s.parents is not None for s in steps if s.drafted)
    assert drafted > 0


def test_cost_aware_cutting_keeps_eagle3_lossless(target) -> None:
    cost = ForwardCost(tuple(0.01 * (1 + 0.05 * n) for n in range(40)))
    for shape in (dict(depth=5), dict(depth=4, width=3, nodes=12)):
        for prompt in prompts(4, seed=5):
            drafter = CostAwareDrafter(Eagle3Drafter(make_head(target), **shape), cost)
            assert run(target, prompt, drafter, 50)[0] == greedy_reference(target, prompt, 50)


def test_sampled_eagle3_equals_plain_sampling(target) -> None:
    head = make_head(target, seed=2)
    for params in (SamplingParams(temperature=0.8), SamplingParams(temperature=1.0, top_k=10, top_p=0.9)):
        for shape in (dict(depth=4), dict(depth=3, width=3, nodes=9)):
            drafted = assert_sampled_like_plain(
                target,
                [5, 6, 7, 5, 6, 7, 5, 6],
                params,
                lambda shape=shape: Eagle3Drafter(head, **shape),
                seeds=range(3),
                length=25,
            )
            assert drafted > 0


class RecordingDrafter(Eagle3Drafter):
    def hear(self, result):
        self.seen = [*getattr(self, "seen", []), result.features.clone()]
        super().hear(result)


def test_loop_hands_the_head_the_states_of_the_kept_positions(target) -> None:
    """After the prefill one row per prompt token; after each pass one per kept position: the rows
    equal the target's states at those positions in one uncached pass over the final text."""
    drafter = RecordingDrafter(make_head(target), depth=3, width=2, nodes=6)
    prompt = prompts(3, seed=8)[0]
    got, _ = run(target, prompt, drafter, 30)
    rows = torch.cat(drafter.seen)  # [positions, F]
    text = torch.tensor([prompt + got[:-1]])
    with torch.inference_mode():
        states = target(input_ids=text, output_hidden_states=True).hidden_states
    expected = torch.cat([states[i][0] for i in drafter.needs.features], dim=-1)
    assert rows.shape == expected.shape
    torch.testing.assert_close(rows, expected, rtol=1e-4, atol=1e-4)


def test_head_cache_grows_and_truncates() -> None:
    cache = HeadCache()
    k = torch.randn(2, 300, 8)
    keys, _ = cache.append(k, k)
    keys, _ = cache.append(k[:, :5], k[:, :5])
    assert keys.shape == (2, 305, 8) and torch.equal(keys[:, 300:], k[:, :5])
    cache.truncate(10)
    assert cache.length == 10
    with pytest.raises(ValueError):
        cache.truncate(11)


@pytest.mark.parametrize("fmt", ["eagle", "speculators"])
def test_formats_round_trip_to_the_same_logits(tmp_path, fmt) -> None:
    model = make_tiny_model(layers=LAYERS)
    head = make_head(model, seed=4, draft_vocab=40)
    save_eagle3(head, tmp_path, fmt=fmt, target_name="tiny")
    loaded = load_eagle3(tmp_path, model)
    assert loaded.config == head.config
    states, tokens = torch.randn(1, 7, head.config.feature_size), torch.randint(0, TINY_VOCAB, (1, 7))
    positions, mask = torch.arange(7)[None], torch.ones(1, 7, 7, dtype=torch.bool).tril()
    with torch.inference_mode():
        a = head.logits(head.attend(states, tokens, positions, mask, fuse=True)[0])
        b = loaded.logits(loaded.attend(states, tokens, positions, mask, fuse=True)[0])
    assert torch.equal(a, b) and torch.equal(head.d2t, loaded.d2t) and torch.equal(head.t2d, loaded.t2d)
    prefix = "midlayer." if fmt == "eagle" else "layers.0."
    from safetensors.torch import load_file

    assert any(k.startswith(prefix) for k in load_file(str(tmp_path / "model.safetensors")))


def test_published_conventions_are_read(tmp_path) -> None:
    """Layer outputs (SGLang's ids from 1) become layer inputs; a checkpoint's own embedding is used;
    no d2t/t2d means the whole vocabulary."""
    from safetensors.torch import load_file, save_file

    model = make_tiny_model(layers=LAYERS)
    head = make_head(model)
    save_eagle3(head, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [1, 2, 3]
    del config["eagle_aux_hidden_state_layer_ids"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    state = load_file(str(tmp_path / "model.safetensors"))
    del state["d2t"], state["t2d"]
    state["embed_tokens.weight"] = torch.randn(TINY_VOCAB, 64)
    save_file(state, str(tmp_path / "model.safetensors"))
    loaded = load_eagle3(tmp_path, model)
    assert loaded.config.aux_layers == (2, 3, 4)
    assert torch.equal(loaded.embed_tokens.weight, state["embed_tokens.weight"])
    assert torch.equal(loaded.to_target(torch.arange(5)), torch.arange(5))


def test_loader_errors_name_what_differs(tmp_path) -> None:
    model = make_tiny_model(layers=LAYERS)
    save_eagle3(make_head(model), tmp_path / "ok")
    wide = make_tiny_model(layers=LAYERS, vocab=128)
    with pytest.raises(ModelLoadError, match="vocabulary has 96 tokens, the target's 128"):
        load_eagle3(tmp_path / "ok", wide)
    config = json.loads((tmp_path / "ok" / "config.json").read_text())
    import shutil

    for name in ("wide", "deep", "two"):
        (tmp_path / name).mkdir()
        shutil.copy(tmp_path / "ok" / "model.safetensors", tmp_path / name)
    (tmp_path / "wide" / "config.json").write_text(json.dumps({**config, "target_hidden_size": 128}))
    with pytest.raises(ModelLoadError, match="width 128, the target's hidden size is 64"):
        load_eagle3(tmp_path / "wide", model)
    (tmp_path / "deep" / "config.json").write_text(
        json.dumps({**config, "eagle_aux_hidden_state_layer_ids": [2, 3, 9], "eagle_config": {}})
    )
    with pytest.raises(ModelLoadError, match=r"reads layers \[2, 3, 9\], the target has 4"):
        load_eagle3(tmp_path / "deep", model)
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="no weights"):
        load_eagle3(tmp_path / "empty", model)
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_eagle3(tmp_path / "nothing", model)
    (tmp_path / "two" / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 2}))
    with pytest.raises(ModelLoadError, match="of 2 layers"):
        load_eagle3(tmp_path / "two", model)
    from safetensors.torch import load_file, save_file

    state = load_file(str(tmp_path / "ok" / "model.safetensors"))
    for name, change in (
        ("absolute", lambda d: d + torch.arange(len(d)) + 1),
        ("clash", lambda d: torch.cat([torch.ones(1, dtype=d.dtype), torch.zeros(len(d) - 1, dtype=d.dtype)])),
    ):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(config))
        save_file(
            {**state, "d2t": change(torch.full_like(state["d2t"], 1))}, str(tmp_path / name / "model.safetensors")
        )
        with pytest.raises(ModelLoadError, match="d2t does not map"):
            load_eagle3(tmp_path / name, model)
    (tmp_path / "narrow").mkdir()
    (tmp_path / "narrow" / "config.json").write_text(json.dumps({**config, "intermediate_size": 32}))
    shutil.copy(tmp_path / "ok" / "model.safetensors", tmp_path / "narrow")
    with pytest.raises(ModelLoadError, match="do not fit the config"):
        load_eagle3(tmp_path / "narrow", model)


def test_method_string_and_errors(tmp_path) -> None:
    method = parse_method("eagle3:depth=4,width=3,nodes=10")
    assert isinstance(method, Eagle3) and method.drafts == "tree" and method.pass_size == 11
    assert parse_method("eagle3").drafts == "chain" and parse_method("eagle3:depth=5").pass_size == 6
    for bad in ("eagle3:depth=0", "eagle3:width=17", "eagle3:nodes=200"):
        with pytest.raises(MethodError):
            parse_method(bad)


@pytest.mark.slow  # two tiny models with a head and a suffix index, over many prompts
def test_head_with_suffix_is_lossless_and_grafts(target) -> None:
    from leapdecode.drafters.head_suffix import HeadWithSuffix
    from leapdecode.drafters.suffix import SuffixDrafter

    accepted = {False: 0, True: 0}  # without and with the suffix branch
    for prompt in prompts(6, seed=4):  # every third repeats a unit: the suffix branch drafts there
        for shape in (dict(depth=4), dict(depth=3, width=2, nodes=6)):
            for with_suffix in (False, True):
                drafter = Eagle3Drafter(make_head(target), **shape)
                drafter = HeadWithSuffix(drafter, SuffixDrafter(12)) if with_suffix else drafter
                got, steps = run(target, prompt, drafter, 50)
                assert got == greedy_reference(target, prompt, 50)
                accepted[with_suffix] += sum(s.num_accepted for s in steps)
    assert accepted[True] > accepted[False]
    method = parse_method("eagle3:suffix=true,suffix_k=8")
    assert method.drafts == "tree" and method.pass_size == 6 + 1 + 8


@pytest.mark.real_model
def test_random_heads_are_lossless_on_the_real_model(real_lm, tmp_path) -> None:
    """Random EAGLE-3 and Medusa heads for smollm2, loaded from folders through the method
    strings: chains, trees and the suffix graft give plain decoding's tokens."""
    from leapdecode.heads.medusa import MedusaConfig, random_medusa
    from leapdecode.heads.medusa_format import save_medusa
    from tests.helpers import drafted_matching_plain

    model = real_lm.model
    text = model.config.get_text_config()
    config = Eagle3Config(
        hidden_size=text.hidden_size,
        intermediate_size=256,
        num_attention_heads=text.num_attention_heads,
        num_key_value_heads=text.num_key_value_heads,
        vocab_size=text.vocab_size,
        draft_vocab_size=2048,
        aux_layers=default_aux_layers(text.num_hidden_layers),
        rope_theta=100000.0,
    )
    head = random_head(config, model.get_input_embeddings(), seed=1, scale=0.05)
    with torch.no_grad():
        head.d2t.copy_(torch.arange(2048) * 20 - torch.arange(2048))  # every 20th token
        head.t2d.zero_()
        head.t2d[torch.arange(2048) * 20] = True
    save_eagle3(head, tmp_path / "eagle3")
    save_medusa(
        random_medusa(MedusaConfig(text.hidden_size, text.vocab_size, num_heads=3), seed=2, scale=0.05),
        tmp_path / "medusa",
    )
    from leapdecode import wrap

    chats = ["Write a haiku about rain.", "List three uses of a paperclip."]
    for spec in (
        f"eagle3:head={tmp_path / 'eagle3'},depth=4",
        f"eagle3:head={tmp_path / 'eagle3'},depth=4,width=3,nodes=10",
        f"eagle3:head={tmp_path / 'eagle3'},suffix=true",
        f"medusa:head={tmp_path / 'medusa'},depth=3",
        f"medusa:head={tmp_path / 'medusa'},depth=3,width=3,nodes=8",
    ):
        assert drafted_matching_plain(real_lm, wrap(real_lm, spec + ",cost_aware=false"), chats, 40) > 0


@pytest.mark.parametrize("commit", [0, 5, 11])
def test_training_time_test_scores_what_drafting_drafts(commit) -> None:
    """Training and drafting agree on alignment: after committing states 0..i, the chain the head
    drafts is, step by step, the argmax of the training-time test's logits at entry i when fed
    that same chain (positions, masks and the head's cache all line up)."""
    from leapdecode.training.losses import ttt_logits

    model = make_tiny_model(layers=LAYERS)
    head = make_head(model, seed=7, draft_vocab=40)
    gen = torch.Generator().manual_seed(commit)
    states = torch.randn(commit + 1, head.config.feature_size, generator=gen)
    prefix = torch.randint(0, TINY_VOCAB, (commit + 2,), generator=gen).tolist()
    drafter = Eagle3Drafter(head, depth=5)
    drafter.reset(prefix[:1])
    drafter.hear(PassResult(prefix[1:], 0, None, states))
    chain = drafter.propose(5).tokens
    ids = torch.tensor(prefix + chain[:-1])
    padded = torch.cat(
        [states, torch.zeros(len(ids) - len(states), states.shape[1])]
    )  # later states: never read by entry `commit`
    with torch.inference_mode():
        logits = ttt_logits(head, padded, ids, 5)
    predicted = [int(head.to_target(step[commit].argmax())) for step in logits]
    assert predicted == chain
