"""Facts about a loaded model that generation needs: which tokens end a turn, how long a
sequence may be, and whether two models' tokenizers were read from the same files."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

_PROBE = "leapdecode-probe-reply"


def end_of_turn_ids(model: Any, tokenizer: Any) -> set[int]:
    """Every id that ends generation: the generation config's EOS ids, the tokenizer's EOS,
    and the token the chat template puts after an assistant reply (e.g. `<|im_end|>`)."""
    ids: set[int] = set()
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    for value in (gen_eos, getattr(model.config, "eos_token_id", None), tokenizer.eos_token_id):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    if getattr(tokenizer, "chat_template", None):
        ids.update(_template_end_of_turn(tokenizer))
    return ids


def _template_end_of_turn(tokenizer: Any) -> set[int]:
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": _PROBE}]
    try:
        rendered = tokenizer.apply_chat_template(messages, tokenize=False)
    except (ValueError, TypeError, KeyError):
        return set()
    tail = rendered[rendered.rfind(_PROBE) + len(_PROBE) :]
    tail_ids = tokenizer(tail, add_special_tokens=False)["input_ids"]
    special = set(tokenizer.all_special_ids) | set(getattr(tokenizer, "added_tokens_decoder", {}).keys())
    return {tail_ids[0]} if tail_ids and tail_ids[0] in special else set()


def context_length(model: Any, tokenizer: Any) -> int:
    """The longest sequence the model accepts (prompt plus new tokens)."""
    for attr in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(model.config, attr, None)
        if isinstance(value, int) and value > 0:
            return value
    limit = getattr(tokenizer, "model_max_length", None)
    if isinstance(limit, int) and 0 < limit < 10**9:
        return limit
    return 2048


# What a transformers tokenizer is read from (those a folder holds; `same_tokenizer_files`)
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
)


def same_tokenizer_files(a: str | os.PathLike[str], b: str | os.PathLike[str]) -> bool:
    """Whether local folders `a` and `b` hold the same tokenizer files, byte for byte (a hub id or
    a folder without them: False)."""
    first, second = Path(a), Path(b)
    if not (str(a) and str(b) and first.is_dir() and second.is_dir()):
        return False
    names = [n for n in TOKENIZER_FILES if (first / n).is_file() or (second / n).is_file()]
    return bool(names) and all(
        (first / n).is_file() and (second / n).is_file() and (first / n).read_bytes() == (second / n).read_bytes()
        for n in names
    )
