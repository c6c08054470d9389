"""REST (Retrieval-Based Speculative Decoding, arXiv 2311.08252): drafts retrieved from a
datastore of text or code instead of a draft model.

The datastore is a corpus tokenised with the target's tokenizer and a suffix array over it
(positions sorted by the tokens that follow them, the first `KEY` tokens deciding). A draft
looks up the longest suffix of the context (`max_suffix` .. `min_suffix` tokens) by binary
search, reads what followed up to `matches` occurrences, and merges those continuations into
a trie by frequency; the most frequent branches become the draft tree.

`leapdecode datastore build --model M CORPUS OUT` writes `tokens.npy`, `suffixes.npy` and
`meta.json` (with a fingerprint of the tokenizer, checked when the datastore is used).
"""

from __future__ import annotations

import bisect
import hashlib
import json
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from leapdecode.drafters.base import StreamDrafter
from leapdecode.drafters.tree_builder import best_first_tree
from leapdecode.engine.drafting import Draft
from leapdecode.errors import InputError

KEY = 16  # suffixes are sorted by their first KEY tokens; longer lookups are not needed
FORMAT = "leapdecode-datastore-1"
TEXT_SUFFIXES = (
    ".py",
    ".txt",
    ".md",
    ".rst",
    ".json",
    ".jsonl",
    ".c",
    ".h",
    ".js",
    ".ts",
    ".java",
    ".go",
    ".rs",
    ".html",
)


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """A short hash of a tokenizer's vocabulary: two tokenizers agree iff their ids do."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
    return hashlib.sha256(json.dumps(vocab).encode()).hexdigest()[:16]


def sort_suffixes(tokens: np.ndarray) -> np.ndarray:
    """Positions of `tokens` sorted by the KEY tokens from each (shorter, at the end, first)."""
    padded = np.concatenate([tokens.astype(np.int32), np.full(KEY, -1, dtype=np.int32)])
    columns = [padded[j : j + len(tokens)] for j in range(KEY)]
    return np.lexsort(columns[::-1]).astype(np.int64)  # lexsort's last key is the primary one


@dataclass(frozen=True)
class Datastore:
    tokens: np.ndarray  # [N] int32: documents joined by `separator`
    suffixes: np.ndarray  # [N] int64: positions sorted by the tokens that follow them
    meta: dict[str, Any]

    @property
    def separator(self) -> int:
        return int(self.meta["separator"])

    @classmethod
    def from_documents(cls, documents: Iterable[Sequence[int]], separator: int, meta: dict[str, Any]) -> Datastore:
        chunks: list[int] = []
        files = 0
        for document in documents:
            chunks.extend(document)
            chunks.append(separator)
            files += 1
        if not chunks:
            raise InputError("the corpus is empty: no documents to index")
        tokens = np.asarray(chunks, dtype=np.int32)
        meta = {**meta, "format": FORMAT, "separator": separator, "documents": files, "tokens": len(tokens)}
        return cls(tokens, sort_suffixes(tokens), meta)

    def save(self, out: Path) -> None:
        out.mkdir(parents=True, exist_ok=True)
        np.save(out / "tokens.npy", self.tokens)
        np.save(out / "suffixes.npy", self.suffixes)
        (out / "meta.json").write_text(json.dumps(self.meta, indent=2), encoding="utf-8")

    @classmethod
    def load(cls, folder: str | Path) -> Datastore:
        folder = Path(folder)
        if not folder.is_dir():
            raise InputError(
                f"no datastore at {folder}: build one with `leapdecode datastore build --model M CORPUS {folder}`"
            )
        try:
            meta = json.loads((folder / "meta.json").read_text(encoding="utf-8"))
            tokens = np.load(folder / "tokens.npy", allow_pickle=False)
            suffixes = np.load(folder / "suffixes.npy", allow_pickle=False)
        except (OSError, ValueError) as exc:
            raise InputError(f"{folder} is not a readable datastore ({exc}); rebuild it") from None
        if (
            meta.get("format") != FORMAT
            or tokens.ndim != 1
            or suffixes.shape != tokens.shape
            or len(tokens) != meta.get("tokens")
        ):
            raise InputError(f"{folder} is not a valid datastore (format, sizes or meta.json disagree); rebuild it")
        return cls(tokens, suffixes, meta)

    def check_tokenizer(self, tokenizer: Any, model_name: str) -> None:
        if self.meta.get("tokenizer") != tokenizer_fingerprint(tokenizer):
            raise InputError(
                f"the datastore was built with the tokenizer of {self.meta.get('model')!r}, which differs from "
                f"{model_name!r}'s: rebuild it with `leapdecode datastore build --model {model_name} ...`"
            )

    def _key(self, length: int) -> Callable[[int], tuple[int, ...]]:
        tokens = self.tokens
        return lambda position: tuple(tokens[position : position + length].tolist())

    def lookup(self, context: Sequence[int], max_suffix: int, min_suffix: int, matches: int) -> tuple[int, np.ndarray]:
        """(suffix length, up to `matches` positions right after an occurrence of the context's
        last `suffix length` tokens), trying the longest suffix first; (0, []) when none occurs."""
        for length in range(min(max_suffix, KEY, len(context)), min_suffix - 1, -1):
            pattern = tuple(int(t) for t in context[-length:])
            key = self._key(length)
            lo = bisect.bisect_left(self.suffixes, pattern, key=key)
            hi = bisect.bisect_right(self.suffixes, pattern, lo=lo, key=key)
            if hi > lo:
                # spread the sample over the range: it is sorted by continuation
                picks = np.unique(np.linspace(lo, hi - 1, num=min(matches, hi - lo)).astype(np.int64))
                return length, self.suffixes[picks] + length
        return 0, np.empty(0, dtype=np.int64)


def build_datastore(
    tokenizer: Any, model_name: str, corpus: Path, suffixes: Sequence[str] = TEXT_SUFFIXES
) -> Datastore:
    """Tokenise every text file under `corpus` (or the file itself) and index it."""
    if corpus.is_file():
        files = [corpus]
    elif corpus.is_dir():
        files = sorted(p for p in corpus.rglob("*") if p.is_file() and p.suffix in suffixes)
    else:
        raise InputError(f"no corpus at {corpus}: give a folder of text or code files, or one file")
    if not files:
        raise InputError(f"no text files ({', '.join(suffixes)}) under {corpus}")

    def documents() -> Iterable[list[int]]:
        for path in files:
            try:
                text = path.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue  # binary or unreadable: not corpus text
            if text.strip():
                yield tokenizer(text, add_special_tokens=False)["input_ids"]

    separator = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
    meta = {"model": model_name, "tokenizer": tokenizer_fingerprint(tokenizer), "corpus": str(corpus)}
    return Datastore.from_documents(documents(), separator, meta)


class RestDrafter(StreamDrafter):
    def __init__(
        self,
        datastore: Datastore,
        nodes: int = 8,
        depth: int = 4,
        matches: int = 64,
        max_suffix: int = 8,
        min_suffix: int = 2,
    ) -> None:
        self.datastore = datastore
        self.nodes = nodes
        self.depth = depth
        self.matches = matches
        self.max_suffix = max_suffix
        self.min_suffix = min_suffix
        self.tokens: list[int] = []

    def reset(self, prompt_ids: Sequence[int]) -> None:
        self.tokens = list(prompt_ids)

    def update(self, tokens: Sequence[int], num_accepted: int) -> None:
        self.tokens.extend(tokens)

    def propose(self, max_tokens: int) -> Draft:
        depth = min(self.depth, max_tokens)
        if depth <= 0:
            return Draft()
        _, starts = self.datastore.lookup(self.tokens, self.max_suffix, self.min_suffix, self.matches)
        if not len(starts):
            return Draft()
        # a trie of the continuations, counted: {path: {token: count}}
        counts: dict[tuple[int, ...], dict[int, int]] = {}
        store, separator = self.datastore.tokens, self.datastore.separator
        for start in starts.tolist():
            path: tuple[int, ...] = ()
            for token in store[start : start + depth].tolist():
                if token == separator:
                    break
                branch = counts.setdefault(path, {})
                branch[token] = branch.get(token, 0) + 1
                path += (token,)

        def children(path: tuple[int, ...]) -> list[tuple[int, float]]:
            branch = counts.get(path, {})
            total = sum(branch.values())
            return [(token, count / total) for token, count in sorted(branch.items(), key=lambda item: -item[1])]

        return best_first_tree(children, self.nodes, depth)
