"""Methods that draft what followed earlier matches of the text's suffix: our suffix automaton
(`suffix`) and SuffixDecoding's own implementation (`arctic-suffix`).

The suffix drafter's field checks live here, so that `hybrid` (in `trees`) reuses them without
the family modules importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, ClassVar, Protocol

from leapdecode.methods.base import MAX_DRAFT, Capabilities, DrafterFactory, Log, Method

if TYPE_CHECKING:
    from leapdecode.models.loading import LoadedModel


class SuffixFields(Protocol):
    """The suffix drafter's parameters, as `suffix` and `hybrid` both carry them."""

    @property
    def factor(self) -> float: ...

    @property
    def min_match(self) -> int: ...

    @property
    def min_prob(self) -> float: ...

    @property
    def index_tokens(self) -> int: ...

    def _require(self, ok: bool, message: str) -> None: ...


def check_suffix_fields(method: SuffixFields) -> None:
    """The suffix drafter's fields, shared by `suffix` and `hybrid`."""
    method._require(0.0 < method.factor <= 64.0, f"factor must be in (0, 64], got {method.factor}")
    method._require(1 <= method.min_match <= 1024, f"min_match must be between 1 and 1024, got {method.min_match}")
    method._require(0.0 <= method.min_prob <= 1.0, f"min_prob must be between 0 and 1, got {method.min_prob}")
    method._require(
        1024 <= method.index_tokens <= 1 << 24,
        f"index_tokens must be between 1024 and {1 << 24}, got {method.index_tokens}",
    )


@dataclass(frozen=True)
class Suffix(Method):
    """SuffixDecoding-style drafting: what followed earlier matches of the suffix, from a suffix automaton."""

    name: ClassVar[str] = "suffix"
    summary: ClassVar[str] = (
        "suffix automaton: a tree of what most often followed an earlier match (any length), optionally across requests"
    )
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

    @property
    def chain_length(self) -> int:
        return self.k

    def __post_init__(self) -> None:
        self._require(1 <= self.k <= MAX_DRAFT, f"k must be between 1 and {MAX_DRAFT}, got {self.k}")
        self._require(0.0 <= self.offset <= MAX_DRAFT, f"offset must be between 0 and {MAX_DRAFT}, got {self.offset}")
        check_suffix_fields(self)

    @property
    def capabilities(self) -> Capabilities:
        return replace(self.kind, drafts="tree" if self.tree else "chain", cost_aware=self.cost_aware)

    @property
    def pass_size(self) -> int:
        return self.k + 1

    def drafter_factory(self, target: LoadedModel, *, draft_model: LoadedModel | None, log: Log) -> DrafterFactory:
        from leapdecode.drafters.suffix import SuffixDrafter, SuffixIndex

        index = SuffixIndex(self.index_tokens) if self.shared else None  # one per decoder, or none
        return lambda sampling, noise: SuffixDrafter(
            self.k,
            self.factor,
            self.offset,
            self.min_match,
            index,
            min_prob=self.min_prob,
            tree=self.tree,
        )


@dataclass(frozen=True)
class ArcticSuffix(Method):
    """Peer: SuffixDecoding's own implementation (arctic-inference) drafting in our engine."""

    name: ClassVar[str] = "arctic-suffix"
    summary: ClassVar[str] = "peer: SuffixDecoding by arctic-inference (`make peers`), verified by this engine"
    kind: ClassVar[Capabilities] = Capabilities("tree")
    k: int = 16  # most tokens drafted per pass (their max_spec_tokens)
    depth: int = 24  # their suffix trees' depth: the longest match
    factor: float = 1.0
    offset: float = 0.0
    min_prob: float = 0.1
    tree: bool = True
    shared: bool = False  # their global tree of earlier responses, across this decoder's requests
    cost_aware: bool = False  # as they draft, uncut

    @property
    def capabilities(self) -> Capabilities:
        return replace(self.kind, drafts="tree" if self.tree else "chain", cost_aware=self.cost_aware)

    def __post_init__(self) -> None:
        self._require(1 <= self.k <= 128, f"k must be between 1 and 128, got {self.k}")
        self._require(1 <= self.depth <= 64, f"depth must be between 1 and 64, got {self.depth}")
        self._require(0.0 < self.factor <= 64.0, f"factor must be in (0, 64], got {self.factor}")
        self._require(0.0 <= self.offset <= 128.0, f"offset must be between 0 and 128, got {self.offset}")
        self._require(0.0 <= self.min_prob <= 1.0, f"min_prob must be between 0 and 1, got {self.min_prob}")

    @property
    def pass_size(self) -> int:
        return self.k + 1

    def drafter_factory(self, target: LoadedModel, *, draft_model: LoadedModel | None, log: Log) -> DrafterFactory:
        from leapdecode.drafters.arctic_suffix import ArcticSuffixDrafter, suffix_cache

        shared = suffix_cache(self.depth, 10000) if self.shared else None  # 10000: as vLLM sets it
        suffix_cache(self.depth, 0)  # fails now, with a clear message, when the package is missing
        return lambda sampling, noise: ArcticSuffixDrafter(
            shared if shared is not None else suffix_cache(self.depth, 0),
            self.k,
            self.factor,
            self.offset,
            self.min_prob,
            self.tree,
        )
