"""A GGUF file straight into a PyTorch model, its weights read tensor by tensor from its blocks.

Why: de-quantizing a whole GGUF to float32 first (what `from_pretrained(gguf_file=...)` does)
costs about 9 bytes a parameter at its peak, so a 7B file of 4.5 GB needs some 70 GB to load.
Here the model is built empty (`accelerate.init_empty_weights`: parameters on the meta device,
buffers such as the rotary frequencies computed as usual), and each tensor of the file is read on
its own (`gguf_header` gives where), so the peak is about the loaded model plus one tensor:
- a linear weight in a block type the kernel takes (`gguf_blocks.NATIVE_BITS`) becomes a
  `QuantizedLinear` of the file's own integers and scales, its rows in the order `transformers`
  gives them (its per-architecture tensor processor, applied to the row indices);
- the input embedding stays in its blocks, de-quantized by row (`embedding.QuantizedEmbedding`);
  a tied output layer streams the same records;
- a linear weight in another type (Q5_1, Q5_K, Q2_K...) is de-quantized and rounded to int8, and
  said so; norms, biases and any float tensor are de-quantized as they are.
With `quantize="none"` every tensor is de-quantized to the asked dtype, one at a time.
`transformers` does what it already does well: the config and tokenizer from the file's
metadata (`gguf_meta_folder`: kept in a small folder, so a second load skips the parse) and the
per-architecture tensor processors; the names come from gguf-py's own map (`gguf_names`).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from leapdecode.errors import ModelLoadError
from leapdecode.models.embedding import QuantizedEmbedding
from leapdecode.models.empty_model import empty_model, place, swap
from leapdecode.models.gguf_blocks import NATIVE_BITS, Rows, packed_layer, rows_of
from leapdecode.models.gguf_folder import first_line, quiet_progress
from leapdecode.models.gguf_header import GGUFHeaderError, Header, TensorInfo, read_header
from leapdecode.models.layer_records import LayerRecords
from leapdecode.models.quantize import QuantizedLinear
from leapdecode.models.rounding import GROUP

META_FORMAT = ".leapdecode-gguf-meta-v1"  # marks a complete folder of a file's config and tokenizer
SEPARATE_TOKENIZER = 32768  # vocabularies from this size are built in a second process


@dataclass
class LoadReport:
    """What a load read, by where each tensor went and its block type."""

    blocks: Counter[str] = field(default_factory=Counter)  # linear weights from the file's own blocks
    rounded: Counter[str] = field(default_factory=Counter)  # linear weights de-quantized, then rounded
    floats: Counter[str] = field(default_factory=Counter)  # tensors de-quantized to floats
    embedding: str = ""  # the input embedding's block type, where it stays in its blocks

    def summary(self) -> str:
        def kinds(counts: Counter[str]) -> str:
            return ", ".join(f"{n} {k}" for k, n in sorted(counts.items())) or "none"

        parts = [
            f"{sum(self.blocks.values())} linear weights from the file's own blocks ({kinds(self.blocks)})",
            f"{sum(self.floats.values())} tensors de-quantized to floats ({kinds(self.floats)})",
        ]
        if self.rounded:
            parts.append(f"{sum(self.rounded.values())} de-quantized and rounded to int8 ({kinds(self.rounded)})")
        if self.embedding:
            parts.append(f"the input embedding kept in its {self.embedding} blocks")
        return "; ".join(parts)


# Reads a GGUF's config or tokenizer in a process of its own and saves it: argv = what, folder,
# file name, where to save.
_PARSE = (
    "import sys; from transformers import AutoConfig, AutoTokenizer; "
    "reader = AutoConfig if sys.argv[1] == 'config' else AutoTokenizer; "
    "reader.from_pretrained(sys.argv[2], gguf_file=sys.argv[3]).save_pretrained(sys.argv[4])"
)


def gguf_meta_folder(path: Path, sha256: str, cache: Path, log: Callable[[str], None]) -> Path:
    """A folder with the file's transformers config and tokenizer (no weights): parsed from its
    metadata once (seconds for a large vocabulary), kept by the file's sha256, read back after.
    With a large vocabulary the config and the tokenizer are each read by a process of their own,
    side by side: a core each (about 17 s for 151,936 tokens on two cores, 24 s one after the
    other), and the vocabulary's millions of Python objects never enter this process, whose peak
    is the model's. Where such a process fails, or the vocabulary is small (faster than starting a
    process), they are read here."""
    folder = cache / "gguf-meta" / sha256[:16]
    if (folder / META_FORMAT).is_file():
        return folder
    log(f"reading the config and tokenizer of {path.name} (once; kept in {folder})")
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".building-", dir=folder.parent))
    children: dict[str, subprocess.Popen[bytes] | None] = {}
    try:
        apart = _header(path).vocabulary >= SEPARATE_TOKENIZER
        children = {what: _start(what, path, tmp) if apart else None for what in ("config", "tokenizer")}
        for what, saved in (("config", "config.json"), ("tokenizer", "tokenizer_config.json")):
            child = children[what]
            if child is None or child.wait() != 0 or not (tmp / saved).is_file():
                _parse(path, what).save_pretrained(tmp)
        (tmp / META_FORMAT).touch()
        if folder.exists():
            shutil.rmtree(folder)
        tmp.rename(folder)
    finally:
        for child in children.values():
            if child is not None and child.poll() is None:
                child.kill()
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def _header(path: Path) -> Header:
    try:
        return read_header(path)
    except (GGUFHeaderError, OSError) as exc:
        raise ModelLoadError(f"could not read GGUF {path}: {exc} (corrupt file?)") from exc


def _start(what: str, path: Path, out: Path) -> subprocess.Popen[bytes] | None:
    try:
        return subprocess.Popen(
            [sys.executable, "-c", _PARSE, what, str(path.parent), path.name, str(out)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
    except OSError:
        return None


def _parse(path: Path, what: str) -> Any:
    """transformers' config or tokenizer of the file, read from its metadata."""
    from transformers import AutoConfig, AutoTokenizer

    reader = AutoConfig if what == "config" else AutoTokenizer
    try:
        with quiet_progress():
            return reader.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as exc:  # a corrupt or unknown file fails anywhere in transformers' parser
        raise ModelLoadError(
            f"could not read GGUF {path}: {first_line(exc)} (corrupt file or unsupported architecture?)"
        ) from exc


def load_gguf_model(
    path: Path, config: Any, mode: str, dtype: torch.dtype, log: Callable[[str], None], saved: Path | None = None
) -> tuple[Any, LoadReport]:
    """The model of `path` (config from `gguf_meta_folder`): `mode` "int4" (the file's
    blocks where they fit), "int8" (every linear weight rounded to int8) or "none" (floats of
    `dtype`). `saved`: where the quantized layers' records are kept between loads (None: not kept)."""
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

    started = time.perf_counter()
    header = _header(path)
    _check_block_types(path, header.tensors)
    model = empty_model(config, dtype)
    processor = TENSOR_PROCESSORS.get(header.architecture, TensorProcessor)(config=config.to_dict())
    names = gguf_names(model, header.architecture, config.get_text_config().num_hidden_layers)
    reader = _TensorReader(path, header.tensors, names, processor)
    report = LoadReport()
    with torch.no_grad():
        left = _place_tensors(model, reader, mode, dtype, report)
        if mode == "none":
            model.tie_weights()  # a tied output layer without a tensor of its own: the embedding's
        else:
            records = LayerRecords(saved, f"{saved.name.rsplit('-v', 1)[0]}-v*.safetensors" if saved else "", log)
            _place_quantized(model, reader, left, records, report, mode)
            records.keep(model)
    missing = [n for n, p in [*model.named_parameters(), *model.named_buffers()] if p.is_meta]
    if missing:
        raise ModelLoadError(f"{path.name} has no tensor for {', '.join(missing[:4])} (not this architecture's file?)")
    model.eval()
    peak = _peak_resident()
    memory = f", peak resident memory {peak / 2**30:.2f} GiB" if peak else ""
    log(f"read {path.name} in {time.perf_counter() - started:.1f} s{memory}: {report.summary()}")
    return model, report


def _peak_resident() -> int:
    """This process's peak resident bytes (Linux's VmHWM; 0 where there is none)."""
    try:
        status = Path("/proc/self/status").read_text()
    except OSError:
        return 0
    return next((int(line.split()[1]) * 1024 for line in status.splitlines() if line.startswith("VmHWM")), 0)


def _check_block_types(path: Path, tensors: list[TensorInfo]) -> None:
    """Every block type in the file one that is read as it is or that gguf-py de-quantizes, said
    before any weight is read (one block of each other type de-quantized as the test)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, dequantize

    for type_id in sorted({t.type_id for t in tensors}):
        try:
            kind = GGMLQuantizationType(type_id)
        except ValueError:
            raise ModelLoadError(f"{path.name}: block type {type_id} is not one gguf-py knows") from None
        if kind.name in NATIVE_BITS:
            continue
        try:
            dequantize(np.zeros(GGML_QUANT_SIZES[kind][1], dtype=np.uint8), kind)
        except NotImplementedError:
            raise ModelLoadError(
                f"{path.name}: block type {kind.name} can be neither run nor de-quantized here"
            ) from None


def gguf_names(model: nn.Module, architecture: str, layers: int) -> dict[str, str]:
    """gguf name → transformers name for each of `model`'s tensors, from gguf-py's own name map
    (what `transformers.modeling_gguf_pytorch_utils.get_gguf_hf_weights_map` reads, there built
    again for every submodule: seconds; here once)."""
    from gguf import MODEL_ARCH_NAMES, get_tensor_name_map

    arch = next((key for key, value in MODEL_ARCH_NAMES.items() if value == architecture), None)
    if arch is None:
        raise ModelLoadError(f"GGUF architecture {architecture!r} is not one gguf-py names")
    name_map = get_tensor_name_map(arch, layers)
    names = {}
    for full in model.state_dict():
        base, _, suffix = full.rpartition(".")
        _, _, rest = base.partition(".")
        found = name_map.get_name(base) or (name_map.get_name(rest) if rest else None)
        if found is not None:
            names[f"{found}.{suffix}"] = full
    return names


class _TensorReader:
    """The file's tensors by transformers name: raw blocks read with one `pread` each (nothing
    mapped, so what was read is freed with the array), de-quantized and processed on request."""

    def __init__(self, path: Path, infos: list[TensorInfo], names: dict[str, str], processor: Any) -> None:
        self.path, self.processor = path, processor
        self.infos = {names[t.name]: t for t in infos if t.name in names}

    def raw(self, info: TensorInfo, first_row: int = 0, rows: int | None = None) -> np.ndarray:
        """The tensor's raw bytes (of `rows` rows from `first_row`, for a 2-D one), read now."""
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        block, size = GGML_QUANT_SIZES[GGMLQuantizationType(info.type_id)]
        row_bytes = int(info.shape[0]) // block * size
        count = int(np.prod(info.shape)) // block * size if rows is None else rows * row_bytes
        data = np.fromfile(self.path, dtype=np.uint8, count=count, offset=info.offset + first_row * row_bytes)
        if data.size != count:
            raise ModelLoadError(f"{self.path.name}: tensor {info.name} runs past the end of the file (truncated?)")
        return data

    def rows(self, info: TensorInfo) -> Rows:
        """A 2-D tensor's raw blocks by row slice, each read when asked for."""
        return lambda start, stop: self.raw(info, start, stop - start).reshape(stop - start, -1)

    def kind(self, info: TensorInfo) -> str:
        from gguf import GGMLQuantizationType

        try:
            return GGMLQuantizationType(info.type_id).name
        except ValueError:
            raise ModelLoadError(
                f"{self.path.name}: tensor {info.name} has unknown block type {info.type_id}"
            ) from None

    def floats(self, info: TensorInfo) -> torch.Tensor:
        """The tensor de-quantized (gguf-py) and processed as `transformers` processes it, in its shape."""
        from gguf import GGMLQuantizationType, dequantize

        values = dequantize(self.raw(info), GGMLQuantizationType(info.type_id))  # every type checked on open
        values = values.reshape(tuple(reversed(info.shape))).astype(np.float32, copy=False)
        return torch.from_numpy(np.ascontiguousarray(self.processor.process(weights=values, name=info.name).weights))

    def row_order(self, info: TensorInfo) -> np.ndarray | None:
        """The row permutation `transformers` applies to this 2-D tensor (None: none), found by
        processing the row indices; a processor that changes values is refused."""
        rows = int(info.shape[1])
        probe = np.arange(rows, dtype=np.float64).reshape(rows, 1)
        order = np.asarray(self.processor.process(weights=probe, name=info.name).weights).reshape(-1)
        if order.shape != (rows,) or not np.array_equal(np.sort(order), np.arange(rows)):
            raise ModelLoadError(f"{self.path.name}: tensor {info.name} is transformed beyond a row order on load")
        return None if np.array_equal(order, np.arange(rows)) else order.astype(np.int64)


def _owner(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    module_name, attr = name.rsplit(".", 1)
    return model.get_submodule(module_name), attr


def _place_tensors(
    model: nn.Module, reader: _TensorReader, mode: str, dtype: torch.dtype, report: LoadReport
) -> dict[str, TensorInfo]:
    """Every tensor but those to be quantized (the linear weights and, quantized, the input
    embedding's): de-quantized into place. Returns those left, by module name."""
    left: dict[str, TensorInfo] = {}
    embedding = model.get_input_embeddings()
    for name, info in reader.infos.items():
        module, attr = _owner(model, name)
        linear = isinstance(module, nn.Linear) and not module.in_features % GROUP
        if mode != "none" and attr == "weight" and (linear or (module is embedding and type(module) is nn.Embedding)):
            left[name.rsplit(".", 1)[0]] = info
            continue
        place(module, attr, reader.floats(info).to(dtype))
        report.floats[reader.kind(info)] += 1
    return left


def _place_quantized(
    model: nn.Module,
    reader: _TensorReader,
    left: dict[str, TensorInfo],
    records: LayerRecords,
    report: LoadReport,
    mode: str,
) -> None:
    """Each linear weight into a quantized layer (its bias already placed), from the records kept
    of an earlier load or the file's blocks, else rounded to int8; then the input embedding: the
    tied output layer's records where that layer holds the file's values, else its own."""
    head, embedding = model.get_output_embeddings(), model.get_input_embeddings()
    head_name = _name_of(model, head) if isinstance(head, nn.Linear) else ""
    embed_name = _name_of(model, embedding)
    if head_name and head_name not in left:  # tied: the embedding's tensor
        left[head_name] = left[embed_name] if embed_name in left else reader.infos[f"{embed_name}.weight"]
    for name, info in left.items():
        module = model.get_submodule(name)
        if module is not embedding:
            bias = None if module.bias is None or module.bias.is_meta else module.bias.detach()
            swap(model, name, _quantized(name, info, bias, reader, records, report, mode))
    if embed_name in left:
        tied = bool(head_name) and left[head_name] is left[embed_name] and records.exact.get(head_name, False)
        layer = (
            model.get_submodule(head_name)
            if tied
            else _quantized(embed_name, left[embed_name], None, reader, records, report, mode, exact_only=True)
        )
        if layer is None:
            place(embedding, "weight", reader.floats(left[embed_name]))
            report.floats[reader.kind(left[embed_name])] += 1
        else:
            swap(model, embed_name, QuantizedEmbedding(layer, embedding.padding_idx))
            report.embedding = reader.kind(left[embed_name])


def _quantized(
    name: str,
    info: TensorInfo,
    bias: torch.Tensor | None,
    reader: _TensorReader,
    records: LayerRecords,
    report: LoadReport,
    mode: str,
    exact_only: bool = False,
) -> QuantizedLinear | None:
    """`name`'s layer: kept from an earlier load, or the file's blocks (int4), or (not
    `exact_only`) rounded to int8 from the de-quantized weight."""

    def build() -> tuple[QuantizedLinear | None, bool]:
        native = _native_layer(reader, info, bias) if mode == "int4" else None
        if native is not None or exact_only:
            return native, native is not None
        return QuantizedLinear.from_weight(reader.floats(info), 8, bias), False

    layer = records.layer(name, bias, build)
    if layer is not None and not exact_only:
        (report.blocks if records.exact[name] else report.rounded)[reader.kind(info)] += 1
    return layer


def _native_layer(reader: _TensorReader, info: TensorInfo, bias: torch.Tensor | None) -> QuantizedLinear | None:
    kind = reader.kind(info)
    if kind not in NATIVE_BITS or len(info.shape) != 2:
        return None
    cols, rows = (int(n) for n in info.shape)  # gguf lists the fastest dimension first
    order = reader.row_order(info)
    source = reader.rows(info) if order is None else rows_of(reader.raw(info), rows, order)
    return packed_layer(source, kind, rows, cols, bias)


def _name_of(model: nn.Module, module: nn.Module) -> str:
    return next(name for name, m in model.named_modules() if m is module)
