"""Any causal LM: greedy equality with plain decoding on tiny random models of many
architectures, past the sliding window of those that have one (chains, trees, a draft model)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from leapdecode.api import Decoder
from leapdecode.engine import TorchBackend, compile_tree
from leapdecode.engine.reference import greedy_reference
from leapdecode.errors import InputError, MethodError
from leapdecode.models import LoadedModel
from tests.helpers import TINY_VOCAB, prompts, tiny_lm

WINDOW = 12  # shorter than prompt + generation, so every sliding layer runs past it

BASE = dict(
    vocab_size=TINY_VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=512,
    initializer_range=0.3,
    bos_token_id=0,
    eos_token_id=1,
    pad_token_id=1,
    tie_word_embeddings=False,
)
ARCHITECTURES = {
    "llama": dict(num_key_value_heads=2),
    "qwen2": dict(
        num_key_value_heads=2, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1
    ),  # mixed layers
    "mistral": dict(num_key_value_heads=2, sliding_window=WINDOW),  # every layer sliding
    "gemma2": dict(num_key_value_heads=2, sliding_window=WINDOW, head_dim=16, query_pre_attn_scalar=16),  # alternating
    "phi3": dict(num_key_value_heads=2, sliding_window=WINDOW),
    "starcoder2": dict(num_key_value_heads=2, sliding_window=WINDOW),
    "qwen3": dict(num_key_value_heads=2, head_dim=16),
    "gpt_neox": dict(),
    "gpt2": dict(n_embd=64, n_layer=2, n_head=4, n_positions=512),
    "opt": dict(ffn_dim=128, word_embed_proj_dim=64),
    "falcon": dict(new_decoder_architecture=False, multi_query=True, alibi=False),
}


def tiny(arch: str, seed: int = 0) -> LoadedModel:
    config = AutoConfig.for_model(arch, **BASE, **ARCHITECTURES[arch])
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    return tiny_lm(model, f"tiny-{arch}-{seed}")


@pytest.fixture(scope="module", params=list(ARCHITECTURES))
def pair(request) -> tuple[LoadedModel, LoadedModel]:
    return tiny(request.param), tiny(request.param, seed=1)


# anpd and the draft model without their cost-aware cuts: the cuts follow timings measured at start-up, and
# this test needs drafts
@pytest.mark.parametrize("method", ["anpd:cost_aware=false", "anpd-tree", "lookahead", "draft:k=3,cost_aware=false"])
def test_every_architecture_decodes_exactly_past_its_window(pair, method) -> None:
    target, draft = pair
    decoder = Decoder(target, method, draft_model=draft if method.startswith("draft") else None)
    drafted = 0
    for prompt in prompts(4, seed=2):
        assert len(prompt) + 40 > WINDOW
        out = decoder.generate(prompt, max_new_tokens=40)
        assert out.token_ids == greedy_reference(target.model, prompt, 40), (target.name, method, prompt)
        drafted += out.stats.drafted_tokens
    assert drafted > 0  # the drafter really drafted, so verification and rollback ran


def test_trees_are_refused_under_an_attention_that_ignores_custom_masks() -> None:
    lm = tiny("llama")
    backend = TorchBackend(lm.model)
    backend.attention = "flash_attention_2"
    seq, _ = backend.prefill([5, 6, 7])
    with pytest.raises(InputError, match="custom mask"):
        backend.forward(seq, [8, 9, 10], tree=compile_tree((-1, -1)))


def test_layer_level_methods_refuse_sliding_windows() -> None:
    with pytest.raises(MethodError, match="sliding"):
        Decoder(tiny("mistral"), "layerskip:exit=1")
