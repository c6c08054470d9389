"""Group-quantized linear layers (int8, int4; scales per group or in super-blocks): the kernel
against a float reference on random shapes, rows bitwise independent of how many are scored
together, every path this CPU runs (portable, AVX2, AVX512-VNNI) bitwise the same, the packed
layouts round-trip, a GGUF's Q4_K is the super-block form exactly, and greedy drafting on quantized tiny models
equal to their plain decoding. (On the real model, every row of every layer and greedy drafting:
`test_row_exact.py`, int4 case.)"""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from leapdecode.drafters import AnpdDrafter, NoDrafter
from leapdecode.engine import StopCriteria, TorchBackend, decode
from leapdecode.errors import ModelLoadError
from leapdecode.models import load_model, quantize
from leapdecode.models.gguf_blocks import read_blocks
from leapdecode.models.packing import RECORD, pack, pack_super, packed_shape, unpack, unpack_super
from leapdecode.models.quantize import QuantizedLinear, quantize_model, quantize_through_cache
from leapdecode.models.rounding import (
    GROUP,
    SuperScales,
    dequantize,
    pack_int4,
    quantize_weight,
    quantize_weight_super,
    unpack_int4,
)
from leapdecode.models.row_exact import ATTENTION, register_attention
from tests.helpers import GREEDY, TINY_VOCAB, ScriptedDrafter, make_tiny_model, prompts


@pytest.fixture(scope="module")
def kernel():
    module = quantize.kernel()
    assert module is not None, "the quantized kernel must build where the tests run (a compiler is part of the set-up)"
    return module


def magnitude(layer: QuantizedLinear, x: torch.Tensor) -> torch.Tensor:
    """The sum of the absolute terms the kernel adds for each output (scale·q and the minimum
    apart): float32's rounding is relative to it, not to the result, which they may cancel to ~0."""
    qweight, scales, mins = layer.groups()
    weight = dequantize(qweight, scales.abs(), mins.abs(), 4) if mins is not None else layer.weight_float().abs()
    out = quantize._activations_reference(x).abs().double() @ weight.double().T
    return out + layer.bias.abs().double() if layer.bias is not None else out


def reference(layer: QuantizedLinear, x: torch.Tensor) -> torch.Tensor:
    """The same product in float64: activations rounded as the kernel rounds them, weights de-quantized."""
    out = quantize._activations_reference(x).double() @ layer.weight_float().double().T
    return out + layer.bias.double() if layer.bias is not None else out


@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(1, 40),
    groups=st.integers(1, 20),
    n=st.integers(1, 40),
    bits=st.sampled_from([4, 8]),
    super_blocks=st.booleans(),
    bias=st.booleans(),
    seed=st.integers(0, 2**16),
    spread=st.sampled_from([0.01, 1.0, 30.0]),
)
# past 2 rows the two-block (512-bit) kernel runs: odd and even block counts, each bit width
@example(rows=3, groups=10, n=24, bits=4, super_blocks=True, bias=False, seed=5, spread=1.0)
@example(rows=3, groups=9, n=16, bits=8, super_blocks=True, bias=True, seed=9, spread=1.0)
@example(rows=40, groups=9, n=40, bits=4, super_blocks=True, bias=True, seed=1, spread=1.0)
@example(rows=17, groups=3, n=16, bits=4, super_blocks=False, bias=False, seed=2, spread=30.0)
@example(rows=33, groups=9, n=24, bits=8, super_blocks=True, bias=True, seed=3, spread=1.0)
@example(rows=20, groups=2, n=40, bits=8, super_blocks=False, bias=True, seed=4, spread=0.01)
def test_kernel_matches_a_float_reference_rows_are_independent_and_paths_agree(
    kernel, rows, groups, n, bits, super_blocks, bias, seed, spread
) -> None:
    g = torch.Generator().manual_seed(seed)
    k = groups * GROUP
    linear = torch.nn.Linear(k, n, bias=bias)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(n, k, generator=g) * spread)
    if super_blocks:  # groups up to 20: full super-blocks of 8 and a shorter last one
        layer = QuantizedLinear.from_linear(linear, bits)
    else:
        layer = QuantizedLinear.from_groups(*quantize_weight(linear.weight, bits), bits, linear.bias)
    assert layer.super_blocks == super_blocks
    x = torch.randn(rows, k, generator=g) * spread
    x[0, :GROUP] = 0  # a group of zeros: scale 0, no division by it
    check_against_reference_and_paths(kernel, layer, x)


def check_against_reference_and_paths(kernel, layer: QuantizedLinear, x: torch.Tensor) -> None:
    """The kernel's product against the float64 reference, then every path this CPU runs bitwise
    the same, and every row alone bitwise the same as in the whole call."""
    fast = layer(x)  # [rows, n]
    want = reference(layer, x)
    assert ((fast.double() - want).abs() <= 1e-5 * magnitude(layer, x) + 1e-30).all()
    for isa in range(kernel.best_isa() + 1):  # portable, AVX2, AVX512-VNNI: the same bits
        layer.isa = isa
        assert torch.equal(layer(x), fast)
        for i in range(x.shape[0]):
            assert torch.equal(layer(x[i : i + 1])[0], fast[i])
    layer.isa = quantize.BEST


@settings(max_examples=30, deadline=None)
@given(
    rows=st.integers(1, 40),
    groups=st.integers(1, 20),
    n=st.integers(1, 40),
    bias=st.booleans(),
    seed=st.integers(0, 2**16),
)
@example(rows=40, groups=9, n=40, bias=True, seed=5)
@example(rows=19, groups=1, n=16, bias=False, seed=6)
@example(rows=3, groups=10, n=16, bias=True, seed=10)  # the two-block kernel's fewest rows, one pair
def test_six_bit_layers_match_a_float_reference_round_trip_and_paths_agree(kernel, rows, groups, n, bias, seed) -> None:
    """GGUF's Q6_K form (w = d·sc·(q − 32), an int8 sc per 16 weights) at any size, with the
    extreme weights and scales: the same checks, and the packed records give back q and factors."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 64, (n, groups * GROUP), generator=g).to(torch.uint8)
    q[0, :GROUP], q[-1, -GROUP:] = 0, 63
    sc = torch.randint(-128, 128, (n, 2 * groups), generator=g).to(torch.int8)
    sc[0, 0], sc[-1, -1] = -128, 127
    factors = SuperScales(torch.rand(n, -(-groups // 8), generator=g) * 0.01, sc, per_group=2)
    layer = QuantizedLinear.from_groups(q, factors, None, 6, torch.randn(n, generator=g) if bias else None)
    assert layer.super_blocks and layer.packed.shape == packed_shape(6, n, groups * GROUP, True)
    back, again = unpack_super(layer.packed, 6, n, groups)
    assert (
        torch.equal(back, q) and torch.equal(again.d, factors.d) and torch.equal(again.sc, sc) and again.per_group == 2
    )
    x = torch.randn(rows, groups * GROUP, generator=g) * 3
    x[-1, -GROUP:] = 127.0  # activations at their largest: the integer sums at their largest
    check_against_reference_and_paths(kernel, layer, x)


@settings(max_examples=40, deadline=None)
@given(
    rows=st.integers(1, 18),
    groups=st.integers(1, 40),
    seed=st.integers(0, 2**16),
    spread=st.sampled_from([1e-3, 1.0, 100.0]),
)
def test_activation_rounding_is_the_reference_on_both_paths(kernel, rows, groups, seed, spread) -> None:
    """The kernel's activation quantizer (vectorised, and split between threads for many groups)
    rounds every value exactly as the torch reference does: half-way cases to even, zero groups."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, groups * GROUP, generator=g) * spread
    x[0, :GROUP] = 0
    x[-1, -GROUP:] = torch.arange(GROUP) - 15.5  # with a max of 127 the scale is 1: exact half-way values
    x[-1, -1] = 127.0
    want = quantize._activations_reference(x)
    assert torch.equal(kernel.quantize_activations(x, False), want)
    assert torch.equal(kernel.quantize_activations(x, True), want)


def six_bit_layer(n: int, groups: int, g: torch.Generator, bias: bool) -> QuantizedLinear:
    """A random layer in GGUF's Q6_K form (the only 6-bit form)."""
    q = torch.randint(0, 64, (n, groups * GROUP), generator=g).to(torch.uint8)
    sc = torch.randint(-128, 128, (n, 2 * groups), generator=g).to(torch.int8)
    factors = SuperScales(torch.rand(n, -(-groups // 8), generator=g) * 0.01, sc, per_group=2)
    return QuantizedLinear.from_groups(q, factors, None, 6, torch.randn(n, generator=g) if bias else None)


@settings(max_examples=25, deadline=None)
@given(
    rows=st.integers(1, 20),
    groups=st.integers(1, 12),
    # (bits, super-block scales, outputs, bias) a layer
    forms=st.lists(
        st.tuples(st.sampled_from([4, 6, 8]), st.booleans(), st.integers(1, 30), st.booleans()), min_size=1, max_size=4
    ),
    seed=st.integers(0, 2**16),
)
@example(rows=9, groups=9, forms=[(4, True, 24, True), (4, True, 5, True), (6, True, 16, False)], seed=7)
# past 2 rows, 4-block layers: threads' ranges start inside a layer and pair its blocks two by two
@example(
    rows=8,
    groups=3,
    forms=[(4, True, 30, False), (8, False, 29, True), (6, True, 32, True), (4, False, 25, False)],
    seed=8,
)
def test_layers_of_one_input_in_one_call_give_each_layers_own_bits(kernel, rows, groups, forms, seed) -> None:
    """`quantized_linears` (a layer's projections in different forms, as a GGUF mixes Q4_K and
    Q6_K): one call's columns are bitwise each layer's own call on every path and with 1-3 threads
    splitting the blocks (a thread's range may start inside a layer), whatever the output counts
    (blocks cut short) and biases."""
    g = torch.Generator().manual_seed(seed)
    k = groups * GROUP
    layers = []
    for bits, super_blocks, n, bias in forms:
        if bits == 6:
            layers.append(six_bit_layer(n, groups, g, bias))
            continue
        weight, b = torch.randn(n, k, generator=g), torch.randn(n, generator=g) if bias else None
        if super_blocks:
            layers.append(QuantizedLinear.from_weight(weight, bits, b))
        else:
            layers.append(QuantizedLinear.from_groups(*quantize_weight(weight, bits), bits, b))
    x = torch.randn(rows, k, generator=g)
    want = torch.cat([layer(x) for layer in layers], dim=1)  # [rows, sum n]
    args = (
        [layer.packed for layer in layers],
        [layer.bits for layer in layers],
        [int(layer.super_blocks) for layer in layers],
        [layer.out_features for layer in layers],
        [layer.bias for layer in layers],
    )
    threads = torch.get_num_threads()
    try:
        for count in (1, 2, 3):
            torch.set_num_threads(count)
            for isa in range(kernel.best_isa() + 1):
                assert torch.equal(kernel.quantized_linears(x, *args, isa), want)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(kernel.quantized_linears(x[None], *args, -1)[0], want)  # leading dimensions kept


def test_layers_in_one_call_refuse_lists_that_do_not_match(kernel) -> None:
    layer = QuantizedLinear.from_weight(torch.randn(16, 64), 4)
    x = torch.randn(2, 64)
    with pytest.raises(RuntimeError, match="one packed tensor"):
        kernel.quantized_linears(x, [layer.packed], [4, 4], [1], [16], [None], -1)
    with pytest.raises(RuntimeError, match=r"\(layer 1\): packed uint8 .* bytes per block"):
        kernel.quantized_linears(x, [layer.packed, layer.packed], [4, 4], [1, 1], [16, 24], [None, None], -1)
    with pytest.raises(RuntimeError, match=r"\(layer 0\): out_features must be positive"):
        kernel.quantized_linears(x, [layer.packed], [4], [1], [0], [None], -1)
    with pytest.raises(RuntimeError, match="positive multiple of 32"):
        kernel.quantized_linears(torch.randn(2, 40), [layer.packed], [4], [1], [16], [None], -1)
    with pytest.raises(RuntimeError, match="positive multiple of 32"):
        kernel.quantized_linear(torch.randn(2, 0), layer.packed, 4, True, 16, None, -1)


@pytest.mark.parametrize("bits", [4, 8])
def test_quantized_weights_are_within_half_a_step_and_pack_round_trips(bits) -> None:
    w = torch.randn(48, 4 * GROUP) * torch.logspace(-3, 1, 48).unsqueeze(1)
    qweight, scales, mins = quantize_weight(w, bits)
    back = dequantize(qweight, scales, mins, bits)
    step = scales.repeat_interleave(GROUP, dim=1)  # [48, k]
    assert ((back - w).abs() <= step / 2 * 1.0001 + 1e-7).all()
    q = torch.randint(0, 16, (5, 3, GROUP), dtype=torch.uint8)
    assert torch.equal(unpack_int4(pack_int4(q)), q)


@pytest.mark.parametrize("bits", [4, 8])
def test_super_block_rounding_is_within_half_a_step_of_its_own_scales(bits) -> None:
    """The factors first, then the weights against the scales as the kernel computes them: every
    weight within half a step, and no group's range cut off (minimums rounded down, scales up)."""
    w = torch.randn(48, 20 * GROUP, generator=torch.Generator().manual_seed(81)) * torch.logspace(-3, 1, 48).unsqueeze(
        1
    )
    w[:, :GROUP] += 5.0  # a group far from zero: its minimum is positive
    qweight, factors = quantize_weight_super(w, bits)
    scales, mins = factors.scales(), factors.mins()
    assert factors.d.shape == (48, 3) and factors.sc.dtype == torch.uint8 and (mins is None) == (bits == 8)
    back = dequantize(qweight, scales, mins, bits)
    step = scales.repeat_interleave(GROUP, dim=1)  # [48, k]
    assert ((back - w).abs() <= step / 2 * 1.0001 + 1e-6 * w.abs() + 1e-7).all()  # + a few float32 steps of w (~5 here)
    plain = dequantize(*quantize_weight(w, bits), bits)  # per-group float scales: finer, not by much
    assert (back - w).abs().mean() < 1.5 * (plain - w).abs().mean()


@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 30), groups=st.integers(1, 20), bits=st.sampled_from([4, 8]), seed=st.integers(0, 2**16))
def test_super_block_records_round_trip_to_the_factors(n, groups, bits, seed) -> None:
    """Any output and group count (a shorter last super-block): unpack_super(pack_super(...)) is
    the weights and factors, bit for bit, and the layer gives the same groups."""
    g = torch.Generator().manual_seed(seed)
    qweight, factors = quantize_weight_super(torch.randn(n, groups * GROUP, generator=g), bits)
    packed = pack_super(qweight, factors, bits)
    assert packed.shape == packed_shape(bits, n, groups * GROUP, True) and packed.dtype == torch.uint8
    back, again = unpack_super(packed, bits, n, groups)
    assert torch.equal(back, qweight)
    for name in ("d", "sc", "dmin", "m"):
        want, got = getattr(factors, name), getattr(again, name)
        assert (want is None) == (got is None) and (want is None or torch.equal(want, got)), name
    layer = QuantizedLinear(packed, bits, n, groups * GROUP, None, super_blocks=True)
    assert all(torch.equal(a, b) for a, b in zip(layer.groups()[:2], (qweight, factors.scales())))
    with pytest.raises(ValueError, match="do not fit"):
        QuantizedLinear(packed, bits, n, groups * GROUP, None)  # the per-group form's shape differs


@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 30), groups=st.integers(1, 4), bits=st.sampled_from([4, 8]), seed=st.integers(0, 2**16))
def test_packed_records_round_trip_to_the_groups(n, groups, bits, seed) -> None:
    """Any output count (padded to blocks of 8): unpack(pack(groups)) is the groups, bit for bit."""
    g = torch.Generator().manual_seed(seed)
    qweight, scales, mins = quantize_weight(torch.randn(n, groups * GROUP, generator=g), bits)
    packed = pack(qweight, scales, mins, bits)
    assert packed.shape == (-(-n // 8), groups, RECORD[bits]) and packed.dtype == torch.uint8
    back = unpack(packed, bits, n)
    assert torch.equal(back[0], qweight) and torch.equal(back[1], scales)
    assert (back[2] is None) == (mins is None) and (mins is None or torch.equal(back[2], mins))
    with pytest.raises(ValueError, match="do not fit"):
        QuantizedLinear(packed, bits, n + 8, groups * GROUP, None)


@pytest.mark.parametrize("nbytes", [0, 5, 2**21 - 1, 2**21, 3 * 2**21 + 7])
def test_huge_page_copies_hold_the_same_bytes_in_their_own_memory(kernel, nbytes) -> None:
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    copy = kernel.huge_page_copy(src)
    assert torch.equal(copy, src) and (nbytes == 0 or copy.data_ptr() != src.data_ptr())
    if nbytes >= 2**21:  # 2 MiB and more: aligned to a huge page
        assert copy.data_ptr() % 2**21 == 0
    src.zero_()
    assert nbytes == 0 or copy.any()  # not a view of the source
    with pytest.raises(RuntimeError, match="contiguous"):
        kernel.huge_page_copy(torch.zeros(4, 4, dtype=torch.uint8).T)


def test_a_large_layer_keeps_its_weights_in_huge_pages_and_computes_the_same(kernel) -> None:
    layer = QuantizedLinear.from_linear(torch.nn.Linear(2048, 2048), 8)  # 4.4 MB packed
    assert layer.packed.data_ptr() % 2**21 == 0
    x = torch.randn(3, 2048)
    y = layer(x)
    layer.packed = layer.packed.clone()  # the same bytes in torch's own allocation
    assert torch.equal(y, layer(x))


def test_bad_shapes_and_modes_are_refused() -> None:
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_weight(torch.randn(4, 40), 4)
    with pytest.raises(ValueError, match="bits"):
        quantize_weight(torch.randn(4, 64), 3)
    with pytest.raises(ValueError, match="unknown quantization"):
        quantize_model(torch.nn.Sequential(torch.nn.Linear(64, 8)), "int2")
    model = make_tiny_model("llama", seed=3)
    with pytest.raises(ValueError, match="head_bits"):
        quantize_model(model, "int4", head_bits=6)
    assert not any(isinstance(m, QuantizedLinear) for m in model.modules())  # refused before any swap


@pytest.mark.parametrize("head_bits", [8, 4])
def test_the_output_layer_stays_int8_unless_asked_for_four_bits(head_bits) -> None:
    model = make_tiny_model("llama", seed=3)
    quantize_model(model, "int4", head_bits=head_bits)
    head = model.get_output_embeddings()
    assert isinstance(head, QuantizedLinear) and head.bits == head_bits
    assert {m.bits for m in model.modules() if isinstance(m, QuantizedLinear) and m is not head} == {4}


def test_a_cache_is_written_once_read_back_whole_and_only_spares_time(tmp_path) -> None:
    """`quantize_through_cache`: the first load rounds and writes (removing an older layout), the
    next reads every layer back, the same bytes; a cache that cannot be written is logged and
    the model quantized all the same."""

    def records(model: torch.nn.Module) -> dict[str, torch.Tensor]:
        return {n: m.packed for n, m in model.named_modules() if isinstance(m, QuantizedLinear)}

    def swap_into(model: torch.nn.Module, seen: list[bool]):
        def swap(read_back: bool) -> int:
            seen.append(read_back)
            return quantize_model(model, "int4")

        return swap

    saved, older = tmp_path / "tiny-int4-v2.safetensors", tmp_path / "tiny-int4-v1.safetensors"
    older.write_bytes(b"an older layout")
    first, seen, log = make_tiny_model("llama", seed=3), [], []
    assert not quantize_through_cache(first, saved, "tiny-int4-v*.safetensors", swap_into(first, seen), log.append)
    assert seen == [False] and saved.is_file() and not older.exists() and "saved" in log[-1]
    second, seen = make_tiny_model("llama", seed=3), []
    assert quantize_through_cache(second, saved, "tiny-int4-v*.safetensors", swap_into(second, seen), log.append)
    assert seen == [True]  # asked for what the file left out: nothing
    a, b = records(first), records(second)
    assert a.keys() == b.keys() and len(a) > 0 and all(torch.equal(a[n], b[n]) for n in a)
    (tmp_path / "a-file").write_text("not a folder")
    third, log = make_tiny_model("llama", seed=3), []
    unwritable = tmp_path / "a-file" / "tiny-int4-v2.safetensors"
    assert not quantize_through_cache(third, unwritable, "*", swap_into(third, []), log.append)
    assert "could not keep" in log[-1] and records(third).keys() == a.keys()


def test_without_a_compiler_the_layers_compute_the_same_product(monkeypatch) -> None:
    layer = QuantizedLinear.from_linear(torch.nn.Linear(96, 24), 4)
    x = torch.randn(2, 5, 96)
    fast = layer(x)
    monkeypatch.setattr(quantize, "kernel", lambda: None)
    slow = layer(x)
    assert torch.allclose(fast, slow, atol=1e-4)


def quantized_tiny(arch: str, mode: str):
    model = make_tiny_model(arch, seed=3)
    quantize_model(model, mode)
    register_attention()
    model.set_attn_implementation(ATTENTION)
    return model


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: biases on q/k/v
@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_greedy_drafting_on_quantized_tiny_models_equals_plain_decoding(arch, mode) -> None:
    model = quantized_tiny(arch, mode)
    assert not any(type(m) is torch.nn.Linear for m in model.modules())
    backend = TorchBackend(model)

    def run(prompt, drafter, n):
        return [t for s in decode(backend, prompt, drafter, StopCriteria(frozenset(), n), *GREEDY) for t in s.tokens]

    accepted = 0
    for seed, prompt in enumerate(prompts(8, seed=7)):
        plain = run(prompt, NoDrafter(), 32)  # (an uncached recompute may differ: long prefills take SDPA's block)
        assert run(prompt, AnpdDrafter(n=3, k=7), 32) == plain
        for wrong_every in (0, 1, 2):  # drafts all right, all wrong, partly right
            steps = list(
                decode(
                    backend,
                    prompt,
                    ScriptedDrafter(plain, 8, TINY_VOCAB, wrong_every, seed),
                    StopCriteria(frozenset(), 32),
                    *GREEDY,
                )
            )
            assert [t for s in steps for t in s.tokens] == plain
            accepted += sum(s.num_accepted for s in steps)
    assert accepted > 0


@pytest.fixture(scope="module")
def int4_lm(kernel):
    return load_model("smollm2-135m", log=lambda m: None, quantize="int4")


def test_the_real_model_quantizes_every_layer_and_says_so(int4_lm) -> None:
    layers = [m for m in int4_lm.model.modules() if isinstance(m, QuantizedLinear)]
    assert len(layers) == 30 * 7 + 1 and not any(type(m) is torch.nn.Linear for m in int4_lm.model.modules())
    assert int4_lm.model.get_output_embeddings().bits == 8 and {m.bits for m in layers} == {4, 8}
    assert int4_lm.quantize == "int4" and int4_lm.describe.startswith("torch int4 row-exact")
    float_lm = load_model("smollm2-135m", log=lambda m: None, quantize="none")
    assert float_lm.fingerprint != int4_lm.fingerprint
    int8_lm = load_model("smollm2-135m", log=lambda m: None, quantize="int8")
    assert {m.bits for m in int8_lm.model.modules() if isinstance(m, QuantizedLinear)} == {8}
    assert load_model("smollm2-135m", log=lambda m: None, quantize="auto").quantize == "int4"  # on CPU in float32
    assert load_model("smollm2-135m", log=lambda m: None, quantize="auto", dtype="bfloat16").quantize == "none"


def test_quantize_refuses_what_it_does_not_cover() -> None:
    with pytest.raises(ModelLoadError, match="unknown quantization"):
        load_model("smollm2-135m", log=lambda m: None, quantize="int3")
    with pytest.raises(ModelLoadError, match="compute in float32"):
        load_model("smollm2-135m", log=lambda m: None, quantize="int4", dtype="bfloat16")
    with pytest.raises(ModelLoadError, match="llama.cpp backend runs the GGUF's own quantization"):
        load_model("smollm2-135m", log=lambda m: None, quantize="int4", backend="llama.cpp")


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0", "Q4_1"])
def test_gguf_blocks_are_the_files_values(kind) -> None:
    from gguf import GGMLQuantizationType, dequantize, quants

    w = (torch.randn(6, 4 * GROUP) * 3).numpy()
    raw = quants.quantize(w, GGMLQuantizationType[kind])
    blocks = read_blocks(raw, kind, 6, 4 * GROUP)
    assert blocks is not None and blocks.bits == (8 if kind == "Q8_0" else 4)
    mine = dequantize_blocks(blocks)
    want = torch.from_numpy(dequantize(raw, GGMLQuantizationType[kind]).reshape(6, -1))
    assert torch.allclose(mine, want, rtol=1e-6, atol=1e-6)
    assert read_blocks(raw, "Q5_K", 6, 4 * GROUP) is None  # a layout that does not fit


@pytest.mark.real_model  # reads the packaged model's GGUF
def test_q4_k_blocks_of_the_real_file_are_its_values() -> None:
    """The file's Q4_K groups, and the super-block form of their scales bit for bit the file's
    products (so a layer of them is the file's model, in 25 % fewer bytes than per-group floats)."""
    from gguf import GGUFReader, dequantize

    from leapdecode.models.loading import default_cache_dir
    from leapdecode.models.presets import locate

    reader = GGUFReader(str(locate("qwen2.5-coder-1.5b", default_cache_dir(), download=True)))
    tensor = next(
        t for t in reader.tensors if t.tensor_type.name == "Q4_K" and len(t.shape) == 2 and t.shape[1] <= 2048
    )
    cols, rows = (int(n) for n in tensor.shape)
    blocks = read_blocks(tensor.data, "Q4_K", rows, cols)
    want = torch.from_numpy(dequantize(tensor.data, tensor.tensor_type).reshape(rows, cols))
    assert torch.allclose(dequantize_blocks(blocks), want, rtol=1e-6, atol=1e-6)
    assert isinstance(blocks.factors, SuperScales)
    assert torch.equal(blocks.factors.scales(), blocks.scales) and torch.equal(blocks.factors.mins(), blocks.mins)
    layer = blocks.layer(None)
    assert layer.super_blocks and torch.equal(layer.weight_float(), dequantize_blocks(blocks))
    assert layer.packed.numel() < 0.8 * QuantizedLinear.from_groups(*blocks.groups(), 4, None).packed.numel()


@pytest.mark.real_model  # reads the packaged model's GGUF
def test_q6_k_blocks_of_the_real_file_are_its_values_bit_for_bit(kernel) -> None:
    """The 1.5B's Q6_K tensors (a value projection here; its output layer, half its down
    projections) become 6-bit layers whose weights are the file's, bit for bit."""
    from gguf import GGUFReader, dequantize

    from leapdecode.models.loading import default_cache_dir
    from leapdecode.models.presets import locate

    reader = GGUFReader(str(locate("qwen2.5-coder-1.5b", default_cache_dir(), download=True)))
    tensor = next(
        t for t in reader.tensors if t.tensor_type.name == "Q6_K" and len(t.shape) == 2 and t.shape[1] <= 2048
    )
    cols, rows = (int(n) for n in tensor.shape)
    blocks = read_blocks(tensor.data, "Q6_K", rows, cols)
    want = torch.from_numpy(dequantize(tensor.data, tensor.tensor_type).reshape(rows, cols))
    assert blocks.bits == 6 and torch.equal(dequantize_blocks(blocks), want)
    layer = blocks.layer(None)
    assert layer.bits == 6 and torch.equal(layer.weight_float(), want)
    x = torch.randn(3, cols)
    check_against_reference_and_paths(kernel, layer, x)


def dequantize_blocks(blocks) -> torch.Tensor:
    qweight, scales, mins = blocks.groups()
    return dequantize(qweight, scales, mins, blocks.bits)


def test_a_gguf_model_quantizes_to_the_files_own_groups(int4_lm, real_lm_float32) -> None:
    """smollm2's GGUF is Q4_1 with a Q8_0 embedding (the tied LM head): every layer comes from the
    file, and de-quantized it is the float model's weight."""
    float_layers = dict(real_lm_float32.model.named_modules())
    for name, layer in int4_lm.model.named_modules():
        if isinstance(layer, QuantizedLinear):
            reference_weight = float_layers[name].weight.float()
            assert torch.allclose(layer.weight_float(), reference_weight, rtol=0, atol=1e-6), name


def test_saved_quantized_layers_load_back_identically_and_a_corrupt_file_is_ignored(tmp_path) -> None:
    from leapdecode.models.quantize import load_quantized, save_quantized

    model = make_tiny_model("qwen2", seed=4)
    quantize_model(model, "int4")
    path = tmp_path / "q.safetensors"
    save_quantized(model, path)
    fresh = make_tiny_model("qwen2", seed=4)
    assert load_quantized(fresh, path) == sum(isinstance(m, QuantizedLinear) for m in model.modules())
    x = torch.randint(2, TINY_VOCAB, (1, 9))
    with torch.inference_mode():
        assert torch.equal(fresh(x).logits, model(x).logits)
    path.write_bytes(path.read_bytes()[:100])  # truncated
    other = make_tiny_model("qwen2", seed=4)
    assert load_quantized(other, path) == 0
    assert not any(isinstance(m, QuantizedLinear) for m in other.modules())
