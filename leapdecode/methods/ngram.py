"""Drafting by copying text: ANPD's n-grams and prompt lookup (chains)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, ClassVar

from leapdecode.methods.base import MAX_DRAFT, Capabilities, Method

if TYPE_CHECKING:
    from leapdecode.engine.drafting import Drafter


@dataclass(frozen=True)
class Anpd(Method):
    """Adaptive N-gram Parallel Decoding (arXiv 2404.08698) with Multi-Level N-gram fallback."""

    name: ClassVar[str] = "anpd"
    summary: ClassVar[str] = "Adaptive N-gram Parallel Decoding: n-gram table from prompt and output, MLN fallback"
    kind: ClassVar[Capabilities] = Capabilities("chain")
    n: int = 5
    k: int = 7
    # Keep only the part of each draft worth its measured cost: on by default, as it never lost to
    # plain decoding on any Spec-Bench category on either backend and the uncut draft did (docs/benchmarks.md).
    cost_aware: bool = True

    @property
    def chain_length(self) -> int:
        return self.k

    @property
    def capabilities(self) -> Capabilities:
        return replace(self.kind, drafts="chain", cost_aware=self.cost_aware)

    def __post_init__(self) -> None:
        self._require(self.n >= 2, f"n must be >= 2 (an n-gram needs context), got {self.n}")
        self._require(self.k >= 1, f"k must be >= 1 (draft length), got {self.k}")
        self._require(
            self.n <= 32 and self.k <= MAX_DRAFT, f"n <= 32 and k <= {MAX_DRAFT} expected, got n={self.n}, k={self.k}"
        )

    def build_drafter(self) -> Drafter:
        from leapdecode.drafters.ngram import AnpdDrafter

        return AnpdDrafter(n=self.n, k=self.k)


@dataclass(frozen=True)
class PromptLookup(Method):
    """Prompt lookup decoding (LLMA, arXiv 2304.04487) inside the engine."""

    name: ClassVar[str] = "pld"
    summary: ClassVar[str] = "prompt lookup: copy what followed the latest earlier occurrence of the last tokens"
    kind: ClassVar[Capabilities] = Capabilities("chain")
    k: int = 10
    max_ngram: int = 3
    min_ngram: int = 1
    cost_aware: bool = False  # keep only the part of each draft worth its measured cost

    @property
    def chain_length(self) -> int:
        return self.k

    @property
    def capabilities(self) -> Capabilities:
        return replace(self.kind, drafts="chain", cost_aware=self.cost_aware)

    def __post_init__(self) -> None:
        self._require(self.k >= 1, f"k must be >= 1, got {self.k}")
        self._require(self.k <= MAX_DRAFT, f"k must be <= {MAX_DRAFT}, got {self.k}")
        self._require(
            1 <= self.min_ngram <= self.max_ngram,
            f"need 1 <= min_ngram <= max_ngram, got {self.min_ngram}, {self.max_ngram}",
        )
        self._require(self.max_ngram <= 32, f"max_ngram must be <= 32, got {self.max_ngram}")

    def build_drafter(self) -> Drafter:
        from leapdecode.drafters.prompt_lookup import PromptLookupDrafter

        return PromptLookupDrafter(k=self.k, max_ngram=self.max_ngram, min_ngram=self.min_ngram)
