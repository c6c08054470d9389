"""Model loading: local folders written by save_pretrained, GGUF files, presets, and every error."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from leapdecode import load_model, wrap
from leapdecode.engine.reference import greedy_reference
from leapdecode.errors import ModelLoadError
from leapdecode.models import presets
from tests.helpers import make_tiny_model

QUIET = dict(log=lambda msg: None)


def save_tiny_folder(tmp_path: Path, real_lm) -> Path:
    """A tiny random Llama with the real model's tokenizer, written as a hub-style folder."""
    model = make_tiny_model("llama", vocab=real_lm.model.config.vocab_size)
    model.generation_config.eos_token_id = 2
    folder = tmp_path / "tiny-llama"
    model.save_pretrained(folder)
    real_lm.tokenizer.save_pretrained(folder)
    return folder


def test_local_folder_loads_and_decodes_losslessly(tmp_path, real_lm) -> None:
    folder = save_tiny_folder(tmp_path, real_lm)
    lm = load_model(folder, cache_dir=tmp_path / "cache", **QUIET)
    assert lm.name == "tiny-llama"
    assert 2 in lm.eos_token_ids  # <|im_end|>, found through the chat template
    assert lm.max_context == 512
    prompt = "def add(a, b):\n    return a + b\n\ndef add(a, b):"
    plain = wrap(lm, "ar").generate(prompt, max_new_tokens=24)
    fast = wrap(lm, "anpd").generate(prompt, max_new_tokens=24)
    assert plain.token_ids == fast.token_ids
    # bfloat16 passes are not row-exact: a cached pass and the reference's uncached one may round a
    # near-tie apart (seen at the 24th token on a CPU with native bf16), so only a prefix must agree
    reference = greedy_reference(lm.model, plain.prompt_ids, 24, sorted(lm.eos_token_ids))
    assert plain.token_ids[:16] == reference[:16]


def test_unknown_model_names_the_presets(tmp_path) -> None:
    with pytest.raises(ModelLoadError, match="smollm2-135m"):
        load_model("no-such-model", cache_dir=tmp_path, **QUIET)
    with pytest.raises(ModelLoadError, match="no model given"):
        load_model("  ", cache_dir=tmp_path, **QUIET)


def test_unreachable_hub_id_is_a_clear_error(tmp_path, monkeypatch) -> None:
    import huggingface_hub.constants

    # huggingface_hub reads the variable when it is first imported, which an earlier test in this
    # process may have done: without the constant too, a hub id is retried for ~23 s before failing
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ModelLoadError, match="could not load model 'nobody/not-a-model'"):
        load_model("nobody/not-a-model", cache_dir=tmp_path, **QUIET)


def test_unknown_preset_and_missing_package(tmp_path) -> None:
    with pytest.raises(ModelLoadError, match="unknown preset"):
        presets.get_preset("gpt-17")
    fake = presets.Preset(
        name="fake",
        description="",
        packages=("leapdecode-no-such-package==1.0",),
        parts=("x/y.gguf",),
        sha256="0" * 64,
        size=1,
        hub_id="",
    )
    with pytest.raises(ModelLoadError, match="leapdecode models pull fake"):
        presets.assemble(fake, tmp_path, log=lambda m: None)


def test_checksum_mismatch_is_reported_and_nothing_is_marked_verified(tmp_path, real_lm) -> None:
    real = presets.get_preset("smollm2-135m")
    tampered = presets.Preset(
        name="tampered",
        description="",
        packages=real.packages,
        parts=real.parts,
        sha256="f" * 64,
        size=real.size,
        hub_id="",
    )
    with pytest.raises(ModelLoadError, match="checksum mismatch"):
        presets.assemble(tampered, tmp_path, log=lambda m: None)
    assert not list((tmp_path / "gguf").glob("tampered*.ok")) if (tmp_path / "gguf").exists() else True


def test_split_parts_are_concatenated_in_order_and_verified(tmp_path) -> None:
    """Assemble a two-part 'model' from files of an installed package (order matters)."""
    import hashlib
    import importlib.metadata

    dist = importlib.metadata.distribution("leapdecode")
    # Use two small files of this very package as the parts.
    part_names = ("leapdecode/errors.py", "leapdecode/__init__.py")
    located = [Path(str(dist.locate_file(p))) for p in part_names]
    if not all(p.is_file() for p in located):  # an editable install keeps files in the source tree
        root = Path(__file__).resolve().parents[1]
        located = [root / p for p in part_names]
    data = b"".join(p.read_bytes() for p in located)
    preset = presets.Preset(
        name="two-part",
        description="",
        packages=("leapdecode", "leapdecode"),
        parts=part_names,
        sha256=hashlib.sha256(data).hexdigest(),
        size=len(data),
        hub_id="",
    )
    # _part_paths resolves through package metadata; point it at the source files instead.
    original = presets._part_paths
    presets._part_paths = lambda p: located  # type: ignore[assignment]
    try:
        path = presets.assemble(preset, tmp_path, log=lambda m: None)
    finally:
        presets._part_paths = original  # type: ignore[assignment]
    assert path.read_bytes() == data
    swapped = presets.Preset(**{**preset.__dict__, "name": "swapped", "parts": part_names[::-1]})
    presets._part_paths = lambda p: located[::-1]  # type: ignore[assignment]
    try:
        with pytest.raises(ModelLoadError, match="checksum mismatch"):
            presets.assemble(swapped, tmp_path, log=lambda m: None)
    finally:
        presets._part_paths = original  # type: ignore[assignment]


def test_corrupt_and_truncated_gguf_files(tmp_path) -> None:
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"this is not a model")
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        load_model(garbage, cache_dir=tmp_path / "cache", **QUIET)
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\x00" * 10)
    with pytest.raises(ModelLoadError, match="could not read GGUF"):
        load_model(truncated, cache_dir=tmp_path / "cache", **QUIET)
    with pytest.raises(ModelLoadError, match="not found"):
        load_model(tmp_path / "missing.gguf", cache_dir=tmp_path / "cache", **QUIET)


def test_folders_that_are_not_causal_lms(tmp_path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_model(empty, cache_dir=tmp_path, **QUIET)
    vit = tmp_path / "vit"
    vit.mkdir()
    (vit / "config.json").write_text(json.dumps({"model_type": "vit", "hidden_size": 32}))
    with pytest.raises(ModelLoadError, match="not a causal language model"):
        load_model(vit, cache_dir=tmp_path, **QUIET)
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="could not load model"):
        load_model(broken, cache_dir=tmp_path, **QUIET)


def test_the_gguf_tensor_table_is_read_as_gguf_reads_it_and_a_cut_header_is_an_error(tmp_path) -> None:
    """`gguf_header` steps over the metadata (the tokenizer's 49,152 strings) instead of building it."""
    from gguf import GGUFReader

    from leapdecode.models.gguf_header import GGUFHeaderError, read_tensor_infos

    gguf = presets.locate("smollm2-135m", presets.Path(real_lm_cache_dir()), download=True, log=lambda m: None)
    reference = GGUFReader(str(gguf))
    want = [(t.name, tuple(int(n) for n in t.shape), t.tensor_type.value) for t in reference.tensors]
    assert [(t.name, t.shape, t.type_id) for t in read_tensor_infos(gguf)] == want and len(want) > 30
    header = gguf.read_bytes()[: reference.tensors[0].data_offset]
    for cut in (5, 20, 1_000, len(header) // 2, len(header) - 9):
        (tmp_path / "cut.gguf").write_bytes(header[:cut])
        with pytest.raises(GGUFHeaderError):
            read_tensor_infos(tmp_path / "cut.gguf")


def test_real_gguf_path_loads_as_the_preset_does(real_lm) -> None:
    """Loading the preset's GGUF by path reads its kept config, tokenizer and layers: the same model."""
    gguf = presets.locate("smollm2-135m", presets.Path(real_lm_cache_dir()), download=False, log=lambda m: None)
    lm = load_model(gguf, **QUIET)
    assert lm.name == "SmolLM2-135M-Instruct.Q4_1"
    assert lm.eos_token_ids == real_lm.eos_token_ids
    ids = torch.tensor([[1, 2, 3, 400, 5000]])
    with torch.inference_mode():
        assert torch.equal(lm.model(ids).logits, real_lm.model(ids).logits)


def real_lm_cache_dir() -> str:
    from leapdecode.models import default_cache_dir

    return str(default_cache_dir())


def test_dtype_names_auto_and_bad_values(tmp_path, real_lm, monkeypatch) -> None:
    import torch

    from leapdecode.models import hardware

    cpu = torch.device("cpu")
    monkeypatch.setattr(hardware, "cpu_flags", lambda: frozenset({"avx2", "avx512_bf16"}))
    assert hardware.hardware_of(cpu).native_bf16 and not hardware.hardware_of(cpu).native_fp16
    monkeypatch.setattr(hardware, "cpu_flags", lambda: frozenset({"avx2"}))  # bf16 would be emulated: slower
    assert not hardware.hardware_of(cpu).native_bf16
    monkeypatch.undo()
    with pytest.raises(ModelLoadError, match="unknown dtype 'fp8'"):
        load_model("smollm2-135m", dtype="fp8", **QUIET)
    folder = save_tiny_folder(tmp_path, real_lm)
    lm = load_model(folder, cache_dir=tmp_path / "cache", dtype="bfloat16", **QUIET)
    assert lm.dtype == "bfloat16" and lm.model.dtype is torch.bfloat16
    prompt = "def add(a, b):\n    return a + b\n\ndef add(a, b):"
    plain = wrap(lm, "ar").generate(prompt, max_new_tokens=24)
    assert wrap(lm, "anpd:cost_aware=false").generate(prompt, max_new_tokens=24).token_ids == plain.token_ids
    # bfloat16 passes are not row-exact: a cached pass and the reference's uncached one may round a
    # near-tie apart (seen at the 24th token on a CPU with native bf16), so only a prefix must agree
    reference = greedy_reference(lm.model, plain.prompt_ids, 24, sorted(lm.eos_token_ids))
    assert plain.token_ids[:16] == reference[:16]


def test_a_model_takes_a_tokenizer_read_from_the_same_files_instead_of_reading_it_again(tmp_path, real_lm) -> None:
    from leapdecode.models.model_info import same_tokenizer_files

    first = load_model(save_tiny_folder(tmp_path / "a", real_lm), **QUIET)
    same = save_tiny_folder(tmp_path / "b", real_lm)
    other = save_tiny_folder(tmp_path / "c", real_lm)
    config = json.loads((other / "tokenizer_config.json").read_text())
    (other / "tokenizer_config.json").write_text(json.dumps({**config, "model_max_length": 77}))
    assert same_tokenizer_files(first.tokenizer.name_or_path, same)
    assert not same_tokenizer_files(first.tokenizer.name_or_path, other)
    assert not same_tokenizer_files("HuggingFaceTB/SmolLM2-135M", same)  # a hub id: not compared
    shared = load_model(same, share_tokenizer=first, **QUIET)
    assert shared.tokenizer is first.tokenizer
    own = load_model(other, share_tokenizer=first, **QUIET)
    assert own.tokenizer is not first.tokenizer and own.tokenizer.model_max_length == 77
    assert load_model(same, **QUIET).tokenizer is not first.tokenizer  # nothing offered: its own
