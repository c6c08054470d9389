"""One function to load a causal LM from a preset, a hub id, a local folder or a GGUF file.

A GGUF file is read tensor by tensor into the model (`gguf_model`): its linear weights stay in
the file's own blocks, so loading takes about the file's size in memory. Only vLLM, which reads
Hugging Face folders, gets a de-quantized float32 folder of it (`huggingface_source`).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import torch

from leapdecode.errors import ModelLoadError
from leapdecode.gc_pause import gc_paused
from leapdecode.models import presets
from leapdecode.models.gguf_folder import dequantized_folder, first_line, quiet_progress
from leapdecode.models.hardware import default_device, hardware_of
from leapdecode.models.linear import use_small_batch_linear
from leapdecode.models.model_info import context_length, end_of_turn_ids, same_tokenizer_files
from leapdecode.models.precision import (
    Source,
    check_choices,
    checkpoint_dtype,
    gguf_is_quantized,
    resolve_precision,
)
from leapdecode.models.quantize import quantize_model

GGUF_MAGIC = b"GGUF"


def default_cache_dir() -> Path:
    """`$LEAPDECODE_HOME`, else `~/.cache/leapdecode` (like `HF_HOME` for the hub cache)."""
    return Path(os.environ.get("LEAPDECODE_HOME", Path.home() / ".cache" / "leapdecode"))


BACKENDS = ("torch", "llama.cpp")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class LoadedModel:
    """A model ready for decoding: the module, its tokenizer, and what stops a turn."""

    model: Any  # a transformers PreTrainedModel with a causal-LM head, or a LlamaCppModel
    tokenizer: Any  # a transformers tokenizer
    name: str
    eos_token_ids: frozenset[int]
    max_context: int
    # Forward-cost curves measured on these weights on this machine, by (backend, threads, trees): a
    # property of the model like its size, measured on first use by cost-aware methods.
    costs: dict[tuple[str, int, bool], Any] = field(default_factory=dict, repr=False, compare=False)
    row_exact: bool = False  # verification rows bitwise one-token passes (`leapdecode.models.row_exact`)
    quantize: str = "none"  # "int8"/"int4": group-quantized linear layers (`leapdecode.models.quantize`)
    precision: str = ""  # why it runs in this dtype and quantization (`leapdecode.models.precision`)
    preset: str = ""  # the preset it was loaded from ("": a file, folder or hub id)

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def backend(self) -> str:
        """Which engine runs the model: "torch" or "llama.cpp"."""
        from leapdecode.models.llamacpp import LlamaCppModel

        return "llama.cpp" if isinstance(self.model, LlamaCppModel) else "torch"

    @property
    def exact_tokens(self) -> int | None:
        """On a row-exact model (every pass's rows bitwise one-token passes, prefills too), the
        longest decoding pass drafts are kept to (`EXACT_ROWS`, the attention kernel's fast
        few-row range); None: no row-exact guarantee, so no bound."""
        if not self.row_exact:
            return None
        from leapdecode.models.row_exact import EXACT_ROWS

        return EXACT_ROWS.stop - 1

    @property
    def dtype(self) -> str:
        """What the weights compute in: a torch dtype's name, or `gguf` on llama.cpp."""
        return str(self.model.dtype).removeprefix("torch.") if self.backend == "torch" else "gguf"

    @property
    def describe(self) -> str:
        """What runs, in a few words, and why: `torch int4 row-exact (the GGUF's own blocks)`,
        `torch float32 row-exact (float32 asked for)`, `llama.cpp gguf`."""
        weights = self.quantize if self.quantize != "none" else self.dtype
        why = f" ({self.precision})" if self.precision else ""
        return f"{self.backend} {weights}{' row-exact' if self.row_exact else ''}{why}"

    @property
    def vocab_size(self) -> int:
        """Rows of the model's logits."""
        if self.backend == "llama.cpp":
            return int(self.model.n_vocab)
        return int(self.model.config.get_text_config().vocab_size)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))

    @functools.cached_property
    def fingerprint(self) -> str:
        """A short hash of the weights themselves (not the name): what per-model files such as a
        layer-skip calibration are keyed by. PyTorch: the architecture's config and, per
        parameter, its name, shape and first and last values; llama.cpp: the GGUF's size and
        first 4 MiB."""
        digest = hashlib.sha256()
        if self.backend == "llama.cpp":
            path = Path(self.model.path)
            digest.update(str(path.stat().st_size).encode())
            with open(path, "rb") as fh:
                digest.update(fh.read(4 << 20))
            return digest.hexdigest()[:16]
        config = {k: v for k, v in self.model.config.to_dict().items() if k not in _CONFIG_NOISE}
        digest.update(repr(sorted(config.items())).encode())
        if self.quantize != "none":
            digest.update(self.quantize.encode())
        with torch.inference_mode():
            quantized = [(n, b) for n, b in self.model.named_buffers() if n.endswith(".packed")]
            for name, param in [*self.model.named_parameters(), *quantized]:
                flat = param.detach().reshape(-1)
                ends = torch.cat([flat[:8], flat[-8:]]).float().cpu()
                digest.update(f"{name}{tuple(param.shape)}".encode())
                digest.update(ends.numpy().tobytes())
        return digest.hexdigest()[:16]


# Config entries that say where or how a model was saved, not what it computes.
_CONFIG_NOISE = frozenset(
    {"_name_or_path", "transformers_version", "dtype", "torch_dtype", "_commit_hash", "architectures"}
)

logger = logging.getLogger("leapdecode")


@gc_paused()
def load_model(
    spec: str | os.PathLike[str],
    *,
    dtype: str | torch.dtype = "auto",
    device: str | torch.device | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    download: bool = True,
    log: Callable[[str], None] = logger.info,
    small_batch_linear: bool = True,
    backend: str = "torch",
    row_exact: bool | None = None,
    quantize: str | None = "auto",
    share_tokenizer: LoadedModel | None = None,
) -> LoadedModel:
    """Load a causal LM and its tokenizer, by default on its fastest path here.

    `spec` is a preset name (`smollm2-135m`, see `PRESETS`), a path to a `.gguf` file, a local
    Hugging Face folder, or a hub id. `dtype` (`auto`, `float32`, `bfloat16`, `float16` or a torch
    dtype) and `quantize` (`auto`, `none`, `int8`, `int4`) are resolved with the source and the
    hardware by `leapdecode.models.precision.resolve_precision`: by default a GGUF source runs its
    own quantized blocks on CPU, a checkpoint its own dtype where the hardware computes it
    natively, else float32; `dtype=X` alone runs X, not quantized; `quantize="int4"` quantizes a
    float checkpoint. The llama.cpp backend (`backend="llama.cpp"`, the `llamacpp` extra) runs a
    preset or .gguf file's own types. `row_exact` (float32, or bfloat16 on a CPU with
    AVX512-BF16) makes every row of a verification pass bit-identical to a one-token pass
    (`leapdecode.models.row_exact`), so greedy drafting is lossless by construction; None (the
    default) turns it on wherever it applies and its kernel builds; quantized layers are
    row-exact by construction. Otherwise, on CPU in float32, `small_batch_linear` swaps the
    linear layers for ones that score 2-16 tokens at nearly the cost of one. With `download`, a
    preset that is not installed yet is pulled (pip) first. Raises `ModelLoadError` with a
    message saying what to do; a bad choice fails before anything loads. `share_tokenizer`: a
    loaded model whose tokenizer this one takes instead of reading its own where both were read
    from local folders holding the same tokenizer files, byte for byte (a draft model of the
    target's family: a second parse of the same vocabulary costs about a second).
    """
    if backend not in BACKENDS:
        raise ModelLoadError(f"unknown backend {backend!r}; known: {', '.join(BACKENDS)}")
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target_device = torch.device(device) if device is not None else default_device()
    hardware = hardware_of(target_device)
    check_choices(dtype, quantize, backend, hardware)
    src = _resolve(spec, cache, download=download, log=log, backend=backend)
    if backend == "llama.cpp":
        assert src.gguf is not None
        return _load_llamacpp(src.gguf, src.sha256, cache, src.name, log)
    source_gguf, name, source = src.gguf, src.name, src.source
    config = _load_config(source)
    found = Source(
        gguf_quantized=source_gguf is not None and gguf_is_quantized(source_gguf), dtype=checkpoint_dtype(config)
    )
    precision = resolve_precision(found, hardware, dtype, quantize, backend)
    log(f"running {precision.quantize if precision.quantize != 'none' else precision.dtype}: {precision.reason}")
    offered = share_tokenizer.tokenizer if share_tokenizer is not None else None
    shared = offered if offered is not None and same_tokenizer_files(source, offered.name_or_path) else None
    if source_gguf is not None:
        from leapdecode.models.gguf_model import load_gguf_model

        saved = cache / "quantized" / f"{src.sha256[:16]}-{precision.quantize}-v{QUANTIZED_FORMAT}.safetensors"
        model, _ = load_gguf_model(source_gguf, config, precision.quantize, DTYPES[precision.dtype], log, saved)
        tokenizer = shared if shared is not None else _load_tokenizer(source)
    else:
        model, tokenizer = _load_checkpoint(source, DTYPES[precision.dtype], precision.quantize, config, shared, log)
    model.to(target_device)
    model.eval()
    row_exact = _row_exact(model, row_exact, target_device, log)
    if not row_exact and target_device.type == "cpu" and small_batch_linear and model.dtype == torch.float32:
        # measured for float32 only: in bfloat16 without native bf16 products the thin-operand
        # product is slower than nn.Linear's (smollm2, AVX2: 2 rows 137 ms against 73 ms)
        use_small_batch_linear(model)
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        name=name,
        eos_token_ids=frozenset(end_of_turn_ids(model, tokenizer)),
        max_context=context_length(model, tokenizer),
        row_exact=row_exact,
        preset=str(spec) if presets.is_preset(str(spec)) else "",
        quantize=precision.quantize,
        precision=precision.reason,
    )


def _load_checkpoint(
    source: str, dtype: torch.dtype, quantize: str, config: Any, tokenizer: Any, log: Callable[[str], None]
) -> tuple[Any, Any]:
    """A checkpoint's model and tokenizer; quantized, a local folder's tensors one at a time
    (`checkpoint_stream`: the float model is never whole), else after `from_pretrained`."""
    from leapdecode.models.checkpoint_stream import checkpoint_files, load_quantized_checkpoint

    if quantize != "none" and checkpoint_files(source):
        streamed = load_quantized_checkpoint(source, config, quantize, log)
        if streamed is not None:
            return streamed, tokenizer if tokenizer is not None else _load_tokenizer(source)
    model, tokenizer = _from_pretrained(source, dtype, log, config=config, tokenizer=tokenizer)
    if quantize != "none":
        log(f"quantizing the linear layers to {quantize} (the kernel is built once, then cached)")
        quantize_model(model, quantize)
    return model, tokenizer


def _row_exact(model: Any, wanted: bool | None, device: torch.device, log: Callable[[str], None]) -> bool:
    """Turn the row-exact kernel on where asked, or (None) wherever it applies and builds."""
    applies = device.type == "cpu" and model.dtype in (torch.float32, torch.bfloat16)
    if wanted and not applies:
        raise ModelLoadError(
            f"row_exact runs float32 or bfloat16 on CPU, not {str(model.dtype).removeprefix('torch.')} on {device.type}"
        )
    if wanted is None and applies:
        from leapdecode.models.row_exact import bf16_linear_available, kernel

        log("preparing the row-exact kernel (built once, then cached)")
        # bfloat16 without AVX512-BF16: the kernel's portable path is exact but slower than nn.Linear
        wanted = kernel() is not None and (model.dtype == torch.float32 or bf16_linear_available())
    if wanted:
        from leapdecode.models.row_exact import use_row_exact

        use_row_exact(model)
    return bool(wanted)


class _Source(NamedTuple):
    """What a model spec names: `source` is where `transformers` reads the config and tokenizer (a
    folder or a hub id; for a GGUF file the small folder of its metadata, or with `folder` its
    de-quantized weights too; empty for the llama.cpp backend), `gguf` and `sha256` the GGUF file
    it came from, if any."""

    source: str
    name: str
    gguf: Path | None
    sha256: str


def _resolve(
    spec: str | os.PathLike[str],
    cache: Path,
    *,
    download: bool,
    log: Callable[[str], None],
    backend: str,
    folder: bool = False,
) -> _Source:
    """Find (and for a preset, install) what `spec` names; for a GGUF file, its metadata folder,
    or with `folder` a Hugging Face folder of its weights de-quantized (once)."""
    text = str(spec).strip()
    if not text:
        raise ModelLoadError("no model given: pass a preset name, a hub id, a folder or a .gguf file")
    path = Path(text).expanduser()
    if presets.is_preset(text):
        gguf, sha, name = presets.locate(text, cache, download=download, log=log), presets.get_preset(text).sha256, text
    elif text.lower().endswith(".gguf") or (path.is_file() and _is_gguf(path)):
        if not path.is_file():
            raise ModelLoadError(f"GGUF file not found: {path}")
        if not _is_gguf(path):
            raise ModelLoadError(f"{path} is not a GGUF file (bad magic bytes); is it corrupt or truncated?")
        gguf, sha, name = path, _file_sha256(path, cache, log), path.stem
    elif backend == "llama.cpp":
        raise ModelLoadError(f"the llama.cpp backend runs GGUF files: give a preset or a .gguf path, not {text!r}")
    elif path.exists():
        if not path.is_dir():
            raise ModelLoadError(f"{path} is neither a model folder nor a .gguf file")
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"{path} has no config.json: not a Hugging Face model folder")
        return _Source(str(path), path.name, None, "")
    elif text.count("/") == 1 and not text.startswith((".", "/")):
        return _Source(text, text, None, "")
    else:
        known = ", ".join(p.name for p in presets.PRESETS)
        raise ModelLoadError(
            f"unknown model {text!r}: not a preset ({known}), an existing folder, a .gguf file or a hub id (owner/name)"
        )
    if backend == "llama.cpp":
        return _Source("", name, gguf, sha)
    if folder:
        return _Source(str(dequantized_folder(gguf, sha, cache, log)), name, gguf, sha)
    from leapdecode.models.gguf_model import gguf_meta_folder

    return _Source(str(gguf_meta_folder(gguf, sha, cache, log)), name, gguf, sha)


def _file_sha256(path: Path, cache: Path, log: Callable[[str], None]) -> str:
    """The file's sha256 (what its kept layers and metadata are named by), hashed once and kept by
    its path, size and modification time: hashing a 5 GB file takes seconds on every load."""
    stat = path.stat()
    key = hashlib.sha256(f"{path.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}".encode()).hexdigest()[:32]
    kept = cache / "gguf-sha256" / key
    if kept.is_file() and len(digest := kept.read_text().strip()) == 64:
        return digest
    log(f"hashing {path.name}")
    digest = presets.sha256_file(path)
    try:
        kept.parent.mkdir(parents=True, exist_ok=True)
        kept.write_text(digest)
    except OSError as exc:
        log(f"could not keep the checksum of {path.name} ({exc})")
    return digest


def huggingface_source(
    spec: str | os.PathLike[str],
    *,
    cache_dir: str | os.PathLike[str] | None = None,
    download: bool = True,
    log: Callable[[str], None] = logger.info,
) -> str:
    """What another library that reads Hugging Face models (vLLM) should load for `spec`: a
    preset's or GGUF file's de-quantized folder (built once, cached), a folder, or a hub id."""
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    return _resolve(spec, cache, download=download, log=log, backend="torch", folder=True).source


QUANTIZED_FORMAT = 4  # bump when the saved layout of quantized layers changes (the draft model's cache)


def _load_llamacpp(gguf: Path, sha256: str, cache: Path, name: str, log: Callable[[str], None]) -> LoadedModel:
    """The GGUF in llama.cpp, with the same tokenizer and end-of-turn ids as the PyTorch load."""
    from types import SimpleNamespace

    from leapdecode.models.llamacpp import import_llama_cpp, load_llamacpp, tokenizer_for

    llama_cpp = import_llama_cpp()
    log(f"loading {gguf.name} in llama.cpp")
    folder = cache / "gguf-meta" / sha256[:16]
    tokenizer = tokenizer_for(gguf, folder if folder.is_dir() else None)
    model = load_llamacpp(gguf)
    vocab = llama_cpp.llama_model_get_vocab(model.model)
    eos = int(llama_cpp.llama_vocab_eos(vocab))  # the GGUF's eos, as the PyTorch load's config has it
    stand_in = SimpleNamespace(generation_config=None, config=SimpleNamespace(eos_token_id=[eos] if eos >= 0 else []))
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        name=name,
        eos_token_ids=frozenset(end_of_turn_ids(stand_in, tokenizer)),
        max_context=model.n_ctx,
    )


def _is_gguf(path: Path) -> bool:
    with open(path, "rb") as fh:
        return fh.read(4) == GGUF_MAGIC


def _load_config(source: str) -> Any:
    """The checkpoint's transformers config (says its dtype and architecture; weights not read)."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(source)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"could not load model {source!r}: {first_line(exc)}") from exc


def _from_pretrained(
    source: str, dtype: torch.dtype, log: Callable[[str], None], config: Any, tokenizer: Any = None
) -> tuple[Any, Any]:
    with quiet_progress():
        return _load_pretrained(source, dtype, log, config, tokenizer)


def _load_pretrained(
    source: str, dtype: torch.dtype, log: Callable[[str], None], config: Any, tokenizer: Any = None
) -> tuple[Any, Any]:
    """The model and its tokenizer (`tokenizer` where given: one read from the same files)."""
    from transformers import AutoModelForCausalLM

    log(f"loading {source}")
    try:
        model = AutoModelForCausalLM.from_pretrained(source, config=config, dtype=dtype)
    except ValueError as exc:
        if "Unrecognized configuration class" in str(exc):
            raise ModelLoadError(f"{source!r} is a {type(config).__name__} model, not a causal language model") from exc
        raise ModelLoadError(f"could not load model {source!r}: {first_line(exc)}") from exc
    except (OSError, RuntimeError, KeyError) as exc:
        raise ModelLoadError(f"could not load model weights from {source!r}: {first_line(exc)}") from exc
    return model, tokenizer if tokenizer is not None else _load_tokenizer(source)


def _load_tokenizer(source: str) -> Any:
    from transformers import AutoTokenizer

    try:
        with quiet_progress():
            return AutoTokenizer.from_pretrained(source)
    except (OSError, ValueError, KeyError) as exc:
        raise ModelLoadError(f"could not load the tokenizer of {source!r}: {first_line(exc)}") from exc
