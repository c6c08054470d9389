"""Drafting by copying text: ANPD's n-grams, prompt lookup, suffix matching (chains)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from leapdecode.methods.base import DrafterFactory, Log, Method

if TYPE_CHECKING:
    from leapdecode.drafters.base import Drafter
    from leapdecode.methods.trees import Hybrid
    from leapdecode.models.loading import LoadedModel

MAX_DRAFT = 128  # longest chain a method may draft per pass


@dataclass(frozen=True)
class Anpd(Method):
    """Adaptive N-gram Parallel Decoding (arXiv 2404.08698) with Multi-Level N-gram fallback."""

    name: ClassVar[str] = "anpd"
    summary: ClassVar[str] = "Adaptive N-gram Parallel Decoding: n-gram table from prompt and output, MLN fallback"
    drafts: ClassVar[str] = "chain"
    length_field: ClassVar[str] = "k"
    n: int = 5
    k: int = 7
    # Keep only the part of each draft worth its measured cost: on by default, as it never lost to
    # plain decoding on any Spec-Bench category on either backend and the uncut draft did (BENCHMARKS.md).
    cost_aware: bool = True

    def __post_init__(self) -> None:
        self._require(self.n >= 2, f"n must be >= 2 (an n-gram needs context), got {self.n}")
        self._require(self.k >= 1, f"k must be >= 1 (draft length), got {self.k}")
        self._require(self.n <= 32 and self.k <= MAX_DRAFT, f"n <= 32 and k <= {MAX_DRAFT} expected, got n={self.n}, k={self.k}")

    def build_drafter(self) -> Drafter:
        from leapdecode.drafters.ngram import AnpdDrafter

        return AnpdDrafter(n=self.n, k=self.k)


@dataclass(frozen=True)
class PromptLookup(Method):
    """Prompt lookup decoding (LLMA, arXiv 2304.04487) inside the engine."""

    name: ClassVar[str] = "pld"
    summary: ClassVar[str] = "prompt lookup: copy what followed the latest earlier occurrence of the last tokens"
    drafts: ClassVar[str] = "chain"
    length_field: ClassVar[str] = "k"
    k: int = 10
    max_ngram: int = 3
    min_ngram: int = 1
    cost_aware: bool = False  # keep only the part of each draft worth its measured cost

    def __post_init__(self) -> None:
        self._require(self.k >= 1, f"k must be >= 1, got {self.k}")
        self._require(self.k <= MAX_DRAFT, f"k must be <= {MAX_DRAFT}, got {self.k}")
        self._require(1 <= self.min_ngram <= self.max_ngram, f"need 1 <= min_ngram <= max_ngram, got {self.min_ngram}, {self.max_ngram}")
        self._require(self.max_ngram <= 32, f"max_ngram must be <= 32, got {self.max_ngram}")

    def build_drafter(self) -> Drafter:
        from leapdecode.drafters.prompt_lookup import PromptLookupDrafter

        return PromptLookupDrafter(k=self.k, max_ngram=self.max_ngram, min_ngram=self.min_ngram)


def check_suffix_fields(method: Suffix | Hybrid) -> None:
    """The suffix drafter's fields, shared by `suffix` and `hybrid`."""
    method._require(0.0 < method.factor <= 64.0, f"factor must be in (0, 64], got {method.factor}")
    method._require(1 <= method.min_match <= 1024, f"min_match must be between 1 and 1024, got {method.min_match}")
    method._require(0.0 <= method.min_prob <= 1.0, f"min_prob must be between 0 and 1, got {method.min_prob}")
    method._require(1024 <= method.index_tokens <= 1 << 24, f"index_tokens must be between 1024 and {1 << 24}, got {method.index_tokens}")


@dataclass(frozen=True)
class Suffix(Method):
    """SuffixDecoding-style drafting: what followed earlier matches of the suffix, from a suffix automaton."""

    name: ClassVar[str] = "suffix"
    summary: ClassVar[str] = "suffix automaton: a tree of what most often followed an earlier match (any length), optionally across requests"
    length_field: ClassVar[str] = "k"
    k: int = 16  # most tokens drafted per pass (the tree's nodes)
    factor: float = 1.0  # draft at most factor × match length + offset tokens
    offset: float = 0.0
    min_match: int = 1
    min_prob: float = 0.1  # no drafted token whose estimated probability is lower
    tree: bool = True  # False: the most probable path only, a chain
    # One index of finished requests' outputs for every request of this decoder: drafts may copy
    # one user's output into another's request (README, "Sharing drafts across requests").
    shared: bool = False
    index_tokens: int = 1 << 16  # tokens the shared index keeps, oldest outputs dropped first
    cost_aware: bool = True

    def __post_init__(self) -> None:
        self._require(1 <= self.k <= MAX_DRAFT, f"k must be between 1 and {MAX_DRAFT}, got {self.k}")
        self._require(0.0 <= self.offset <= MAX_DRAFT, f"offset must be between 0 and {MAX_DRAFT}, got {self.offset}")
        check_suffix_fields(self)

    @property
    def drafts(self) -> str:  # type: ignore[override]  # a chain or a tree, as asked
        return "tree" if self.tree else "chain"

    @property
    def pass_size(self) -> int:
        return self.k + 1

    def drafter_factory(self, target: LoadedModel, *, draft_model: LoadedModel | None, log: Log) -> DrafterFactory:
        from leapdecode.drafters.suffix import SuffixDrafter, SuffixIndex

        index = SuffixIndex(self.index_tokens) if self.shared else None  # one per decoder, or none
        return lambda sampling, generator: SuffixDrafter(
            self.k, self.factor, self.offset, self.min_match, index, min_prob=self.min_prob, tree=self.tree,
        )
