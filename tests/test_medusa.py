"""Medusa-1 heads: greedy output equals plain decoding token for token (random heads, chain and
tree, and cost-aware cutting, on tiny llama and qwen2 targets), sampled output equals plain
sampling with the same seed, the heads read the target's state before the stream's last token,
drafts respect their bounds, each published format (Medusa's safetensors and .pt, vLLM's, shared
and truncated LM heads) round-trips to the same logits and reads files written by the formats'
own module layouts, and the loader names what is wrong with a folder."""

from __future__ import annotations

import functools
import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from leapdecode.drafters import CostAwareDrafter, NoDrafter
from leapdecode.drafters.medusa import MedusaDrafter
from leapdecode.engine import StopCriteria, TorchBackend, decode
from leapdecode.engine.cost import ForwardCost
from leapdecode.engine.drafting import Evidence, PassResult
from leapdecode.errors import ModelLoadError
from leapdecode.heads.medusa import MedusaConfig, MedusaHeads, random_medusa
from leapdecode.heads.medusa_format import load_medusa, save_medusa
from leapdecode.verifiers import SamplingParams
from tests.helpers import GREEDY, TINY_VOCAB, assert_sampled_like_plain, make_tiny_model, prompts

LAYERS = 2  # the tiny models' layers: hidden_states[2] is the final norm's output
CONFIG = MedusaConfig(hidden_size=64, vocab_size=TINY_VOCAB, num_heads=4, num_layers=1)
X = torch.randn(5, 64, generator=torch.Generator().manual_seed(0))  # [n, H]: rows to compare logits on


def run(model, prompt: list[int], drafter, max_new_tokens: int = 60):
    with torch.inference_mode():
        steps = list(decode(TorchBackend(model), prompt, drafter, StopCriteria(frozenset(), max_new_tokens), *GREEDY))
    return [t for s in steps for t in s.tokens], steps


_PLAIN: dict[tuple[int, tuple[int, ...], int], list[int]] = {}


def plain(model, prompt: list[int], max_new_tokens: int = 60) -> list[int]:
    """Plain decoding's tokens, computed once per model and prompt."""
    key = (id(model), tuple(prompt), max_new_tokens)
    if key not in _PLAIN:
        _PLAIN[key] = run(model, prompt, NoDrafter(), max_new_tokens)[0]
    return _PLAIN[key]


def logits(heads: MedusaHeads) -> torch.Tensor:
    with torch.inference_mode():
        return heads(X)  # [num_heads, n, vocab]


DRAFTERS = {
    "chain": lambda heads: MedusaDrafter(heads, LAYERS),
    "tree": lambda heads: MedusaDrafter(heads, LAYERS, tree=True, nodes=16, width=4),
    "tree-narrow": lambda heads: MedusaDrafter(heads, LAYERS, tree=True, nodes=5, depth=3, width=2),
    "cost-aware-tree": lambda heads: CostAwareDrafter(
        MedusaDrafter(heads, LAYERS, tree=True, nodes=12, width=3),
        ForwardCost(tuple(1.0 + 0.001 * i for i in range(32))),
    ),
}


@pytest.mark.parametrize("name", DRAFTERS)
def test_random_heads_give_plain_greedy_output(tiny_model, name: str) -> None:
    drafted = accepted = 0
    for seed, prompt in enumerate(prompts(2, seed=4)):
        got, steps = run(tiny_model, prompt, DRAFTERS[name](random_medusa(CONFIG, seed)))
        assert got == plain(tiny_model, prompt), (name, prompt)
        drafted += sum(len(s.drafted) for s in steps)
        accepted += sum(s.num_accepted for s in steps)
    assert drafted > 0 and accepted < drafted  # drafts were made, and rejected drafts recovered from


def test_heads_covering_the_vocabulary_are_accepted_every_pass(tiny_model) -> None:
    """Head 0's top-`vocab` tokens hold every token: the tree's first level always holds the
    target's token, so every pass with a draft accepts at least one drafted token."""
    drafter = MedusaDrafter(random_medusa(CONFIG, 3), LAYERS, tree=True, nodes=TINY_VOCAB, depth=1, width=TINY_VOCAB)
    prompt = prompts(2, seed=5)[1]
    got, steps = run(tiny_model, prompt, drafter, 40)
    assert got == plain(tiny_model, prompt, 40)
    with_draft = [s for s in steps if s.drafted]
    assert len(with_draft) >= 15 and all(s.num_accepted == 1 and len(s.drafted) == TINY_VOCAB for s in with_draft)


class _Recording(MedusaDrafter):
    """Records, at each proposal, the stream and the feature row the heads read."""

    def reset(self, prompt_ids) -> None:
        super().reset(prompt_ids)
        self.stream = list(prompt_ids)
        self.seen: list[tuple[list[int], torch.Tensor]] = []

    def update(self, tokens, num_accepted: int) -> None:
        super().update(tokens, num_accepted)
        self.stream += list(tokens)

    def propose(self, max_tokens: int):
        assert self.last is not None
        self.seen.append((list(self.stream), self.last.clone()))
        return super().propose(max_tokens)


def test_heads_read_the_target_state_before_the_last_token(tiny_model) -> None:
    """Offsets: at each proposal the row is the target's final-norm state at the position whose
    next token is the stream's last one (so head 0 drafts the token after it)."""
    drafter = _Recording(random_medusa(CONFIG, 1), LAYERS, tree=True, nodes=8, width=3)
    run(tiny_model, prompts(1, seed=6)[0], drafter, 25)
    assert len(drafter.seen) > 5
    for stream, row in drafter.seen:
        with torch.inference_mode():
            out = tiny_model(input_ids=torch.tensor([stream[:-1]]), output_hidden_states=True)
        assert torch.allclose(row[0], out.hidden_states[LAYERS][0, -1], atol=1e-4)


def test_drafts_follow_the_heads_and_their_bounds() -> None:
    heads = random_medusa(CONFIG, 2)
    state = torch.randn(3, 64)  # [rows, H]: only the last row counts
    chain, tree = MedusaDrafter(heads, LAYERS), MedusaDrafter(heads, LAYERS, tree=True, nodes=10, width=3)
    for drafter in (chain, tree):
        drafter.reset([5, 6])
        assert len(drafter.propose(4)) == 0  # no state yet
        drafter.hear(PassResult([7], 0, None, state))
        assert len(drafter.propose(0)) == 0
    with torch.inference_mode():
        probs = heads(state[-1:])[:, 0].softmax(-1)  # [num_heads, vocab]
    draft = chain.propose(10)
    assert draft.tokens == probs.argmax(-1).tolist() and draft.q is None and draft.parents is None
    assert draft.evidence == tuple(Evidence("head", min(9, int(10 * float(p)))) for p in probs.max(-1).values)
    assert len(chain.propose(2)) == 2
    for max_tokens in (1, 2, 10):
        draft = tree.propose(max_tokens)
        assert draft.parents is not None and draft.evidence is not None and 0 < len(draft) <= 10
        level: list[int] = []
        for i, (token, parent) in enumerate(zip(draft.tokens, draft.parents)):
            assert parent < i
            level.append(0 if parent < 0 else level[parent] + 1)
            assert token in probs[level[-1]].topk(3).indices.tolist()
            assert draft.evidence[i] == Evidence("head", min(9, int(10 * float(probs[level[-1], token]))))
        assert max(level) < min(max_tokens, CONFIG.num_heads)
        children = [(p, t) for t, p in zip(draft.tokens, draft.parents)]
        assert len(set(children)) == len(children)  # siblings differ


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_sampled_output_equals_plain_sampling(tree: bool) -> None:
    model = make_tiny_model("qwen2" if tree else "llama")
    drafted = 0
    for i, prompt in enumerate(prompts(2, seed=7)):
        params = SamplingParams(0.8, top_k=8) if i % 2 else SamplingParams(1.0, top_p=0.9)
        make = functools.partial(
            lambda seed: MedusaDrafter(random_medusa(CONFIG, seed), LAYERS, tree=tree, nodes=8, width=3), i
        )
        drafted += assert_sampled_like_plain(model, prompt, params, make, range(3 * i, 3 * i + 3), 20)
    assert drafted > 0


# --- formats ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def target():
    return make_tiny_model("llama")


@pytest.mark.parametrize("format", ["medusa", "vllm"])
@pytest.mark.parametrize("safetensors", [True, False], ids=["safetensors", "torch-file"])
@pytest.mark.parametrize("layers", [0, 1, 2])
def test_each_format_round_trips_to_the_same_logits(
    target, tmp_path, format: str, safetensors: bool, layers: int
) -> None:
    heads = random_medusa(MedusaConfig(64, TINY_VOCAB, 3, layers), 5)
    file = save_medusa(heads, tmp_path, format=format, base_model="tiny", safetensors=safetensors)
    assert (
        file.name
        == {
            "medusa": ("medusa_lm_head.safetensors", "medusa_lm_head.pt"),
            "vllm": ("model.safetensors", "pytorch_model.bin"),
        }[format][0 if safetensors else 1]
    )
    loaded = load_medusa(tmp_path, target)
    assert loaded.config == heads.config and torch.equal(logits(loaded), logits(heads))


def test_saved_key_names_are_the_formats_own(target, tmp_path) -> None:
    heads = random_medusa(MedusaConfig(64, TINY_VOCAB, 2, 2), 0)
    save_medusa(heads, tmp_path / "m", format="medusa", base_model="org/base")
    save_medusa(heads, tmp_path / "v", format="vllm")
    assert set(load_file(tmp_path / "m" / "medusa_lm_head.safetensors")) == {
        f"{i}.{j}.linear.{p}" for i in range(2) for j in range(2) for p in ("weight", "bias")
    } | {"0.2.weight", "1.2.weight"}
    assert set(load_file(tmp_path / "v" / "model.safetensors")) == {
        f"blocks.{i}.layers.{j}.{p}" for i in range(2) for j in range(2) for p in ("weight", "bias")
    } | {"lm_heads.0.weight", "lm_heads.1.weight"}
    medusa = json.loads((tmp_path / "m" / "config.json").read_text())
    assert (medusa["medusa_num_heads"], medusa["medusa_num_layers"], medusa["base_model_name_or_path"]) == (
        2,
        2,
        "org/base",
    )
    vllm = json.loads((tmp_path / "v" / "config.json").read_text())
    assert vllm["architectures"] == ["MedusaModel"] and vllm["model_type"] == "medusa"
    assert (vllm["num_heads"], vllm["num_hidden_layers"], vllm["medusa_fc_bias"]) == (2, 2, True)


class _ResBlock(nn.Module):
    """Medusa's own ResBlock (FasterDecoding/Medusa, medusa_model.py)."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden, hidden)
        self.act = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.act(self.linear(x))


def test_reads_a_file_written_by_medusas_own_module(target, tmp_path) -> None:
    """Medusa's `medusa_head`: a ModuleList of Sequential(ResBlock, Linear), torch.save'd, with
    a published-style config.json (no hidden or vocabulary size)."""
    generator = torch.Generator().manual_seed(9)
    reference = nn.ModuleList([nn.Sequential(_ResBlock(64), nn.Linear(64, TINY_VOCAB, bias=False)) for _ in range(3)])
    with torch.no_grad():
        for p in reference.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * 0.3)
    torch.save(reference.state_dict(), tmp_path / "medusa_lm_head.pt")
    (tmp_path / "config.json").write_text(
        json.dumps({"medusa_num_heads": 3, "medusa_num_layers": 1, "base_model_name_or_path": "lmsys/vicuna-7b-v1.3"})
    )
    with torch.inference_mode():
        expected = torch.stack([head(X) for head in reference])  # [3, n, vocab]
    assert torch.equal(logits(load_medusa(tmp_path, target)), expected)


def test_reads_vllms_layout_without_biases_and_with_one_lm_head(target, tmp_path) -> None:
    """vLLM's `Medusa`: blocks.{i}.layers.{j} (no bias unless medusa_fc_bias), lm_heads.{i};
    with original_lm_head one LM head serves every head."""
    g = torch.Generator().manual_seed(4)
    w = [torch.randn(64, 64, generator=g) * 0.3 for _ in range(2)]
    lm = torch.randn(TINY_VOCAB, 64, generator=g) * 0.3
    save_file(
        {"blocks.0.layers.0.weight": w[0], "blocks.1.layers.0.weight": w[1], "lm_heads.0.weight": lm},
        str(tmp_path / "model.safetensors"),
    )
    (tmp_path / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["MedusaModel"],
                "model_type": "medusa",
                "hidden_size": 64,
                "vocab_size": TINY_VOCAB,
                "num_heads": 2,
                "num_hidden_layers": 1,
                "original_lm_head": True,
            }
        )
    )
    with torch.inference_mode():
        expected = torch.stack([(X + torch.nn.functional.silu(X @ wi.T)) @ lm.T for wi in w])  # [2, n, vocab]
    loaded = load_medusa(tmp_path, target)
    assert torch.allclose(logits(loaded), expected, atol=1e-5)
    save_medusa(loaded, tmp_path / "again", format="vllm")
    assert torch.equal(logits(load_medusa(tmp_path / "again", target)), logits(loaded))


@pytest.mark.parametrize("format", ["medusa", "vllm"])
def test_heads_without_lm_heads_use_the_targets(target, tmp_path, format: str) -> None:
    heads = random_medusa(CONFIG, 6, shared_lm_head=target.get_output_embeddings().weight)
    assert heads.lm_heads is None
    save_medusa(heads, tmp_path, format=format)
    loaded = load_medusa(tmp_path, target)
    assert loaded.lm_heads is None and torch.equal(logits(loaded), logits(heads))
    with torch.inference_mode():
        plain = torch.stack([block(X) @ target.lm_head.weight.T for block in heads.blocks])
    assert torch.allclose(logits(heads), plain, atol=1e-5)


def test_heads_without_lm_heads_use_a_quantized_targets_own(tmp_path) -> None:
    """A target whose LM head is quantized holds no float weight: the loader de-quantizes it,
    as the trainer does, so the heads score what the target's own head would (Medusa's format:
    vLLM's stores the shared head in the file)."""
    from leapdecode.models.quantize import QuantizedLinear, quantize_model

    quantized = make_tiny_model("llama")
    quantize_model(quantized, "int4")
    head = quantized.get_output_embeddings()
    assert isinstance(head, QuantizedLinear)
    heads = random_medusa(CONFIG, 6, shared_lm_head=head.weight_float())
    save_medusa(heads, tmp_path, format="medusa")
    loaded = load_medusa(tmp_path, quantized)
    assert loaded.lm_heads is None and torch.equal(logits(loaded), logits(heads))


def test_a_quantized_shared_head_scores_as_the_float_one_and_stays_lossless(tiny_model) -> None:
    """The int8 copy of the shared LM head scores every head's rows in one product, close to the
    float head's logits (the heads' state is untouched), and drafting with it stays lossless."""
    heads = random_medusa(CONFIG, 7, shared_lm_head=tiny_model.get_output_embeddings().weight)
    before, state = logits(heads), {k: v.clone() for k, v in heads.state_dict().items()}
    assert heads.quantize_shared_head()
    after = logits(heads)
    assert not torch.equal(after, before) and torch.allclose(after, before, atol=0.05 * before.abs().max().item())
    assert heads.state_dict().keys() == state.keys() and all(
        torch.equal(heads.state_dict()[k], v) for k, v in state.items()
    )
    assert random_medusa(CONFIG, 7).quantize_shared_head() is False  # own LM heads: nothing shared
    heads.shared_lm_head = heads.shared_lm_head.clone()  # a new head: the copy of the old one no longer scores
    assert torch.equal(logits(heads), before)
    assert heads.quantize_shared_head()
    with torch.no_grad():
        heads.shared_lm_head.mul_(2.0)  # changed in place: the copy is stale, the float head scores
    assert torch.equal(logits(heads), 2.0 * before)
    with torch.no_grad():
        heads.shared_lm_head.mul_(0.5)
    assert heads.quantize_shared_head()
    prompt = prompts(1, 9)[0]
    assert run(tiny_model, prompt, MedusaDrafter(heads, LAYERS, tree=True, nodes=12, width=3))[0] == plain(
        tiny_model, prompt
    )


@pytest.mark.parametrize("shared", [True, False], ids=["shared-lm-head", "own-lm-heads"])
def test_the_method_on_a_quantized_target_stays_lossless(tmp_path, shared: bool) -> None:
    """`medusa:` on an int4 target quantizes the heads as the target (and a shared LM head to
    int8, scoring every head in one product): greedy output equals plain decoding."""
    import dataclasses

    from leapdecode import wrap
    from leapdecode.api import Decoder
    from leapdecode.models.quantize import quantize_model
    from tests.helpers import tiny_lm

    model = make_tiny_model("llama")
    quantize_model(model, "int4")
    lm = dataclasses.replace(tiny_lm(model), quantize="int4")
    shared_head = model.get_output_embeddings().weight_float() if shared else None
    save_medusa(random_medusa(CONFIG, 8, shared_lm_head=shared_head), tmp_path, format="medusa")
    said: list[str] = []
    decoder = Decoder(lm, f"medusa:head={tmp_path},cost_aware=false", log=said.append)
    assert any("shared LM head quantized to int8" in line for line in said) == shared  # the int8 product is what drafts
    for prompt in prompts(3, 21):
        out = decoder.generate(prompt, max_new_tokens=40)
        assert out.token_ids == wrap(lm, "ar").generate(prompt, max_new_tokens=40).token_ids
        assert out.stats.drafted_tokens > 0


def test_heads_without_lm_heads_need_the_targets_weights(tmp_path) -> None:
    class Opaque(nn.Module):  # an output layer with no weight tensor to read
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x

    target = make_tiny_model("llama")
    heads = random_medusa(CONFIG, 6, shared_lm_head=target.get_output_embeddings().weight)
    save_medusa(heads, tmp_path, format="medusa")
    target.lm_head = Opaque()
    with pytest.raises(ModelLoadError, match="could not be read"):
        load_medusa(tmp_path, target)


def test_a_truncated_vocabulary_round_trips_in_vllms_format(target, tmp_path) -> None:
    token_map = torch.tensor([7, 3, 50, 2, 95, 11])
    heads = random_medusa(CONFIG, 8, token_map=token_map)
    out = logits(heads)  # [num_heads, n, vocab]
    outside = torch.ones(TINY_VOCAB, dtype=torch.bool)
    outside[token_map] = False
    assert torch.isinf(out[..., outside]).all() and torch.isfinite(out[..., token_map]).all()
    save_medusa(heads, tmp_path, format="vllm")
    assert json.loads((tmp_path / "config.json").read_text())["truncated_vocab_size"] == 6
    assert torch.equal(logits(load_medusa(tmp_path, target)), out)
    drafter = MedusaDrafter(heads, LAYERS, tree=True, nodes=8, width=2)
    drafter.reset([4])
    drafter.hear(PassResult([5], 0, None, X))
    assert set(drafter.propose(4).tokens) <= set(token_map.tolist())
    with pytest.raises(ValueError, match="token map"):
        save_medusa(heads, tmp_path / "m", format="medusa")


# --- loader errors ----------------------------------------------------------------------


def test_a_hidden_size_mismatch_is_named(target, tmp_path) -> None:
    save_medusa(random_medusa(MedusaConfig(32, TINY_VOCAB, 2), 0), tmp_path)
    with pytest.raises(ModelLoadError, match="hidden size 32, but the target's hidden size is 64"):
        load_medusa(tmp_path, target)


@pytest.mark.parametrize("format", ["medusa", "vllm"])
def test_a_vocabulary_mismatch_is_named(target, tmp_path, format: str) -> None:
    save_medusa(random_medusa(MedusaConfig(64, 100, 2), 0), tmp_path, format=format)
    with pytest.raises(ModelLoadError, match=f"vocabulary of 100 tokens, but the target's vocabulary has {TINY_VOCAB}"):
        load_medusa(tmp_path, target)


def test_missing_files_keys_and_unknown_configs_are_named(target, tmp_path) -> None:
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_medusa(tmp_path / "nowhere", target)
    with pytest.raises(ModelLoadError, match="has no config.json"):
        load_medusa(tmp_path, target)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    with pytest.raises(ModelLoadError, match="not a Medusa config: expected Medusa's config"):
        load_medusa(tmp_path, target)
    (tmp_path / "config.json").write_text(json.dumps({"medusa_num_heads": 2, "medusa_num_layers": 1}))
    with pytest.raises(ModelLoadError, match="no Medusa weights in .*medusa_lm_head.safetensors or medusa_lm_head.pt"):
        load_medusa(tmp_path, target)
    heads = random_medusa(MedusaConfig(64, TINY_VOCAB, 2), 0)
    save_medusa(heads, tmp_path / "m")
    state = load_file(tmp_path / "m" / "medusa_lm_head.safetensors")
    del state["1.0.linear.bias"]
    save_file(state, str(tmp_path / "m" / "medusa_lm_head.safetensors"))
    with pytest.raises(ModelLoadError, match=r"lack 1\.0\.linear\.bias"):
        load_medusa(tmp_path / "m", target)
    save_medusa(heads, tmp_path / "v", format="vllm")
    config = json.loads((tmp_path / "v" / "config.json").read_text())
    (tmp_path / "v" / "config.json").write_text(json.dumps({**config, "hidden_size": 128}))
    with pytest.raises(ModelLoadError, match="says hidden size 128, but the weights have 64"):
        load_medusa(tmp_path / "v", target)
    (tmp_path / "v" / "config.json").write_text(json.dumps({**config, "truncated_vocab_size": 10}))
    with pytest.raises(ModelLoadError, match="lack token_map"):
        load_medusa(tmp_path / "v", target)
