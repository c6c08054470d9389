"""Draft vocabularies: the target tokens a drafter may propose, and where the ranking comes from.

Why: a drafter's output layer scores every token of the vocabulary on every drafted token, and on
a CPU that is a quarter of a small draft model's bytes (the 0.5B Qwen2.5's 151,936 x 896 head)
spent on tokens that are almost never drafted. Restricted to the tokens the target emits most,
the layer costs a fraction and the draft loses little acceptance (VocabTrim, FR-Spec).

What: `DraftVocabulary` (draft id -> target id, in EAGLE's `d2t` form too), built from a count
(`most_frequent`), and a ranking of a tokenizer's tokens by how often answers use them: one
counted here (`leapdecode draft-vocab`, on ShareGPT answers or a file of conversations) is kept
per tokenizer in the cache; the presets' tokenizer has one shipped with the package
(`leapdecode/data/draft_vocab/`: the 1.5B's own answers to prompts written for the repository,
see its README), so a fresh machine drafts as the documented figures did. Without either, the
tokenizer's own order stands in: byte-level BPE numbers tokens in the order their merges were
learned, most frequent pairs first.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

RANKING_FORMAT = 1


@dataclass(frozen=True)
class DraftVocabulary:
    """The draft vocabulary: `ids[i]` is draft token i's target id (most frequent first)."""

    ids: tuple[int, ...]
    target_size: int

    @classmethod
    def most_frequent(
        cls, sequences: Iterable[Iterable[int]], size: int, target_size: int, always: Iterable[int] = ()
    ) -> DraftVocabulary:
        """The `size` target tokens seen most often (ties: lower id first), `always` included
        (end-of-turn tokens), sorted by target id as EAGLE's d2t offsets expect."""
        return cls.from_ranking(count_ranking(sequences), size, target_size, always)

    def d2t(self) -> torch.Tensor:
        """[draft]: offsets, target id = draft id + d2t[draft id]."""
        ids = torch.tensor(self.ids, dtype=torch.long)
        return ids - torch.arange(len(ids))

    def t2d(self) -> torch.Tensor:
        """[target]: True where the draft vocabulary holds the target id."""
        mask = torch.zeros(self.target_size, dtype=torch.bool)
        mask[list(self.ids)] = True
        return mask

    def to_draft(self) -> torch.Tensor:
        """[target]: each target id's draft id, -1 outside the draft vocabulary."""
        table = torch.full((self.target_size,), -1, dtype=torch.long)
        table[list(self.ids)] = torch.arange(len(self.ids))
        return table

    @classmethod
    def from_ranking(
        cls, ranking: Sequence[int], size: int, target_size: int, always: Iterable[int] = ()
    ) -> DraftVocabulary:
        """The first `size` tokens of `ranking` (most used first), `always` included, then the
        lowest unranked ids if the ranking is short; sorted by target id."""
        chosen = dict.fromkeys(t for t in always if 0 <= t < target_size)
        for t in (*ranking, *range(target_size)):
            if len(chosen) >= min(size, target_size):
                break
            if 0 <= t < target_size:
                chosen.setdefault(t)
        return cls(tuple(sorted(chosen)), target_size)


def tokenizer_key(tokenizer: Any) -> str:
    """A tokenizer's identity for caches: the hash of its vocabulary (token -> id)."""
    vocab = sorted(tokenizer.get_vocab().items())
    return hashlib.sha256(json.dumps(vocab, ensure_ascii=True).encode()).hexdigest()[:16]


def ranking_path(cache: Path, tokenizer: Any) -> Path:
    return cache / "vocab" / f"{tokenizer_key(tokenizer)}-v{RANKING_FORMAT}.json"


SHIPPED = Path(__file__).resolve().parent.parent / "data" / "draft_vocab"  # rankings shipped for the presets


def shipped_ranking_path(tokenizer: Any, folder: Path = SHIPPED) -> Path:
    return folder / f"{tokenizer_key(tokenizer)}-v{RANKING_FORMAT}.json"


def count_ranking(sequences: Iterable[Iterable[int]]) -> list[int]:
    """Every token seen in `sequences`, most often first (ties: lower id first)."""
    counts: Counter[int] = Counter()
    for seq in sequences:
        counts.update(seq)
    return [t for t, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))]


def save_ranking(path: Path, ranking: Sequence[int], source: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps({"source": source, "ranking": list(ranking)}))
    partial.replace(path)  # whole or absent


def load_ranking(path: Path) -> tuple[list[int], str] | None:
    """(ranking, what it was counted on), or None when there is none (or it is unreadable)."""
    try:
        data = json.loads(path.read_text())
        return [int(t) for t in data["ranking"]], str(data["source"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def draft_vocabulary(
    tokenizer: Any, size: int, target_size: int, always: Iterable[int], cache: Path, shipped: Path = SHIPPED
) -> tuple[DraftVocabulary, str]:
    """The `size` tokens answers use most by the tokenizer's ranking counted here, else the one
    shipped for it, else by its own order (see the module doc); and which it is."""
    found = load_ranking(ranking_path(cache, tokenizer)) or load_ranking(shipped_ranking_path(tokenizer, shipped))
    if found is not None:
        ranking, source = found
        return DraftVocabulary.from_ranking(ranking, size, target_size, always), f"counted on {source}"
    return DraftVocabulary.from_ranking(range(target_size), size, target_size, always), (
        "the tokenizer's own order; `leapdecode draft-vocab` counts a ranking"
    )
