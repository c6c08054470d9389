"""Loading a GGUF model into llama.cpp (through llama-cpp-python's C API), for the llama.cpp backend.

An optional extra: `pip install leapdecode[llamacpp]` builds llama.cpp from source (about four
minutes on two cores). The same presets and .gguf paths as the PyTorch loader work; the
tokenizer and chat template come from the GGUF through `transformers`, so prompts encode to
the same ids on both backends.

One `LlamaCppModel` owns one llama.cpp context, so one KV cache: it serves one sequence at a
time. The context allows several sequence ids in one unified KV buffer, so that one batch can
hold a token tree's branches side by side.
"""

from __future__ import annotations

import os
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from leapdecode.errors import ModelLoadError
from leapdecode.models.hardware import cpu_flags

MAX_SEQUENCES = 32  # sequence ids in one context: the most branches a tree may verify in one pass


def import_llama_cpp() -> Any:
    try:
        import llama_cpp
    except ImportError as exc:
        raise ModelLoadError(
            "the llama.cpp backend needs llama-cpp-python: pip install 'leapdecode[llamacpp]' "
            "(builds llama.cpp from source, about four minutes on two cores)"
        ) from exc
    refuse_known_crash(llama_cpp.llama_print_system_info().decode("utf-8", "replace"), cpu_flags())
    return llama_cpp


def refuse_known_crash(system_info: str, flags: frozenset[str]) -> None:
    """Refuse, before any pass, a llama.cpp build known to crash on this CPU: one compiled with AMX
    (what pip builds for the `llamacpp` extra on a CPU that has it) dies with a general protection
    fault in ggml's AMX matmul on its first pass; `make llamacpp` builds it without AMX."""
    if "amx_tile" in flags and "AMX_INT8 = 1" in system_info:
        raise ModelLoadError(
            "this llama-cpp-python was built with AMX, and llama.cpp's AMX matmul crashes on its first pass "
            "on this CPU: rebuild it without, with `make llamacpp` (or pip install --force-reinstall "
            "--no-cache-dir llama-cpp-python==0.3.36 with CMAKE_ARGS='-DCMAKE_C_FLAGS=-mno-amx-tile "
            "-mno-amx-int8 -mno-amx-bf16 -DCMAKE_CXX_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16')"
        )


def _quiet(llama_cpp: Any) -> None:
    """llama.cpp logs every load to stderr; keep errors only."""
    from llama_cpp import _logger

    _logger.set_verbose(False)


@dataclass
class LlamaCppModel:
    """A GGUF model and its one llama.cpp context."""

    path: Path
    n_threads: int
    n_ctx: int
    n_batch: int
    model: Any = field(repr=False)  # llama_model pointer
    ctx: Any = field(repr=False)  # llama_context pointer
    n_vocab: int = 0
    n_ctx_train: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    # The context has one KV cache, so it holds one sequence at a time: `holder` is that sequence's
    # state (set by each prefill; a sequence whose state is not the holder was evicted). This is
    # the context's own state, never a request's settings.
    holder: object | None = field(default=None, repr=False)
    # A measured property of these weights on this machine's kernels, probed once on first use:
    # (context length, the largest batch scored there bit for bit as single tokens are), up a
    # ladder of lengths (empty: not probed yet).
    exact_batches: tuple[tuple[int, int], ...] = ()

    @property
    def memory(self) -> Any:
        return import_llama_cpp().llama_get_memory(self.ctx)


def load_llamacpp(path: Path, *, n_threads: int | None = None, n_ctx: int = 4096, n_batch: int = 512) -> LlamaCppModel:
    """Open `path` (a .gguf) in llama.cpp with a context of `n_ctx` tokens."""
    llama_cpp = import_llama_cpp()
    _quiet(llama_cpp)
    llama_cpp.llama_backend_init()
    threads = n_threads or torch.get_num_threads() or os.cpu_count() or 1
    model_params = llama_cpp.llama_model_default_params()
    model = llama_cpp.llama_model_load_from_file(str(path).encode("utf-8"), model_params)
    if not model:
        raise ModelLoadError(f"llama.cpp could not load {path}: is it a complete GGUF file?")
    n_ctx_train = int(llama_cpp.llama_model_n_ctx_train(model))
    params = llama_cpp.llama_context_default_params()
    params.n_ctx = min(n_ctx, n_ctx_train) if n_ctx_train > 0 else n_ctx
    params.n_batch = params.n_ubatch = min(n_batch, params.n_ctx)
    params.n_threads = params.n_threads_batch = threads
    params.n_seq_max = MAX_SEQUENCES
    params.kv_unified = True  # branches share the prefix's cells instead of copying them
    ctx = llama_cpp.llama_init_from_model(model, params)
    if not ctx:
        llama_cpp.llama_model_free(model)
        raise ModelLoadError(f"llama.cpp could not create a context for {path}")
    vocab = llama_cpp.llama_model_get_vocab(model)
    loaded = LlamaCppModel(
        path=path,
        n_threads=threads,
        n_ctx=int(params.n_ctx),
        n_batch=int(params.n_batch),
        model=model,
        ctx=ctx,
        n_vocab=int(llama_cpp.llama_vocab_n_tokens(vocab)),
        n_ctx_train=n_ctx_train,
    )
    weakref.finalize(loaded, _free, llama_cpp, ctx, model)
    return loaded


def _free(llama_cpp: Any, ctx: Any, model: Any) -> None:
    llama_cpp.llama_free(ctx)
    llama_cpp.llama_model_free(model)


def parameter_mb(model: LlamaCppModel) -> float:
    """The GGUF's size: its quantized weights, as llama.cpp holds them."""
    return model.path.stat().st_size / 2**20


def tokenizer_for(gguf: Path, dequantized: Path | None) -> Any:
    """The model's `transformers` tokenizer: from an already de-quantized folder when there is
    one (fast), else read from the GGUF itself."""
    from transformers import AutoTokenizer

    try:
        if dequantized is not None and (dequantized / "tokenizer_config.json").is_file():
            return AutoTokenizer.from_pretrained(str(dequantized))
        return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    except (OSError, ValueError, KeyError) as exc:
        raise ModelLoadError(f"could not read the tokenizer of {gguf}: {exc}") from exc
