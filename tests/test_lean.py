"""The lean forward of a draft model (`models.lean`, `lean.cpp`): the model's own states, bitwise,
in one sequence and in packed passes, and the model's own forward wherever it does not reproduce it."""

from __future__ import annotations

import pytest
import torch

from leapdecode.engine.backend import cache_room
from leapdecode.engine.batch import BatchItem, forward_batch
from leapdecode.engine.draft_head import DraftHeadBackend
from leapdecode.models.lean import LeanDecoder
from leapdecode.models.quantize import QuantizedLinear, quantize_model
from leapdecode.models.row_exact import use_row_exact
from tests.helpers import TINY_VOCAB, make_tiny_model, prompts

VOCAB = tuple(range(0, TINY_VOCAB, 3)) + (1,)


def draft_path(arch: str, seed: int = 0, head_bits: int = 4):
    """A tiny model as the draft model's cheapest path loads it: int4 layers, row-exact."""
    model = make_tiny_model(arch, seed=seed)
    quantize_model(model, "int4", head_bits=head_bits)
    use_row_exact(model)
    return model


def pair(model):
    return DraftHeadBackend(model, VOCAB, exact_tokens=16), DraftHeadBackend(model, VOCAB, exact_tokens=16, lean=False)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_the_lean_forward_scores_bitwise_as_the_models_own_through_prefill_chains_and_rollback(arch) -> None:
    lean, own = pair(draft_path(arch))
    assert lean.lean is not None and lean.lean_reason == ""
    assert lean.lean.native is not None, "the C++ layers build here"
    assert own.lean is None
    prompt = prompts(1, seed=2)[0]
    with torch.inference_mode():
        (seq_l, first_l), (seq_o, first_o) = lean.prefill(prompt), own.prefill(prompt)
        assert torch.equal(first_l.logits, first_o.logits)
        assert cache_room(seq_l, 3) is not None, "after the prefill, chains take the C++ layers"
        for step, chain in enumerate([[5], [6, 7, 8], [9], [10, 11]]):
            got, want = lean.forward(seq_l, chain), own.forward(seq_o, chain)
            assert torch.equal(got.logits, want.logits), step
            assert seq_l.length == seq_o.length
            if len(chain) > 1:  # the draft's last tokens rejected
                lean.rollback(seq_l, seq_l.length - 1)
                own.rollback(seq_o, seq_o.length - 1)
        for index, layer in enumerate(seq_l.cache.layers):
            assert torch.equal(layer.keys, seq_o.cache.layers[index].keys)
            assert torch.equal(layer.values, seq_o.cache.layers[index].values)


def test_the_lean_forward_grows_its_cache_and_keeps_scoring_as_the_models_own() -> None:
    """A cache that fills (the buffers hold the prompt and 256 more) grows through the Python
    loop's `update`, and the C++ layers take the passes after it."""
    lean, own = pair(draft_path("qwen2", seed=3))
    prompt = prompts(1, seed=6)[0]
    with torch.inference_mode():
        seq_l, seq_o = lean.prefill(prompt)[0], own.prefill(prompt)[0]
        capacity = seq_l.cache.layers[0].buffers[0].shape[-2]
        grew = False
        for i in range(capacity - len(prompt) + 3):
            token = [(7 * i) % TINY_VOCAB]
            room = cache_room(seq_l, 1)
            grew |= room is None
            assert torch.equal(lean.forward(seq_l, token).logits, own.forward(seq_o, token).logits), i
        assert grew and seq_l.cache.layers[0].buffers[0].shape[-2] > capacity
        assert cache_room(seq_l, 1) is not None


@pytest.mark.parametrize("native", [True, False])
def test_the_lean_forwards_packed_pass_scores_each_sequence_as_its_own_pass(native, monkeypatch) -> None:
    """Chains, a tree and a prompt chunk side by side, each bitwise its own pass: through the one
    C++ call (every cache with room; the Python loop is then never called) and through the
    Python loop (a fresh sequence's first chunk has no buffers yet, so its pass takes the loop)."""
    from leapdecode.engine.backend import TorchBackend
    from leapdecode.engine.tree import compile_tree

    model = draft_path("qwen2", seed=1, head_bits=8)
    lean, own = TorchBackend(model, exact_tokens=16), TorchBackend(model, exact_tokens=16, lean=False)
    tree = compile_tree((-1, -1, 0, 1))  # the root, two children, a child of each: 5 tokens
    first, second, third, fourth = prompts(4, seed=5)
    with torch.inference_mode():
        alone = [own.prefill(p)[0] for p in (first, second, third, fourth[:5])]
        packed = [lean.prefill(p)[0] for p in (first, second, third, fourth[:5])]
        want = [
            own.forward(alone[0], [5, 6, 7]).logits,
            own.forward(alone[1], [9]).logits,
            own.forward(alone[2], [1, 2, 3, 4, 5], tree=tree).logits,
            own.forward(alone[3], list(fourth[5:])).logits[-1:],
        ]
        if native:  # the loop must not run: every cache has room
            monkeypatch.setattr(lean.lean, "forward", lambda *args: pytest.fail("the Python loop ran"))
        else:
            packed[3].cache.layers[0].buffers = None  # no room: the Python loop runs the pass and grows it
        got = forward_batch(
            lean,
            [
                BatchItem(packed[0], [5, 6, 7]),
                BatchItem(packed[1], [9]),
                BatchItem(packed[2], [1, 2, 3, 4, 5], tree=tree),
                BatchItem(packed[3], list(fourth[5:]), last_only=True),
            ],
        )
    for g, w in zip(got, want):
        assert torch.equal(g.logits, w)
    for seq_l, seq_o in zip(packed, alone):
        assert seq_l.length == seq_o.length
        for layer_l, layer_o in zip(seq_l.cache.layers, seq_o.cache.layers):
            assert torch.equal(layer_l.keys, layer_o.keys) and torch.equal(layer_l.values, layer_o.values)


def test_a_lean_forward_that_differs_from_the_models_own_is_not_used(monkeypatch) -> None:
    from leapdecode.models.lean import LeanDecoder as Decoder

    build = Decoder.build

    def wrong_scale(model):  # attention at the wrong temperature: other states
        decoder, reason = build(model)
        decoder.scale *= 1.5
        return decoder, reason

    monkeypatch.setattr(Decoder, "build", staticmethod(wrong_scale))
    lean, _ = pair(draft_path("llama"))
    assert lean.lean is None and "differ" in lean.lean_reason


def test_models_the_lean_forward_does_not_run_keep_their_own_forward() -> None:
    float_model = make_tiny_model("llama")
    use_row_exact(float_model)
    decoder, reason = LeanDecoder.build(float_model)
    assert decoder is None and "quantized kernels" in reason
    backend = DraftHeadBackend(float_model, VOCAB)
    assert backend.lean is None and "quantized kernels" in backend.lean_reason

    other = draft_path("llama")
    other.model.layers[0].mlp.act_fn = torch.nn.GELU()  # not a SwiGLU MLP
    assert LeanDecoder.build(other)[0] is None


def test_fused_projections_share_the_layers_memory_and_keep_each_outputs_bits() -> None:
    model = draft_path("qwen2")
    attention = model.model.layers[0].self_attn
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(0))  # [3, hidden]
    with torch.inference_mode():
        before = [attention.q_proj(x), attention.k_proj(x), attention.v_proj(x)]
    decoder, _ = LeanDecoder.build(model)
    assert decoder is not None
    (qkv,) = decoder.layers[0].attention_in
    assert isinstance(qkv, QuantizedLinear) and qkv.out_features == 64 + 32 + 32
    with torch.inference_mode():
        fused = qkv(x)
        after = [attention.q_proj(x), attention.k_proj(x), attention.v_proj(x)]
    assert torch.equal(fused, torch.cat(before, dim=-1))
    assert all(torch.equal(a, b) for a, b in zip(after, before))
    assert attention.q_proj.packed.data_ptr() == qkv.packed.data_ptr()
    again, _ = LeanDecoder.build(model)  # a second backend over the same model: no second copy
    assert again is not None and again.layers[0].attention_in[0].packed.data_ptr() == qkv.packed.data_ptr()
    with torch.inference_mode():
        assert torch.equal(again.layers[0].attention_in[0](x), fused)


def test_a_targets_chains_trees_and_packed_passes_score_as_its_own_forward() -> None:
    """The target's backend takes the lean forward for chains and packed passes (its own forward
    for trees and states), each bitwise the own forward's scores; a layer whose projections have
    different bits (a GGUF's 6-bit value projection) runs them unfused."""
    from leapdecode.engine.backend import TorchBackend
    from leapdecode.engine.tree import compile_tree

    model = draft_path("qwen2", seed=4, head_bits=8)
    attention = model.model.layers[1].self_attn
    attention.v_proj = QuantizedLinear.from_weight(attention.v_proj.weight_float(), 8, attention.v_proj.bias)
    lean, own = TorchBackend(model, exact_tokens=16), TorchBackend(model, exact_tokens=16, lean=False)
    assert lean.lean is not None and lean.lean.native is not None and own.lean is None
    assert [len(layer.attention_in) for layer in lean.lean.layers] == [1, 3]
    prompt, other = prompts(2, seed=8)
    tree = compile_tree((-1, -1, 0))  # the root, two children, a grandchild
    with torch.inference_mode():
        (seq_l, first_l), (seq_o, first_o) = lean.prefill(prompt), own.prefill(prompt)
        assert torch.equal(first_l.logits, first_o.logits)
        for chain in ([3], [4, 5, 6, 7], [8, 9]):
            assert torch.equal(lean.forward(seq_l, chain).logits, own.forward(seq_o, chain).logits)
        got, want = lean.forward(seq_l, [1, 2, 3, 4], tree=tree), own.forward(seq_o, [1, 2, 3, 4], tree=tree)
        assert torch.equal(got.logits, want.logits)
        lean.keep(seq_l, seq_l.length - 4, [0, 1])
        own.keep(seq_o, seq_o.length - 4, [0, 1])
        assert torch.equal(lean.forward(seq_l, [5]).logits, own.forward(seq_o, [5]).logits)
        packed, alone = lean.prefill(other)[0], own.prefill(other)[0]
        scored = forward_batch(lean, [BatchItem(seq_l, [6, 7]), BatchItem(packed, [8])])
        assert torch.equal(scored[0].logits, own.forward(seq_o, [6, 7]).logits)
        assert torch.equal(scored[1].logits, own.forward(alone, [8]).logits)


def test_a_sliding_window_keeps_the_models_own_forward() -> None:
    """A window the load-time check's short prompt would never reach: refused by the layout."""
    from leapdecode.engine.backend import TorchBackend

    model = draft_path("qwen2", seed=2, head_bits=8)
    model.config.layer_types = ["sliding_attention"] * len(model.model.layers)
    model.config.sliding_window = 8
    backend = TorchBackend(model, exact_tokens=16)
    assert backend.lean is None and "sliding" in backend.lean_reason
