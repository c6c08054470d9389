"""Methods that draft token trees: ANPD's n-grams, a trie of the request, a REST datastore,
recycled candidates, and recycled candidates with a suffix match (hybrid)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, ClassVar

from leapdecode.methods.base import Capabilities, DrafterFactory, Log, Method
from leapdecode.methods.suffix import check_suffix_fields

if TYPE_CHECKING:
    from leapdecode.engine.drafting import Drafter
    from leapdecode.models.loading import LoadedModel


class _TreeMethod(Method):
    """Shared checks of a tree's size."""

    kind: ClassVar[Capabilities] = Capabilities("tree")
    nodes: int  # fields of the dataclasses below
    depth: int

    @property
    def pass_size(self) -> int:
        return self.nodes + 1

    def _check_tree(self) -> None:
        self._require(1 <= self.nodes <= 128, f"nodes must be between 1 and 128, got {self.nodes}")
        self._require(1 <= self.depth <= 64, f"depth must be between 1 and 64, got {self.depth}")


@dataclass(frozen=True)
class AnpdTree(_TreeMethod):
    """ANPD's N-gram module drafting a token tree (top continuations across MLN levels)."""

    name: ClassVar[str] = "anpd-tree"
    summary: ClassVar[str] = "ANPD drafting a token tree: top n-gram continuations merged, verified in one pass"
    n: int = 5
    nodes: int = 8
    depth: int = 4
    width: int = 3

    def __post_init__(self) -> None:
        self._require(2 <= self.n <= 32, f"n must be between 2 and 32, got {self.n}")
        self._check_tree()
        self._require(1 <= self.width <= 16, f"width must be between 1 and 16, got {self.width}")

    def build_drafter(self) -> Drafter:
        from leapdecode.drafters.anpd_tree import AnpdTreeDrafter

        return AnpdTreeDrafter(n=self.n, nodes=self.nodes, depth=self.depth, width=self.width)


@dataclass(frozen=True)
class Trie(_TreeMethod):
    """Lookahead-style multi-branch retrieval from a trie of the prompt's and output's n-grams."""

    name: ClassVar[str] = "trie"
    summary: ClassVar[str] = "trie of the prompt's and output's n-grams: the latest match's frequent branches as a tree"
    nodes: int = 8
    depth: int = 4
    window: int = 12
    max_match: int = 4
    prompt_weight: int = 2

    def __post_init__(self) -> None:
        self._check_tree()
        self._require(2 <= self.window <= 64, f"window must be between 2 and 64, got {self.window}")
        self._require(1 <= self.max_match < self.window, f"need 1 <= max_match < window, got {self.max_match}")
        self._require(
            1 <= self.prompt_weight <= 1000, f"prompt_weight must be between 1 and 1000, got {self.prompt_weight}"
        )

    def build_drafter(self) -> Drafter:
        from leapdecode.drafters.trie import TrieDrafter

        return TrieDrafter(self.nodes, self.depth, self.window, self.max_match, self.prompt_weight)


@dataclass(frozen=True)
class Rest(_TreeMethod):
    """REST: retrieval from a datastore built with `leapdecode datastore build`."""

    name: ClassVar[str] = "rest"
    summary: ClassVar[str] = "REST: continuations retrieved from a datastore (suffix array) merged into a tree"
    kind: ClassVar[Capabilities] = Capabilities("tree", loads_files=True)
    datastore: str = ""
    nodes: int = 8
    depth: int = 4
    matches: int = 64
    max_suffix: int = 8
    min_suffix: int = 2

    def __post_init__(self) -> None:
        self._require(bool(self.datastore), "needs datastore=DIR (build one with `leapdecode datastore build`)")
        self._check_tree()
        self._require(1 <= self.matches <= 4096, f"matches must be between 1 and 4096, got {self.matches}")
        self._require(
            1 <= self.min_suffix <= self.max_suffix <= 16,
            f"need 1 <= min_suffix <= max_suffix <= 16, got {self.min_suffix}, {self.max_suffix}",
        )

    def drafter_factory(self, target: LoadedModel, *, draft_model: LoadedModel | None, log: Log) -> DrafterFactory:
        from leapdecode.drafters.rest import Datastore, RestDrafter

        store = Datastore.load(self.datastore)
        store.check_tokenizer(target.tokenizer, target.name)
        return lambda sampling, noise: RestDrafter(
            store,
            self.nodes,
            self.depth,
            self.matches,
            self.max_suffix,
            self.min_suffix,
        )


@dataclass(frozen=True)
class Recycle(_TreeMethod):
    """Token Recycling: a tree from the top-k candidates the target already scored after each token."""

    name: ClassVar[str] = "recycle"
    summary: ClassVar[str] = (
        "Token Recycling: trees from the target's own top-k candidates of earlier passes (no repetition needed)"
    )
    k: int = 8
    nodes: int = 8
    depth: int = 4
    width: int = 4
    shared: bool = False
    cost_aware: bool = True  # keep only the part of each tree worth its measured cost

    @property
    def capabilities(self) -> Capabilities:
        return replace(self.kind, drafts="tree", cost_aware=self.cost_aware)

    def __post_init__(self) -> None:
        self._check_tree()
        self._require(1 <= self.k <= 64, f"k must be between 1 and 64, got {self.k}")
        self._require(1 <= self.width <= self.k, f"width must be between 1 and k ({self.k}), got {self.width}")

    def drafter_factory(self, target: LoadedModel, *, draft_model: LoadedModel | None, log: Log) -> DrafterFactory:
        from leapdecode.drafters.recycle import RecycleDrafter, RecycleTable

        table = RecycleTable(self.k) if self.shared else None  # one table for every request of this decoder
        return lambda sampling, noise: RecycleDrafter(self.k, self.nodes, self.depth, self.width, table)


@dataclass(frozen=True)
class Hybrid(Recycle):
    """A recycled tree and a suffix match's continuations merged into one tree per pass."""

    name: ClassVar[str] = "hybrid"
    summary: ClassVar[str] = "suffix match + Token Recycling in one tree, cut to what is worth its cost"
    suffix_k: int = 16  # most suffix tokens grafted on
    factor: float = 1.0  # the suffix branches: at most factor × match length tokens
    min_match: int = 1
    min_prob: float = 0.1  # no suffix branch token whose estimated probability is lower
    index_tokens: int = 1 << 16  # shared=true: the suffix index of earlier outputs keeps this many tokens

    def __post_init__(self) -> None:
        super().__post_init__()
        self._require(1 <= self.suffix_k <= 128, f"suffix_k must be between 1 and 128, got {self.suffix_k}")
        check_suffix_fields(self)

    @property
    def pass_size(self) -> int:
        return self.nodes + self.suffix_k + 1

    def drafter_factory(self, target: LoadedModel, *, draft_model: LoadedModel | None, log: Log) -> DrafterFactory:
        from leapdecode.drafters.hybrid import HybridDrafter
        from leapdecode.drafters.recycle import RecycleDrafter, RecycleTable
        from leapdecode.drafters.suffix import SuffixDrafter, SuffixIndex

        # shared=true: one recycling table and one suffix index for every request of this decoder
        table = RecycleTable(self.k) if self.shared else None
        index = SuffixIndex(self.index_tokens) if self.shared else None
        return lambda sampling, noise: HybridDrafter(
            SuffixDrafter(self.suffix_k, self.factor, 0.0, self.min_match, index, min_prob=self.min_prob),
            RecycleDrafter(self.k, self.nodes, self.depth, self.width, table),
        )
