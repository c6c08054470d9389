"""What runs without flags: `resolve_precision` over every source × hardware × choice, and
`load_model`'s defaults on real sources (a GGUF preset, a folder written by `save_pretrained`)."""

from __future__ import annotations

import json

import pytest

from leapdecode.errors import ModelLoadError
from leapdecode.models.precision import Hardware, Precision, Source, checkpoint_dtype, resolve_precision

AVX2 = Hardware("cpu", native_bf16=False, native_fp16=False)
ZEN4 = Hardware("cpu", native_bf16=True, native_fp16=False)
GPU = Hardware("cuda", native_bf16=True, native_fp16=True)
OLD_GPU = Hardware("cuda", native_bf16=False, native_fp16=True)

GGUF_Q4 = Source(gguf_quantized=True, dtype="float32")  # a de-quantized GGUF's folder says float32
BF16 = Source(dtype="bfloat16")
FP16 = Source(dtype="float16")
FP32 = Source(dtype="float32")
UNSAID = Source(dtype=None)


def what(source: Source, hardware: Hardware, dtype: object = "auto", quantize: str | None = "auto") -> tuple[str, str]:
    p = resolve_precision(source, hardware, dtype, quantize)
    assert isinstance(p, Precision) and p.reason
    return p.dtype, p.quantize


@pytest.mark.parametrize(
    ("source", "hardware", "expected"),
    [
        # a GGUF runs its own blocks on any CPU: the model as shipped
        (GGUF_Q4, AVX2, ("float32", "int4")),
        (GGUF_Q4, ZEN4, ("float32", "int4")),
        # ... and de-quantized where the kernels do not run, in float32 (exact de-quantization)
        (GGUF_Q4, GPU, ("float32", "none")),
        # a checkpoint runs its own dtype where it is native, else float32
        (BF16, ZEN4, ("bfloat16", "none")),
        (BF16, AVX2, ("float32", "none")),
        (BF16, GPU, ("bfloat16", "none")),
        (BF16, OLD_GPU, ("float32", "none")),
        (FP16, ZEN4, ("float32", "none")),
        (FP16, GPU, ("float16", "none")),
        (FP32, ZEN4, ("float32", "none")),
        (FP32, GPU, ("float32", "none")),
        (UNSAID, ZEN4, ("float32", "none")),
    ],
)
def test_defaults_follow_the_source_and_the_hardware(
    source: Source, hardware: Hardware, expected: tuple[str, str]
) -> None:
    assert what(source, hardware) == expected
    assert what(source, hardware, "AUTO", None) == expected  # None and case are the same choice


def test_choices_override() -> None:
    # a dtype alone means that dtype, not quantized, whatever the source
    assert what(GGUF_Q4, ZEN4, "float32") == ("float32", "none")
    assert what(GGUF_Q4, ZEN4, "bfloat16") == ("bfloat16", "none")
    assert what(BF16, AVX2, "bfloat16") == ("bfloat16", "none")  # emulated, but asked for
    import torch

    assert what(FP32, ZEN4, torch.float16) == ("float16", "none")
    # quantizing a float checkpoint is a choice; "none" keeps a GGUF's float de-quantization
    assert what(BF16, ZEN4, quantize="int4") == ("float32", "int4")
    assert what(FP32, AVX2, "float32", "int8") == ("float32", "int8")
    assert what(GGUF_Q4, ZEN4, quantize="none") == ("float32", "none")
    assert what(BF16, ZEN4, quantize="none") == ("bfloat16", "none")
    # the llama.cpp backend runs the file's own types, whatever the dtype says
    assert resolve_precision(GGUF_Q4, ZEN4, "auto", "auto", "llama.cpp").quantize == "none"


@pytest.mark.parametrize(
    ("hardware", "dtype", "quantize", "backend", "message"),
    [
        (ZEN4, "fp8", "auto", "torch", "unknown dtype 'fp8'"),
        (ZEN4, "auto", "int3", "torch", "unknown quantization 'int3'"),
        (GPU, "auto", "int4", "torch", "quantized layers run on CPU, not cuda"),
        (ZEN4, "bfloat16", "int4", "torch", "quantized layers compute in float32"),
        (ZEN4, "auto", "int8", "llama.cpp", "llama.cpp backend runs the GGUF's own quantization"),
    ],
)
def test_impossible_choices_are_clear_errors(
    hardware: Hardware, dtype: str, quantize: str, backend: str, message: str
) -> None:
    with pytest.raises(ModelLoadError, match=message):
        resolve_precision(GGUF_Q4, hardware, dtype, quantize, backend)


def test_checkpoint_dtype_reads_either_config_name() -> None:
    from types import SimpleNamespace

    import torch
    from transformers import LlamaConfig

    assert checkpoint_dtype(SimpleNamespace(dtype=torch.bfloat16)) == "bfloat16"
    assert checkpoint_dtype(LlamaConfig.from_dict({"torch_dtype": "float16"})) == "float16"  # an older config.json
    assert checkpoint_dtype(SimpleNamespace()) is None
    assert checkpoint_dtype(SimpleNamespace(dtype="int8")) is None


@pytest.mark.real_model
def test_load_model_defaults_run_the_fast_path(tmp_path, real_lm_float32, monkeypatch) -> None:
    """A GGUF preset loads as its own int4 blocks without flags and says so; a bfloat16 folder
    loads in bfloat16 where the CPU computes it natively, in float32 where it does not."""
    from leapdecode.models import hardware, load_model

    quiet = {"log": lambda msg: None}
    lm = load_model("smollm2-135m", **quiet)
    assert lm.quantize == "int4" and "GGUF's own blocks" in lm.describe
    real_lm_float32.model.save_pretrained(tmp_path / "bf16", safe_serialization=True)
    real_lm_float32.tokenizer.save_pretrained(tmp_path / "bf16")
    config = json.loads((tmp_path / "bf16" / "config.json").read_text())
    config["dtype"] = "bfloat16"
    (tmp_path / "bf16" / "config.json").write_text(json.dumps(config))
    monkeypatch.setattr(hardware, "cpu_flags", lambda: frozenset({"avx2", "avx512_bf16"}))
    native = load_model(tmp_path / "bf16", cache_dir=tmp_path / "cache", row_exact=False, **quiet)
    assert (native.dtype, native.quantize) == ("bfloat16", "none")
    monkeypatch.setattr(hardware, "cpu_flags", lambda: frozenset({"avx2"}))
    emulated = load_model(tmp_path / "bf16", cache_dir=tmp_path / "cache", **quiet)
    assert (emulated.dtype, emulated.quantize) == ("float32", "none") and "not native" in emulated.describe
