"""A GGUF file's weights de-quantized to float32 by `transformers` (20-70 s), kept once per file
sha256 as an ordinary Hugging Face folder (safetensors), so that a second load takes seconds."""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from leapdecode.errors import ModelLoadError

# Marks a complete de-quantized folder of the current layout (v2: a tied output layer is not saved
# twice); a folder without it is rebuilt.
FOLDER_FORMAT = ".leapdecode-folder-v2"


@contextlib.contextmanager
def quiet_progress() -> Iterator[None]:
    """No "Loading weights" bar from transformers on every load: the caller's `log` reports progress."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def dequantized_folder(gguf: Path, sha256: str, cache: Path, log: Callable[[str], None]) -> Path:
    """A Hugging Face folder with the GGUF's de-quantized weights, built once per sha256."""
    folder = cache / "models" / sha256[:16]
    if (folder / FOLDER_FORMAT).is_file():
        return folder
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log(f"de-quantizing {gguf.name} (once; the result is cached in {folder})")
    try:
        with quiet_progress():
            tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
            model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    except Exception as exc:  # a corrupt file can fail anywhere in the GGUF parser, with any error type
        raise ModelLoadError(
            f"could not read GGUF {gguf}: {first_line(exc)} (corrupt file or unsupported architecture?)"
        ) from exc
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".building-", dir=folder.parent))
    try:
        config_dict = model.config.to_dict()
        config_dict.pop("quantization_config", None)  # the weights we save are plain float32
        model.config.__class__.from_dict(config_dict).save_pretrained(tmp)
        model.generation_config.save_pretrained(tmp)
        save_file(_untied_state(model), str(tmp / "model.safetensors"), metadata={"format": "pt"})
        tokenizer.save_pretrained(tmp)
        (tmp / FOLDER_FORMAT).touch()
        if folder.exists():
            shutil.rmtree(folder)
        tmp.rename(folder)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return folder


def _untied_state(model: Any) -> dict[str, torch.Tensor]:
    """The weights to save, a tied output layer left out as `save_pretrained` leaves it out: the
    folder's readers tie it back from the input embeddings (vLLM 0.32 reads a saved copy as the
    output layer and leaves the embeddings unset: every logit equal)."""
    state = model.state_dict()
    head, embed = model.get_output_embeddings(), model.get_input_embeddings()
    if head is not None and embed is not None and _same_memory(head.weight, embed.weight):
        head_names = {name for name, module in model.named_modules() if module is head}
        for name in [n for n in state if n.rsplit(".", 1)[0] in head_names and _same_memory(state[n], embed.weight)]:
            del state[name]
    return {name: tensor.contiguous() for name, tensor in state.items()}


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
