"""A GGUF read tensor by tensor from its own blocks: every block type's layer is gguf-py's values,
every family transformers reads from a GGUF is transformers' model, and decoding on it lossless.

The files are written here with gguf-py's writer (`leapdecode.bench.synthetic_gguf`): random blocks with sane
scales, tiny shapes, any family, any mix of block types.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from leapdecode import wrap
from leapdecode.bench.synthetic_gguf import random_blocks, write_gguf
from leapdecode.errors import ModelLoadError
from leapdecode.models import gguf_blocks
from leapdecode.models.embedding import QuantizedEmbedding
from leapdecode.models.gguf_blocks import NATIVE_BITS, packed_layer, read_blocks, rows_of
from leapdecode.models.loading import load_model
from leapdecode.models.quantize import QuantizedLinear
from tests.test_quantize import check_against_reference_and_paths

QUIET = {"log": lambda m: None}
FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "phi3"]
K_TYPES = {"Q4_K", "Q6_K", "Q3_K", "IQ4_XS"}  # blocks of 256 weights


@pytest.fixture(scope="module")
def kernel():
    from leapdecode.models import quantize

    module = quantize.kernel()
    assert module is not None, "the quantized kernel must build where the tests run"
    return module


def dequantized(raw: np.ndarray, kind: str, rows: int, cols: int) -> torch.Tensor:
    from gguf import GGMLQuantizationType, dequantize

    return torch.from_numpy(dequantize(raw, GGMLQuantizationType[kind]).reshape(rows, cols))


@pytest.mark.parametrize("kind", sorted(NATIVE_BITS))
@pytest.mark.parametrize("rows", [1, 13, 40])
def test_every_native_block_type_is_gguf_pys_values_and_its_product_the_kernels(kernel, kind, rows) -> None:
    """Odd output counts (a partial block of 8) and several groups: the layer's weights bitwise
    gguf-py's de-quantization, its product the float reference's and every path's bits."""
    cols = 512 if kind in K_TYPES else 96
    raw = random_blocks(kind, rows, cols, np.random.default_rng(rows))
    want = dequantized(raw, kind, rows, cols)
    layer = packed_layer(rows_of(raw, rows), kind, rows, cols, None)
    assert layer is not None and layer.bits == NATIVE_BITS[kind]
    assert torch.equal(layer.weight_float(), want)
    check_against_reference_and_paths(kernel, layer, torch.randn(5, cols))


@pytest.mark.parametrize("kind", ["Q4_K", "Q5_0", "Q6_K"])
def test_conversion_by_slices_and_a_row_order_give_the_same_records(monkeypatch, kind) -> None:
    rows, cols = 37, 256
    raw = random_blocks(kind, rows, cols, np.random.default_rng(1))
    whole = packed_layer(rows_of(raw, rows), kind, rows, cols, None)
    monkeypatch.setattr(gguf_blocks, "CHUNK_ROWS", 8)
    assert torch.equal(packed_layer(rows_of(raw, rows), kind, rows, cols, None).packed, whole.packed)
    order = np.random.default_rng(2).permutation(rows)
    permuted = packed_layer(rows_of(raw, rows, order), kind, rows, cols, None)
    assert torch.equal(permuted.weight_float(), whole.weight_float()[torch.from_numpy(order)])


@pytest.mark.parametrize("kind", ["Q5_1", "Q5_K", "Q2_K"])
def test_types_without_a_kernel_layout_are_not_taken_as_blocks(kind) -> None:
    raw = random_blocks(kind, 8, 256, np.random.default_rng(0))
    assert read_blocks(raw, kind, 8, 256) is None and packed_layer(rows_of(raw, 8), kind, 8, 256, None) is None


def reference_model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)


@pytest.fixture(scope="module")
def family_files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("families")
    mixed = {"ffn_down": "Q6_K", "attn_v": "Q5_0", "token_embd": "Q4_K", "": "Q4_K"}
    return {arch: write_gguf(folder / f"{arch}.gguf", arch, mixed, seed=3) for arch in FAMILIES}


@pytest.mark.parametrize("arch", FAMILIES)
def test_each_family_is_transformers_model_of_the_same_file(family_files, tmp_path, arch) -> None:
    """Floats: transformers' own forward of the file, bit for bit. Quantized (the default): every
    linear weight and the embedding's rows bitwise what transformers de-quantized."""
    path = family_files[arch]
    reference = reference_model(path)
    ids = torch.tensor([[5, 80, 120, 3, 44, 200, 17]])
    floats = load_model(path, quantize="none", row_exact=False, small_batch_linear=False, cache_dir=tmp_path, **QUIET)
    with torch.inference_mode():
        assert torch.equal(floats.model(ids).logits, reference(ids).logits)
    quantized = load_model(path, cache_dir=tmp_path, **QUIET)
    assert quantized.quantize == "int4"
    modules = dict(reference.named_modules())
    layers = [(n, m) for n, m in quantized.model.named_modules() if isinstance(m, QuantizedLinear)]
    assert len(layers) == sum(isinstance(m, torch.nn.Linear) for m in reference.modules())
    for name, layer in layers:
        assert torch.equal(layer.weight_float(), modules[name].weight), name
    embedding = quantized.model.get_input_embeddings()
    want = reference.get_input_embeddings().weight
    assert torch.equal(embedding.dequantized() if isinstance(embedding, QuantizedEmbedding) else embedding.weight, want)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gemma2", "phi3"])
def test_decoding_a_gguf_family_is_lossless_with_anpd_and_a_draft_model(family_files, tmp_path, arch) -> None:
    target = load_model(family_files[arch], cache_dir=tmp_path, **QUIET)
    draft_file = write_gguf(tmp_path / "draft.gguf", arch, "Q8_0", seed=9)
    draft = load_model(draft_file, cache_dir=tmp_path, **QUIET)
    prompt = "the rain in spain is a rain in spain, the rain"
    for options in ({}, {"temperature": 0.9, "seed": 4}):
        plain = wrap(target, "ar").generate(prompt, max_new_tokens=24, **options).token_ids
        assert wrap(target, "anpd:n=3,k=4").generate(prompt, max_new_tokens=24, **options).token_ids == plain
        got = wrap(target, "draft:k=3", draft_model=draft).generate(prompt, max_new_tokens=24, **options).token_ids
        assert got == plain


def test_a_second_load_reads_the_kept_records_and_the_same_model(tmp_path) -> None:
    path = write_gguf(tmp_path / "q.gguf", "qwen2", {"ffn_down": "Q5_K", "": "Q4_K"}, seed=5)
    messages: list[str] = []
    first = load_model(path, cache_dir=tmp_path, log=messages.append)
    assert any("rounded to int8 (2 Q5_K)" in m for m in messages)  # no kernel layout: said so
    assert any("kept the quantized layers" in m for m in messages)
    kept = list((tmp_path / "quantized").glob("*.safetensors"))
    assert len(kept) == 1 and kept[0].stat().st_size < 1.2 * path.stat().st_size
    assert any(m.startswith("hashing") for m in messages)
    messages.clear()
    second = load_model(path, cache_dir=tmp_path, log=messages.append)
    assert not any("kept the quantized layers" in m for m in messages)  # nothing built again
    assert not any(m.startswith("hashing") for m in messages)  # its checksum kept by path, size and time
    ids = torch.tensor([[7, 9, 11, 200]])
    with torch.inference_mode():
        assert torch.equal(first.model(ids).logits, second.model(ids).logits)
    kept[0].write_bytes(kept[0].read_bytes()[:64])  # a corrupt cache is rebuilt, not raised
    third = load_model(path, cache_dir=tmp_path, **QUIET)
    with torch.inference_mode():
        assert torch.equal(third.model(ids).logits, first.model(ids).logits)


def test_an_untied_output_layer_takes_its_own_tensor(tmp_path) -> None:
    path = write_gguf(tmp_path / "untied.gguf", "llama", "Q8_0", seed=6, tied=False)
    lm = load_model(path, cache_dir=tmp_path, **QUIET)
    reference = reference_model(path)
    assert not reference.config.tie_word_embeddings
    assert torch.equal(lm.model.get_output_embeddings().weight_float(), reference.lm_head.weight)
    assert torch.equal(lm.model.get_input_embeddings().dequantized(), reference.get_input_embeddings().weight)


def test_a_block_type_that_can_be_neither_run_nor_de_quantized_is_named_before_any_weight(tmp_path) -> None:
    path = write_gguf(tmp_path / "q81.gguf", "llama", {"ffn_down": "Q8_1", "": "Q8_0"})
    with pytest.raises(ModelLoadError, match="block type Q8_1 can be neither run nor de-quantized"):
        load_model(path, cache_dir=tmp_path, **QUIET)
    assert not (tmp_path / "quantized").exists()


def test_an_unknown_architecture_is_a_clear_error_before_any_weight(tmp_path) -> None:
    path = write_gguf(tmp_path / "x.gguf", "llama", "Q8_0")
    data = bytearray(path.read_bytes())
    at = data.index(b"llama")  # general.architecture's value, the first "llama" in the file
    data[at : at + 5] = b"zzzzz"
    bad = tmp_path / "zzzzz.gguf"
    bad.write_bytes(bytes(data))
    with pytest.raises(ModelLoadError, match="zzzzz"):
        load_model(bad, cache_dir=tmp_path, **QUIET)


@pytest.mark.real_model
def test_a_cold_load_of_the_real_target_stays_under_twice_its_file(tmp_path) -> None:
    """qwen2.5-coder-1.5b (1.1 GB of Q4_K and Q6_K) with nothing kept yet: the peak resident memory
    of the whole process, Python and torch included, under twice the file's size."""
    import subprocess
    import sys

    from leapdecode.models.loading import default_cache_dir
    from leapdecode.models.presets import locate

    path = locate("qwen2.5-coder-1.5b", default_cache_dir(), download=True, log=lambda m: None)
    script = (  # the peak as VmHWM: getrusage's maxrss keeps the forking parent's (a loaded test worker)
        "from pathlib import Path; from leapdecode.models.loading import load_model; "
        f"lm = load_model({str(path)!r}, cache_dir={str(tmp_path)!r}, log=lambda m: None); "
        "line = next(l for l in Path('/proc/self/status').read_text().splitlines() if l.startswith('VmHWM'));"
        "print(int(line.split()[1]) * 1024)"
    )
    peak = int(subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout)
    assert peak < 2 * path.stat().st_size, (
        f"peak {peak / 2**30:.2f} GiB for a {path.stat().st_size / 2**30:.2f} GiB file"
    )
    kept = sum(f.stat().st_size for f in (tmp_path / "quantized").iterdir())
    assert kept < 1.2 * path.stat().st_size


@pytest.mark.parametrize("arch,tied", [("llama", False), ("qwen2", False), ("llama", True)])
def test_a_checkpoint_quantized_as_it_is_read_is_quantize_models_model(tmp_path, arch, tied) -> None:
    """A local folder with `quantize="int4"` is read tensor by tensor (the float model never whole):
    the same layers as `from_pretrained` then `quantize_model`, the same logits bit for bit."""
    from leapdecode.models.checkpoint_stream import load_quantized_checkpoint
    from leapdecode.models.quantize import quantize_model
    from tests.helpers import make_tiny_model

    model = make_tiny_model(arch, seed=7)
    if tied:  # the output layer saved as the embeddings, not in the files
        model.config.tie_word_embeddings = True
        model.tie_weights()
        assert model.lm_head.weight is model.get_input_embeddings().weight
    model.save_pretrained(tmp_path / "folder")
    messages: list[str] = []
    streamed = load_quantized_checkpoint(str(tmp_path / "folder"), model.config, "int4", messages.append)
    assert streamed is not None and any("tensor by tensor" in m for m in messages)
    quantize_model(model, "int4")
    ids = torch.tensor([[3, 17, 40, 2, 9]])
    with torch.inference_mode():
        assert torch.equal(streamed(ids).logits, model(ids).logits)
    kinds = {name: type(m) for name, m in streamed.named_modules()}
    assert kinds == {name: type(m) for name, m in model.named_modules()}


def test_a_large_vocabularys_config_and_tokenizer_are_read_in_processes_of_their_own_to_the_same_files(
    tmp_path, monkeypatch
) -> None:
    from leapdecode.models import gguf_model

    path = write_gguf(tmp_path / "t.gguf", "qwen2", "Q8_0")
    here = gguf_model.gguf_meta_folder(path, "a" * 64, tmp_path / "here", lambda m: None)
    started = []
    real = gguf_model._start
    monkeypatch.setattr(gguf_model, "SEPARATE_TOKENIZER", 1)
    monkeypatch.setattr(gguf_model, "_start", lambda *a: started.append(a[0]) or real(*a))
    there = gguf_model.gguf_meta_folder(path, "a" * 64, tmp_path / "there", lambda m: None)
    assert started == ["config", "tokenizer"]
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        assert (here / name).read_bytes() == (there / name).read_bytes(), name
