"""Synthetic GGUF files written with gguf-py's own writer: any family transformers reads from a
GGUF, any block type, random weights (random blocks are valid weights once their float scales are).

Why: the tests need tiny files of every family and block type, and the loader and the kernels
are measured on a 7B-class target without a 4.5 GB download (`make synthetic-7b`). The tensors
are written one at a time, so a 4.4 GB file needs the memory of one tensor. The tokenizer is a
byte-level BPE of the 256 byte symbols and a few merges, or another GGUF file's (`tokenizer_from`).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

# Where each block type keeps float16 scales (byte offsets inside a block): random bytes there
# could be NaN or huge, so they are overwritten with small positive values.
F16_FIELDS = {
    "Q4_0": (0,),
    "Q4_1": (0, 2),
    "Q5_0": (0,),
    "Q5_1": (0, 2),
    "Q8_0": (0,),
    "Q2_K": (80, 82),
    "Q3_K": (108,),
    "Q4_K": (0, 2),
    "Q5_K": (0, 2),
    "Q6_K": (208,),
    "IQ4_NL": (0,),
    "IQ4_XS": (0,),
}


@dataclass(frozen=True)
class Shape:
    """A decoder's sizes (`vocab` 0: the tokenizer's own count)."""

    hidden: int = 256
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 64
    ff: int = 512
    layers: int = 2
    context: int = 512
    vocab: int = 0


TINY = Shape()
# Qwen2.5-7B's sizes, and the block types llama.cpp's Q4_K_M recipe gives its tensors
QWEN25_7B = Shape(hidden=3584, heads=28, kv_heads=4, head_dim=128, ff=18944, layers=28, context=32768, vocab=152064)
Q4_K_M = {"attn_v": "Q6_K", "ffn_down": "Q6_K", "output": "Q6_K", "": "Q4_K"}


def tokenizer_metadata(merges: int = 40) -> tuple[list[str], list[str]]:
    """Byte-level BPE: the 256 byte symbols, tokens merged from common pairs, then <s> and </s>."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    symbols = list(bytes_to_unicode().values())
    space = bytes_to_unicode()[ord(" ")]
    pairs = [(a.replace(" ", space), b.replace(" ", space)) for a in "etaoins r" for b in "etaoins r"][:merges]
    tokens = symbols + [a + b for a, b in pairs if a + b not in symbols]
    return [*tokens, "<s>", "</s>"], [f"{a} {b}" for a, b in pairs]


def random_blocks(kind: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random raw blocks [rows, bytes per row] of `kind` with small positive float16 scales."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[kind]]
    raw = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    for at in F16_FIELDS.get(kind, ()):
        scale = (rng.random((rows, cols // block), dtype=np.float32) * 0.004 + 0.0005).astype(np.float16)
        raw[..., at : at + 2] = scale.view(np.uint8).reshape(rows, cols // block, 2)
    return raw.reshape(rows, -1)


def write_gguf(
    path: Path,
    arch: str,
    kind: str | dict[str, str] = "Q8_0",
    seed: int = 0,
    name: str = "",
    tied: bool = True,
    shape: Shape = TINY,
    tokenizer_from: Path | None = None,
) -> Path:
    """A random `arch` model (llama, mistral, qwen2, qwen3, gemma2, gemma3, phi3) of `shape` at
    `path`: its 2-D weights in block type `kind` (or by a part of the gguf tensor name, the first
    that matches: {"ffn_down": "Q6_K", "": "Q4_K"}), norms float32 near one, biases small."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    rng = np.random.default_rng(seed)
    tokens = _padded(_tokenizer(tokenizer_from), shape.vocab)
    shapes = _tensor_shapes(path, arch, name, shape, tokens)
    if tied:
        shapes.pop("output.weight", None)
    kinds = {tensor: _kind(tensor, dims, kind) for tensor, dims in shapes.items()}
    writer = _metadata(path, arch, name, shape, tokens)
    for tensor, dims in shapes.items():
        if kinds[tensor] == "F32":
            writer.add_tensor_info(tensor, dims, np.dtype(np.float32), int(np.prod(dims)) * 4)
        else:
            block, size = GGML_QUANT_SIZES[GGMLQuantizationType[kinds[tensor]]]
            raw = (dims[0], dims[1] // block * size)
            writer.add_tensor_info(
                tensor, raw, np.dtype(np.uint8), raw[0] * raw[1], GGMLQuantizationType[kinds[tensor]]
            )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for tensor, dims in shapes.items():
        if kinds[tensor] != "F32":
            writer.write_tensor_data(random_blocks(kinds[tensor], dims[0], dims[1], rng))
        elif tensor.endswith("norm.weight"):
            writer.write_tensor_data((1 + 0.1 * rng.standard_normal(dims)).astype(np.float32))
        else:
            writer.write_tensor_data((0.05 * rng.standard_normal(dims)).astype(np.float32))
    writer.close()
    return path


def _kind(tensor: str, dims: tuple[int, ...], kind: str | dict[str, str]) -> str:
    if len(dims) != 2 or tensor.endswith("norm.weight"):
        return "F32"
    return kind if isinstance(kind, str) else next(v for k, v in kind.items() if k in tensor or k == "")


def _tokenizer(source: Path | None) -> dict[str, Any]:
    """The tokenizer's metadata: the synthetic BPE, or every `tokenizer.*` value of another GGUF."""
    if source is None:
        tokens, merges = tokenizer_metadata()
        return {
            "tokenizer.ggml.model": "gpt2",
            "tokenizer.ggml.pre": "default",
            "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": [1] * (len(tokens) - 2) + [3, 3],
            "tokenizer.ggml.merges": merges,
            "tokenizer.ggml.bos_token_id": len(tokens) - 2,
            "tokenizer.ggml.eos_token_id": len(tokens) - 1,
            "tokenizer.ggml.padding_token_id": len(tokens) - 1,
            "tokenizer.ggml.unknown_token_id": 0,
        }
    from gguf import GGUFReader

    reader = GGUFReader(str(source))
    return {key: field.contents() for key, field in reader.fields.items() if key.startswith("tokenizer.")}


def _padded(tokens: dict[str, Any], vocab: int) -> dict[str, Any]:
    """The token list padded to `vocab` entries with unused ones (llama.cpp sizes the embedding
    by the token list, as Qwen2.5-7B's own file pads its 151,665 tokens to 152,064)."""
    listed = tokens["tokenizer.ggml.tokens"]
    extra = vocab - len(listed)
    if extra <= 0:
        return tokens
    padded = dict(tokens, **{"tokenizer.ggml.tokens": [*listed, *(f"[PAD{i}]" for i in range(extra))]})
    if "tokenizer.ggml.token_type" in tokens:
        padded["tokenizer.ggml.token_type"] = [*tokens["tokenizer.ggml.token_type"], *([5] * extra)]  # unused
    if "tokenizer.ggml.scores" in tokens:
        padded["tokenizer.ggml.scores"] = [*tokens["tokenizer.ggml.scores"], *([0.0] * extra)]
    return padded


def _metadata(path: Path, arch: str, name: str, shape: Shape, tokens: dict[str, Any]) -> Any:
    """A writer with the file's metadata (config keys and tokenizer) added, nothing written yet."""
    from gguf import GGUFWriter

    file_arch = "llama" if arch == "mistral" else arch
    writer = GGUFWriter(str(path), file_arch)
    writer.add_name(name or f"synthetic {arch}")
    writer.add_context_length(shape.context)
    writer.add_embedding_length(shape.hidden)
    writer.add_block_count(shape.layers)
    writer.add_feed_forward_length(shape.ff)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(10000.0)
    writer.add_key_length(shape.head_dim)
    writer.add_value_length(shape.head_dim)
    if file_arch == "llama":
        writer.add_rope_dimension_count(shape.head_dim)
    if arch in ("gemma2", "gemma3"):
        writer.add_sliding_window(64)
    writer.add_vocab_size(shape.vocab or len(tokens["tokenizer.ggml.tokens"]))
    for key, value in tokens.items():
        if isinstance(value, list):
            writer.add_array(key, value)
        elif isinstance(value, str):
            writer.add_string(key, value)
        elif isinstance(value, bool):
            writer.add_bool(key, value)
        else:
            writer.add_uint32(key, int(value))
    return writer


def _tensor_shapes(
    path: Path, arch: str, name: str, shape: Shape, tokens: dict[str, Any]
) -> dict[str, tuple[int, ...]]:
    """Each gguf tensor name of this family's model and its shape [out, in], from transformers'
    own model of the config that a metadata-only file reads as."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    from leapdecode.models.gguf_model import gguf_names

    probe = path.with_suffix(".meta.gguf")
    writer = _metadata(probe, arch, name, shape, tokens)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    try:
        config = AutoConfig.from_pretrained(str(probe.parent), gguf_file=probe.name)
    finally:
        probe.unlink()
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    names = gguf_names(model, "llama" if arch == "mistral" else arch, shape.layers)
    state = model.state_dict()
    return {gguf: tuple(state[hf].shape) for gguf, hf in names.items()}


def main() -> None:
    """`python -m leapdecode.bench.synthetic_gguf OUT [--tokenizer-from PRESET_OR_GGUF]`: a file of
    Qwen2.5-7B's shapes in Q4_K_M's block types, random weights, another file's tokenizer."""
    from leapdecode.models import presets
    from leapdecode.models.loading import default_cache_dir

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("out", type=Path)
    parser.add_argument("--tokenizer-from", default="", help="a preset or GGUF file whose tokenizer to copy")
    args = parser.parse_args()
    if args.out.is_file():
        print(f"{args.out} is already there")
        return
    source = args.tokenizer_from
    tokenizer = (
        presets.locate(source, default_cache_dir(), download=True, log=print)
        if presets.is_preset(source)
        else Path(source)
        if source
        else None
    )
    partial = args.out.with_name(args.out.name + ".partial")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_gguf(
        partial, "qwen2", Q4_K_M, name="synthetic qwen2.5 7b", tied=False, shape=QWEN25_7B, tokenizer_from=tokenizer
    )
    partial.replace(args.out)
    print(f"wrote {args.out} ({args.out.stat().st_size / 2**30:.2f} GiB)")


if __name__ == "__main__":
    main()
