"""The benchmark split: training data never holds a prompt the project benchmarks with.

Every prompt of Spec-Bench (MT-Bench's 80 questions among them, both turns) and of HumanEval,
as the benchmark words them, is fingerprinted by word 12-grams: text is lower-cased and cut into
runs of letters, digits and underscores (so whitespace, case and punctuation do not matter). A
conversation that shares any 12-word run with a prompt of 12 words or more, or holds the whole of
a shorter prompt, is dropped. Word runs are hashed (64-bit rolling hashes over the words' string
hashes, within one process) and looked up in a sorted array, so ShareGPT's 17.6k conversations
filter in about ten seconds on one core (3 of them hold a benchmark prompt).

The rest is split by a hash of each conversation's chat, so the held-out part depends only on
the ids (and `seed`), never on `limit` or file order; ShareGPT's split parts of one chat (`ID_0`,
`ID_1`, ...) hash as one, so a chat is never on both sides.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from leapdecode.errors import InputError
from leapdecode.training.data import Conversation, conversation_records

SHINGLE = 12
_WORD = re.compile(r"\w+")
_BASE = 0x9E3779B97F4A7C15  # odd, so invertible modulo 2**64
_PART = re.compile(r"^([A-Za-z0-9]{7})_\d+$")  # ShareGPT's ids: seven letters or digits, then the part
_MARK_MASK = np.uint64((1 << 22) - 1)


def benchmark_texts() -> list[str]:
    """Every prompt the benchmark sends, as it words them: each Spec-Bench turn and each HumanEval
    problem (in the benchmark's template, which holds the problem's code unchanged)."""
    from leapdecode.bench.datasets import humaneval, spec_bench

    return list(dict.fromkeys(p.text for p in spec_bench() + humaneval()))


def _word_ids(text: str) -> np.ndarray:
    words = _WORD.findall(text.lower())
    return np.array([hash(w) for w in words], dtype=np.int64).view(np.uint64)


class _Powers:
    """BASE**i and BASE**-i modulo 2**64, grown as longer texts come."""

    def __init__(self) -> None:
        self.up = np.ones(1, dtype=np.uint64)
        self.down = np.ones(1, dtype=np.uint64)

    def get(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        """The first `n` powers up and down."""
        if len(self.up) < n:
            size = max(n, 2 * len(self.up))
            self.up = _power_table(_BASE, size)
            self.down = _power_table(pow(_BASE, -1, 1 << 64), size)
        return self.up[:n], self.down[:n]


def _power_table(base: int, size: int) -> np.ndarray:
    """base**0 .. base**(size-1) modulo 2**64."""
    table = np.empty(size, dtype=np.uint64)
    table[0] = 1
    if size > 1:
        table[1:] = np.cumprod(np.full(size - 1, base, dtype=np.uint64))
    return table


_POWERS = _Powers()


def _window_hashes(ids: np.ndarray, prefix: np.ndarray, n: int) -> np.ndarray:
    """The hash of each run of `n` words: (P[i+n] - P[i]) / BASE**i, P the prefix sums of id*BASE**j."""
    _, down = _POWERS.get(len(ids))
    return (prefix[n:] - prefix[:-n]) * down[: len(ids) - n + 1]


def _prefix(ids: np.ndarray) -> np.ndarray:
    up, _ = _POWERS.get(len(ids))
    out = np.zeros(len(ids) + 1, dtype=np.uint64)
    np.cumsum(ids * up, out=out[1:])
    return out


def _hits(hashes: np.ndarray, table: np.ndarray, marks: np.ndarray) -> bool:
    """Whether any of `hashes` is in the sorted `table`; `marks` (a bit per low-bits value of
    the table's hashes) rules out most of them first, by one look each."""
    hashes = hashes[marks[hashes & _MARK_MASK]]
    if not hashes.size:
        return False
    at = np.minimum(np.searchsorted(table, hashes), len(table) - 1)
    return bool((table[at] == hashes).any())


class BenchmarkFilter:
    """Tells whether a text or a conversation holds a benchmark prompt (see the module's notes)."""

    def __init__(self, texts: Iterable[str], shingle: int = SHINGLE) -> None:
        self.shingle = shingle
        tables: dict[int, list[np.ndarray]] = {}
        for text in texts:
            ids = _word_ids(text)
            if len(ids):
                n = min(len(ids), shingle)
                tables.setdefault(n, []).append(_window_hashes(ids, _prefix(ids), n))
        self._lengths = sorted(tables, reverse=True)  # run lengths to hash: 12, then shorter prompts' own
        self._table = np.unique(
            np.concatenate([h for parts in tables.values() for h in parts] or [np.empty(0, np.uint64)])
        )
        self._marks = np.zeros(int(_MARK_MASK) + 1, dtype=bool)
        self._marks[self._table & _MARK_MASK] = True

    @classmethod
    def default(cls) -> BenchmarkFilter:
        """The filter over `benchmark_texts()`."""
        return cls(benchmark_texts())

    def matches(self, text: str) -> bool:
        """Whether `text` shares a 12-word run with a long prompt, or holds a short one whole."""
        ids = _word_ids(text)
        lengths = [n for n in self._lengths if n <= len(ids)]
        if not lengths:
            return False
        prefix = _prefix(ids)
        return _hits(np.concatenate([_window_hashes(ids, prefix, n) for n in lengths]), self._table, self._marks)

    def contains_benchmark(self, conv: Conversation) -> bool:
        """Whether any message of the conversation holds a benchmark prompt."""
        return any(self.matches(text) for _, text in conv.messages)


@dataclass
class SplitReport:
    """What `training_conversations` read and kept. read = dropped_malformed + dropped_benchmark
    + train + held_out + over_limit + set_aside."""

    read: int = 0
    dropped_benchmark: int = 0
    dropped_malformed: int = 0
    train: int = 0
    held_out: int = 0
    over_limit: int = 0  # training conversations left out by `limit`
    set_aside: int = 0  # with `held_out_count`: the later parts of a held-out chat, on neither side


def _unit(key: str) -> float:
    """A stable number in [0, 1) from a string."""
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big") / 2**64


def chat_id(conv: Conversation) -> str:
    """The chat a conversation is part of: ShareGPT's split parts `ID_0`, `ID_1`, ... are `ID`'s
    (an id of seven letters or digits, then `_` and a number); any other id is its own chat."""
    match = _PART.match(conv.id)
    return match.group(1) if match else conv.id


def held_out_key(conv: Conversation, seed: int = 0) -> float:
    """Where a conversation's chat falls in [0, 1): held out below the held-out fraction."""
    return _unit(f"{seed}:held-out:{chat_id(conv)}")


def _is_count(value: object, least: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


def _hold_out(
    kept: list[Conversation],
    seed: int,
    held_out: float,
    count: int | None,
) -> tuple[list[Conversation], list[Conversation], int]:
    """(train, held out, set aside): by fraction, every part of a chat keyed below it; by count,
    the first part of each of the `count` lowest-keyed chats, their later parts set aside."""
    keys = {chat_id(c): held_out_key(c, seed) for c in kept}
    if count is None:
        chosen = {chat for chat, key in keys.items() if key < held_out}
    else:
        chosen = set(sorted(keys, key=keys.__getitem__)[:count])
    train, held, seen = [], [], set()
    for conv in kept:
        chat = chat_id(conv)
        if chat not in chosen:
            train.append(conv)
        elif count is None or chat not in seen:
            held.append(conv)
            seen.add(chat)
    return train, held, len(kept) - len(train) - len(held)


def training_conversations(
    source: str,
    *,
    limit: int | None = None,
    seed: int = 0,
    held_out: float = 0.02,
    held_out_count: int | None = None,
    benchmark: BenchmarkFilter | None = None,
) -> tuple[list[Conversation], list[Conversation], SplitReport]:
    """(train, held_out, report) from `source` ("sharegpt" or a .jsonl path), benchmark prompts
    dropped; the whole source is read. Held out: every conversation whose `held_out_key` is below
    `held_out` (a fraction), or, given `held_out_count`, the first part of each of that many
    chats of lowest key (their other parts set aside); either way fixed whatever `limit`.
    `limit` keeps that many training conversations, a seeded sample (the first N of a fixed
    order, so a larger limit keeps the smaller one's). Both lists keep the source's order."""
    if limit is not None and not _is_count(limit, 1):
        raise InputError(f"limit must be a positive integer, got {limit!r}")
    if held_out_count is not None and not _is_count(held_out_count, 0):
        raise InputError(f"held_out_count must be a whole number >= 0, got {held_out_count!r}")
    if not 0 <= held_out < 1:
        raise InputError(f"held_out is a fraction in [0, 1), got {held_out!r}")

    bench = benchmark if benchmark is not None else BenchmarkFilter.default()
    report, kept = SplitReport(), []
    for conv in conversation_records(source):
        report.read += 1
        if conv is None:
            report.dropped_malformed += 1
        elif bench.contains_benchmark(conv):
            report.dropped_benchmark += 1
        else:
            kept.append(conv)
    train, held, report.set_aside = _hold_out(kept, seed, held_out, held_out_count)
    if limit is not None and len(train) > limit:
        order = sorted(range(len(train)), key=lambda i: _unit(f"{seed}:train:{train[i].id}"))
        train = [train[i] for i in sorted(order[:limit])]
        report.over_limit = len(order) - limit
    report.train, report.held_out = len(train), len(held)
    return train, held, report
