"""Bit-exact verification by construction: the row-exact kernel against a float reference on
random shapes, and on the real model every row of every layer of a multi-token pass (chain and
tree) bitwise equal to one-token passes, so greedy drafting equals plain decoding exactly."""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from leapdecode import wrap
from leapdecode.engine import TorchBackend, compile_tree
from leapdecode.engine.batch import BatchItem, forward_batch
from leapdecode.errors import ModelLoadError
from leapdecode.models import load_model, row_exact
from leapdecode.models.row_exact import RowExactLinear, RowExactRMSNorm, use_row_exact


@pytest.fixture(scope="module")
def kernel():
    module = row_exact.kernel()
    assert module is not None, "the row-exact kernel must build where the tests run (a compiler is part of the set-up)"
    return module


@settings(max_examples=60, deadline=None)
@given(
    rows=st.one_of(st.integers(1, 16), st.integers(30, 80)),
    k=st.integers(1, 80),
    n=st.integers(1, 40),
    bias=st.booleans(),
    portable=st.booleans(),
    seed=st.integers(0, 2**16),
)
@example(
    rows=65, k=77, n=9, bias=True, portable=False, seed=0
)  # prefill rows: tiles of 3 rows x 4 outputs, a k tail, leftovers
def test_kernel_matches_a_float_reference_and_rows_are_bitwise_independent(
    kernel, rows, k, n, bias, portable, seed
) -> None:
    g = torch.Generator().manual_seed(seed)
    x, w = torch.randn(rows, k, generator=g), torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if bias else torch.empty(0)
    got = kernel.row_exact_linear(x, w, b, portable)  # [rows, n]
    want = x.double() @ w.double().T + (b.double() if bias else 0)
    assert torch.allclose(got.double(), want, atol=1e-4 * (k**0.5), rtol=1e-5)
    for i in range(rows):
        assert torch.equal(got[i], kernel.row_exact_linear(x[i : i + 1], w, b, portable)[0])


@settings(max_examples=80, deadline=None)
@given(
    rows=st.integers(1, 16),
    k=st.one_of(st.integers(1, 100), st.integers(640, 1400)),
    n=st.integers(1, 40),
    bias=st.booleans(),
    portable=st.booleans(),
    seed=st.integers(0, 2**16),
)
@example(rows=16, k=1400, n=7, bias=True, portable=False, seed=0)  # activations past 20 KB: outputs in threes
@example(rows=9, k=1399, n=5, bias=False, portable=False, seed=1)
def test_bf16_kernel_matches_a_float_reference_and_rows_are_bitwise_independent(
    kernel, rows, k, n, bias, portable, seed
) -> None:
    # k past 32 and not a multiple of it (the masked tail), rows past 8 (a second row block), n not
    # a multiple of 3 (outputs one by one after the groups), rows x k past the kernel's 20 KB (the
    # grouped path, against one-row calls on the other); `portable` forces the scalar path
    g = torch.Generator().manual_seed(seed)
    x, w = torch.randn(rows, k, generator=g).bfloat16(), torch.randn(n, k, generator=g).bfloat16()
    b = torch.randn(n, generator=g).bfloat16() if bias else torch.empty(0, dtype=torch.bfloat16)
    got = kernel.row_exact_linear(x, w, b, portable)  # [rows, n] bfloat16
    assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
    want = x.double() @ w.double().T + (b.double() if bias else 0)  # bf16 products are exact; one rounding at the end
    assert torch.allclose(got.double(), want, rtol=2**-8, atol=1e-5 * k)
    for i in range(rows):
        assert torch.equal(got[i], kernel.row_exact_linear(x[i : i + 1], w, b, portable)[0])


@pytest.mark.parametrize("masked", [False, True])
def test_long_inputs_attend_by_blocks_of_rows_with_the_same_bits(kernel, monkeypatch, masked) -> None:
    """A prefill scored whole past `PASS_ROWS` rows goes through the kernel by blocks of rows
    (bounded scratch space), each row as it is alone."""
    g = torch.Generator().manual_seed(3)
    query, key, value = (
        torch.randn(1, 4, 40, 16, generator=g),
        torch.randn(1, 2, 45, 16, generator=g),
        torch.randn(1, 2, 45, 16, generator=g),
    )
    module = torch.nn.Module()
    mask = (
        (torch.arange(45)[None, :] <= 5 + torch.arange(40)[:, None])[None, None] if masked else None
    )  # [1, 1, 40, 45]
    whole, _ = row_exact.row_exact_attention(module, query, key, value, mask, scaling=0.25)
    monkeypatch.setattr(row_exact, "PASS_ROWS", 7)
    blocks, _ = row_exact.row_exact_attention(module, query, key, value, mask, scaling=0.25)
    assert torch.equal(blocks, whole)


def test_linear_kernel_refuses_mixed_or_other_dtypes_and_shapes(kernel) -> None:
    x, w = torch.randn(2, 8).bfloat16(), torch.randn(3, 8).bfloat16()
    with pytest.raises(RuntimeError, match="of one dtype"):
        kernel.row_exact_linear(x.float(), w, torch.empty(0, dtype=torch.bfloat16), False)
    with pytest.raises(RuntimeError, match="of one dtype"):
        kernel.row_exact_linear(x, w, torch.zeros(2, dtype=torch.bfloat16), False)  # bias of the wrong length
    with pytest.raises(RuntimeError, match="of one dtype"):
        kernel.row_exact_linear(x.half(), w.half(), torch.empty(0, dtype=torch.half), False)
    with pytest.raises(RuntimeError, match=r"x \[M, K\]"):
        kernel.row_exact_linear(x, w[:, :4], torch.empty(0, dtype=torch.bfloat16), False)


@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(1, 16),
    past=st.integers(0, 80),
    kv_heads=st.integers(1, 3),
    group=st.integers(1, 3),
    dim=st.sampled_from([8, 12, 32, 64, 96, 128]),
    mask=st.sampled_from(["chain", "tree", "any"]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    seed=st.integers(0, 2**16),
)
# shared passes of four and of three rows (16 = 4 x 4, 7 = 4 + 3) in both dtypes, a width past 64 that
# is no multiple of 8 (the 512-bit block, then the tails), four rows over fewer than 8 keys, and one
# or two rows whose six heads a kv head shares go through together (runs of 4 + 2, 4 + 4 + 4)
@example(rows=16, past=80, kv_heads=2, group=3, dim=128, mask="chain", dtype=torch.bfloat16, seed=1)
# a long cache: a task takes its rows in tiles (18 to 56 rows, by the threads), chains, trees and any keys
@example(rows=60, past=2240, kv_heads=1, group=6, dim=128, mask="chain", dtype=torch.float32, seed=7)
@example(rows=60, past=2240, kv_heads=2, group=6, dim=128, mask="tree", dtype=torch.bfloat16, seed=8)
@example(rows=45, past=2240, kv_heads=1, group=6, dim=128, mask="any", dtype=torch.float32, seed=9)
@example(rows=1, past=80, kv_heads=2, group=6, dim=128, mask="chain", dtype=torch.float32, seed=5)
@example(rows=2, past=70, kv_heads=2, group=6, dim=128, mask="tree", dtype=torch.bfloat16, seed=6)
@example(rows=7, past=80, kv_heads=1, group=2, dim=96, mask="chain", dtype=torch.float32, seed=2)
@example(rows=5, past=40, kv_heads=2, group=2, dim=100, mask="chain", dtype=torch.float32, seed=3)
@example(rows=4, past=3, kv_heads=1, group=1, dim=64, mask="chain", dtype=torch.float32, seed=4)
def test_attention_kernel_matches_sdpa_and_rows_are_bitwise_independent(
    kernel, rows, past, kv_heads, group, dim, mask, dtype, seed
) -> None:
    """Chains (causal, no mask), trees (the whole cached prefix and some of the block) and any
    visible set: each row over exactly its keys, from strided views of a longer cache (in chunks of
    64 keys at 128 wide; rows that share their keys go through together; over a long cache, rows a
    tile at a time), bitwise the same alone or with the others, on both paths, however many threads split
    the heads; float32 and bfloat16 (computed in float, the output rounded once)."""
    g = torch.Generator().manual_seed(seed)
    heads, total = kv_heads * group, past + rows
    query = torch.randn(1, heads, rows, dim, generator=g).to(dtype)
    store = torch.randn(2, 1, kv_heads, total + 7, dim, generator=g).to(dtype)  # a cache with room to spare
    key, value = store[0][:, :, :total], store[1][:, :, :total]  # [1, kv_heads, total, dim] views
    masked = mask != "chain"
    if mask == "any":
        visible = torch.rand(rows, total, generator=g) < 0.6
        visible[:, 0] = True
    elif mask == "tree":
        visible = torch.ones(rows, total, dtype=torch.bool)
        visible[:, past:] = (torch.rand(rows, rows, generator=g) < 0.5).tril() | torch.eye(rows, dtype=torch.bool)
    else:
        visible = torch.arange(total)[None, :] <= past + torch.arange(rows)[:, None]  # [rows, total]
    scale = dim**-0.5
    got = kernel.row_exact_attention(
        query, key, value, visible if masked else None, scale, False
    )  # [1, rows, heads, dim]
    want = torch.nn.functional.scaled_dot_product_attention(
        query.double(), key.double(), value.double(), attn_mask=visible, scale=scale, enable_gqa=True
    ).transpose(1, 2)
    assert got.dtype == dtype and torch.allclose(got.double(), want, atol=1e-5 if dtype == torch.float32 else 1e-2)
    assert torch.equal(kernel.row_exact_attention(query, key, value, visible if masked else None, scale, True), got)
    threads = torch.get_num_threads()
    try:
        for n in (1, 3):  # other splits of the heads between tasks
            torch.set_num_threads(n)
            assert torch.equal(
                kernel.row_exact_attention(query, key, value, visible if masked else None, scale, False), got
            )
    finally:
        torch.set_num_threads(threads)
    for i in range(rows):
        if masked:
            one = kernel.row_exact_attention(query[:, :, i : i + 1], key, value, visible[i : i + 1], scale, False)
        else:
            one = kernel.row_exact_attention(
                query[:, :, i : i + 1], key[:, :, : past + i + 1], value[:, :, : past + i + 1], None, scale, False
            )
        assert torch.equal(one[0, 0], got[0, i])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_several_sequences_attend_in_one_call_each_bitwise_its_own(kernel, dtype) -> None:
    """`row_exact_attentions` (a packed pass's layer: one parallel region for every sequence):
    chains, a tree and a single row over caches of their own lengths, each output bitwise what
    its own `row_exact_attention` call gives, however many threads share the tasks."""
    g = torch.Generator().manual_seed(7)
    kv_heads, group, dim = 2, 3, 64
    calls = []
    for rows, past, tree in ((1, 40, False), (3, 0, False), (5, 17, True), (2, 90, False)):
        total = past + rows
        store = torch.randn(2, 1, kv_heads, total + 9, dim, generator=g).to(dtype)
        visible = None
        if tree:
            visible = torch.ones(rows, total, dtype=torch.bool)
            visible[:, past:] = (torch.rand(rows, rows, generator=g) < 0.5).tril() | torch.eye(rows, dtype=torch.bool)
        query = torch.randn(1, kv_heads * group, rows, dim, generator=g).to(dtype)
        calls.append((query, store[0][:, :, :total], store[1][:, :, :total], visible))
    want = [kernel.row_exact_attention(q, k, v, m, 0.125, False) for q, k, v, m in calls]
    threads = torch.get_num_threads()
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            got = kernel.row_exact_attentions(*(list(part) for part in zip(*calls)), 0.125, False)
            assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want))
    finally:
        torch.set_num_threads(threads)
    with pytest.raises(RuntimeError, match="per query"):
        kernel.row_exact_attentions([calls[0][0]], [calls[0][1]], [], [None], 0.125, False)


def test_attention_kernel_refuses_shapes_that_do_not_fit(kernel) -> None:
    query, key = torch.randn(1, 4, 2, 8), torch.randn(1, 3, 5, 8)
    with pytest.raises(RuntimeError, match="do not fit"):
        kernel.row_exact_attention(query, key, key, None, 1.0, False)  # 4 heads over 3 kv heads
    with pytest.raises(RuntimeError, match="visible"):
        kernel.row_exact_attention(query, key[:, :2], key[:, :2], torch.ones(2, 4, dtype=torch.bool), 1.0, False)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        kernel.row_exact_attention(query.bfloat16(), key, key, None, 1.0, False)  # dtypes that differ


@settings(max_examples=40, deadline=None)
@given(
    rows=st.integers(1, 16), dim=st.integers(1, 300), eps=st.sampled_from([1e-6, 1e-5, 0.1]), seed=st.integers(0, 2**16)
)
def test_rms_norm_kernel_matches_float64_and_rows_are_independent(kernel, rows, dim, eps, seed) -> None:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(1, rows, dim, generator=gen) * 5  # [1, rows, dim]
    w = torch.randn(dim, generator=gen)
    got = kernel.rms_norm(x, w, eps, False)
    xd = x.double()
    ref = w.double() * xd / torch.sqrt(xd.pow(2).mean(-1, keepdim=True) + eps)
    assert torch.allclose(got.double(), ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(kernel.rms_norm(x, w, eps, True), got)  # the portable path: the same bits
    for i in range(rows):
        assert torch.equal(kernel.rms_norm(x[:, i : i + 1], w, eps, False)[0, 0], got[0, i])
    with pytest.raises(RuntimeError, match="rms_norm"):
        kernel.rms_norm(x, w[:-1] if dim > 1 else torch.ones(2), eps, False)


class _GemmaStyleNorm(torch.nn.Module):
    """x / rms * (1 + weight): an RMS norm in name only, which the swap must leave alone."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(dim))
        self.eps = 1e-6

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * (1 + self.weight)


def test_rms_norms_are_swapped_by_behaviour_and_others_left_alone(kernel) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    model = LlamaForCausalLM(config).eval()
    for module in model.modules():
        if "RMSNorm" in type(module).__name__:
            torch.nn.init.normal_(module.weight)  # not all ones: the check must compare real scaling
    model.model.layers[1].post_attention_layernorm = _GemmaStyleNorm(32)
    model.model.layers[1].input_layernorm = torch.nn.LayerNorm(32)
    ids = torch.randint(0, 64, (1, 12))
    with torch.inference_mode():
        before = model(ids).logits
    keys = set(model.state_dict())
    use_row_exact(model)
    norms = [name for name, m in model.named_modules() if isinstance(m, RowExactRMSNorm)]
    assert norms == ["model.layers.0.input_layernorm", "model.layers.0.post_attention_layernorm", "model.norm"]
    assert isinstance(model.model.layers[1].post_attention_layernorm, _GemmaStyleNorm)
    assert isinstance(model.model.layers[1].input_layernorm, torch.nn.LayerNorm)
    assert set(model.state_dict()) == keys  # weights shared under their own names: save_pretrained unchanged
    with torch.inference_mode():
        after = model(ids).logits
    assert torch.allclose(before, after, atol=1e-4)


def test_fallback_without_a_kernel_is_exact_too(monkeypatch) -> None:
    layer = torch.nn.Linear(24, 10)
    exact = RowExactLinear(24, 10, device="meta")
    exact.weight, exact.bias = layer.weight, layer.bias
    x = torch.randn(1, 7, 24)
    fast = exact(x)
    monkeypatch.setattr(row_exact, "kernel", lambda: None)
    slow = exact(x)
    assert torch.allclose(fast, slow, atol=1e-5)
    for i in range(7):
        assert torch.equal(slow[0, i], exact(x[:, i : i + 1])[0, 0])


@pytest.fixture(
    scope="module",
    params=[("float32", "none"), ("float32", "int4"), ("bfloat16", "none")],
    ids=["float32", "int4", "bfloat16"],
)
def exact_lm(kernel, request):
    """The real model, row-exact: float32 weights, group-quantized int4 ones, and bfloat16 ones."""
    dtype, quantize = request.param
    return load_model("smollm2-135m", log=lambda m: None, row_exact=True, dtype=dtype, quantize=quantize)


@pytest.fixture(scope="module")
def plain_of():
    """Plain greedy decoding's tokens, computed once per (precision, prompt, length) in this module."""
    seen: dict[tuple[str, str, int], list[int]] = {}

    def plain(lm, prompt: str, max_new_tokens: int) -> list[int]:
        key = (lm.describe, prompt, max_new_tokens)
        if key not in seen:
            seen[key] = wrap(lm, "ar").generate(prompt, max_new_tokens=max_new_tokens).token_ids
        return seen[key]

    return plain


def layer_outputs(model, run) -> list[torch.Tensor]:
    """Every decoder layer's output during `run()` ([rows, hidden] each), through forward hooks."""
    seen: list[torch.Tensor] = []
    hooks = [
        layer.register_forward_hook(
            lambda _m, _i, out: seen.append((out[0] if isinstance(out, tuple) else out)[0].clone())
        )
        for layer in model.model.layers
    ]
    try:
        run()
    finally:
        for hook in hooks:
            hook.remove()
    return seen


@pytest.mark.parametrize("rows", [2, 4, 8, 16])
def test_every_row_of_every_layer_is_bitwise_a_one_token_pass(exact_lm, rows) -> None:
    # the model's own forward, whose layers the hooks see (the lean forward calls no layer module;
    # tests/test_lean.py checks it against this one)
    backend = TorchBackend(exact_lm.model, lean=False)
    ids = exact_lm.tokenizer("def fibonacci(n):\n    if n < 2:\n        return n\n" * 12)["input_ids"]
    context, tokens = 150, ids[150 : 150 + rows]
    num_layers = len(exact_lm.model.model.layers)
    with torch.inference_mode():
        seq, _ = backend.prefill(ids[:context])
        out: dict[str, torch.Tensor] = {}
        batched_layers = layer_outputs(exact_lm.model, lambda: out.update(logits=backend.forward(seq, tokens).logits))
        backend.rollback(seq, context)
        singles, single_layers = [], []
        for t in tokens:
            single_layers.append(
                layer_outputs(exact_lm.model, lambda t=t: singles.append(backend.forward(seq, [t]).logits[0]))
            )
    assert torch.equal(out["logits"], torch.stack(singles))
    for layer in range(num_layers):
        assert torch.equal(batched_layers[layer], torch.cat([single_layers[i][layer] for i in range(rows)])), layer


def test_a_tree_pass_scores_each_node_as_its_path_decoded_alone(exact_lm) -> None:
    backend = TorchBackend(exact_lm.model)
    ids = exact_lm.tokenizer("for i in range(10):\n    print(i)\n" * 6)["input_ids"]
    parents = (-1, -1, 0, 0, 1, 2)  # two roots, branching
    tokens = [ids[60], ids[61] + 1, ids[61], ids[62], ids[5], ids[62]]
    with torch.inference_mode():
        seq, _ = backend.prefill(ids[:60])
        tree_logits = backend.forward(
            seq, [ids[59] + 0, *tokens], tree=compile_tree(parents)
        ).logits  # root = pending token
        for node in range(1, len(tokens) + 1):
            path, at = [], node
            while at:
                path.insert(0, tokens[at - 1])
                at = parents[at - 1] + 1
            backend.rollback(seq, 60)
            last = None
            for t in [ids[59], *path]:
                last = backend.forward(seq, [t]).logits[0]
            assert torch.equal(tree_logits[node], last), node


@pytest.mark.parametrize("method", ["anpd:cost_aware=false", "anpd-tree", "lookahead"])
def test_greedy_drafting_on_the_row_exact_model_is_plain_decoding(exact_lm, plain_of, method) -> None:
    for prompt in [
        "def add(a, b):\n    return a + b\n\ndef sub(a, b):",
        "The capital of France is Paris. The capital of",
    ]:
        fast = wrap(exact_lm, method).generate(prompt, max_new_tokens=32)
        assert fast.token_ids == plain_of(exact_lm, prompt, 32)


@pytest.mark.parametrize("method", ["anpd:k=40,cost_aware=false", "anpd-tree:nodes=40,depth=12,width=4"])
def test_drafts_stay_inside_the_passes_the_kernel_scores_exactly(exact_lm, plain_of, method) -> None:
    """A decoding pass holds at most 16 rows (`EXACT_ROWS`, the attention kernel's fast range), so
    a longer chain or a bigger tree is cut to its first 15 drafted tokens: still lossless."""
    assert exact_lm.exact_tokens == 16
    prompt = "def add(a, b):\n    return a + b\n\n" * 8 + "def add(a, b):"
    fast = wrap(exact_lm, method).generate(prompt, max_new_tokens=48)
    assert fast.token_ids == plain_of(exact_lm, prompt, 48)
    drafted = [len(s.drafted) for s in fast.steps]
    assert max(drafted) == 15, drafted  # the method asked for more, the backend allowed 15


def test_row_exact_refuses_what_it_does_not_cover() -> None:
    with pytest.raises(ModelLoadError, match="row_exact runs float32 or bfloat16 on CPU, not float16"):
        load_model("smollm2-135m", log=lambda m: None, row_exact=True, dtype="float16")


def test_row_exact_is_the_default_on_cpu_float32_and_falls_back_clearly(real_lm_float32, monkeypatch) -> None:
    from leapdecode.models.linear import SmallBatchLinear

    lm = real_lm_float32
    assert lm.row_exact and any(isinstance(m, RowExactLinear) for m in lm.model.modules())
    monkeypatch.setattr(row_exact, "kernel", lambda: None)  # a machine where the kernel cannot build
    lm = load_model("smollm2-135m", log=lambda m: None, dtype="float32")
    assert not lm.row_exact and any(isinstance(m, SmallBatchLinear) for m in lm.model.modules())
    assert not any(isinstance(m, RowExactLinear) for m in lm.model.modules())


def test_bf16_models_are_row_exact_by_default_where_the_cpu_has_avx512_bf16(kernel, monkeypatch) -> None:
    lm = load_model("smollm2-135m", log=lambda m: None, dtype="bfloat16")
    layers = [m for m in lm.model.modules() if isinstance(m, torch.nn.Linear)]
    if not row_exact.bf16_linear_available():  # nn.Linear's oneDNN path stays (the portable one is slower)
        assert not lm.row_exact and all(type(m) is torch.nn.Linear for m in layers)
        return
    assert lm.row_exact and lm.describe.startswith("torch bfloat16 row-exact")
    assert layers and all(isinstance(m, RowExactLinear) for m in layers)
    g = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for module in {id(m): m for m in layers}.values():  # the real shapes (the LM head is the embedding)
            x = torch.randn(16, module.in_features, generator=g).bfloat16()  # [rows, in]
            got = module(x)  # [rows, out]
            assert torch.allclose(
                got.float(), torch.nn.functional.linear(x, module.weight, module.bias).float(), rtol=2e-2, atol=2e-2
            )
            for rows in (1, 3, 8):
                assert torch.equal(got[:rows], torch.cat([module(x[i : i + 1]) for i in range(rows)]))
    monkeypatch.setattr(row_exact, "bf16_linear_available", lambda: False)  # a CPU without AVX512-BF16
    other = load_model("smollm2-135m", log=lambda m: None, dtype="bfloat16")
    assert not other.row_exact
    assert all(type(m) is torch.nn.Linear for m in other.model.modules() if isinstance(m, torch.nn.Linear))


def test_the_real_model_packs_sequences_bitwise_in_float32_bfloat16_and_int4(exact_lm) -> None:
    backend = TorchBackend(exact_lm.model, exact_tokens=exact_lm.exact_tokens)
    assert backend.batchable is None
    ids = exact_lm.tokenizer("def fibonacci(n):\n    if n < 2:\n        return n\n" * 8)["input_ids"]
    plans = [
        (ids[:40], ids[40:48], None),
        (ids[10:90], ids[90:96], compile_tree((-1, 0, 0, 1, -1))),
        (ids[5:20], ids[20:21], None),
    ]
    alone = [backend.prefill(context)[0] for context, _, _ in plans]
    packed = [backend.prefill(context)[0] for context, _, _ in plans]
    prompt = ids[30:130]
    fresh = backend.new_sequence()
    items = [BatchItem(seq, tokens, tree) for seq, (_, tokens, tree) in zip(packed, plans)] + [
        BatchItem(fresh, prompt, last_only=True)
    ]
    scores = forward_batch(backend, items)
    for i, (seq, (_, tokens, tree)) in enumerate(zip(alone, plans)):
        assert torch.equal(scores[i].logits, backend.forward(seq, tokens, tree=tree).logits), i
    assert torch.equal(scores[-1].logits, backend.prefill(prompt)[1].logits)
    # the same prompt in chunks of 37 beside the others' next tokens (chunked prefill)
    chunked = backend.new_sequence()
    for start in range(0, len(prompt), 37):
        items = [
            BatchItem(chunked, prompt[start : start + 37], last_only=True),
            *(BatchItem(seq, [ids[1]]) for seq in packed),
        ]
        got = forward_batch(backend, items)[0]
    assert torch.equal(got.logits, scores[-1].logits)
    assert all(
        torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
        for a, b in zip(chunked.cache.layers, fresh.cache.layers)
    )
