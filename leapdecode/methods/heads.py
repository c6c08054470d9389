"""Methods whose drafter is a trained head over the target's own states: EAGLE-3 and Medusa."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, ClassVar

from leapdecode.errors import MethodError
from leapdecode.methods.base import Capabilities, DrafterFactory, Log, Method

if TYPE_CHECKING:
    from leapdecode.engine.drafting import Drafter
    from leapdecode.engine.noise import PositionNoise
    from leapdecode.engine.sampling import SamplingParams
    from leapdecode.models.loading import LoadedModel


class _HeadMethod(Method):
    """What both share: a head named by `head` (a folder, a hub id, or "" for the one trained
    here), a chain (width 1) or a tree of `nodes`, cut to what is worth its cost."""

    kind: ClassVar[Capabilities] = Capabilities(loads_files=True)
    head: str
    depth: int
    width: int
    nodes: int
    cost_aware: bool

    @property
    def chain_length(self) -> int:
        return self.depth

    def _check_shape(self, max_depth: int = 16) -> None:
        self._require(1 <= self.depth <= max_depth, f"depth must be between 1 and {max_depth}, got {self.depth}")
        self._require(1 <= self.width <= 16, f"width must be between 1 and 16, got {self.width}")
        self._require(0 <= self.nodes <= 128, f"nodes must be between 0 (depth x width) and 128, got {self.nodes}")

    @property
    def capabilities(self) -> Capabilities:
        return replace(
            self.kind, drafts="chain" if self.width == 1 else "tree", cost_aware=self.cost_aware, head=self.head
        )

    @property
    def tree_nodes(self) -> int:
        return self.nodes or self.depth * self.width

    @property
    def pass_size(self) -> int:
        return (self.tree_nodes if self.width > 1 else self.depth) + 1

    def _like_target(self, module: Any, target: LoadedModel, log: Log) -> None:
        """Quantize the head as the target is (an int4 target drafts with an int4 head): a drafting
        step reads the head's weights, and on a CPU that read is its cost."""
        if target.quantize != "none":
            from leapdecode.models.quantize import quantize_model

            swapped = quantize_model(module, target.quantize)
            log(f"{self.name}: {swapped} of the head's linear layers quantized to {target.quantize}, as the target's")

    def _target_layers(self, target: LoadedModel) -> int:
        if target.backend != "torch":
            raise MethodError(
                f"{self.name}: a trained head reads the target's hidden states: it runs on the torch backend, not "
                f"{target.backend}"
            )
        return int(target.model.config.get_text_config().num_hidden_layers)


@dataclass(frozen=True)
class Eagle3(_HeadMethod):
    """EAGLE-3 (2503.01840): a one-layer head over three of the target's layers drafts a chain,
    or an EAGLE-2 dynamic tree."""

    name: ClassVar[str] = "eagle3"
    summary: ClassVar[str] = "EAGLE-3: a trained head over the target's own states drafts a chain or a dynamic tree"
    head: str = ""  # a folder, a hub id, or "": the head `leapdecode train-drafter` trained for this model
    depth: int = 6
    width: int = 1  # 1: a chain; more: each tree level keeps the `width` best nodes, each with `width` children
    nodes: int = 0  # the tree's size (0: depth x width)
    min_prob: float = 0.1  # stop drafting deeper once no path is this probable (0: always `depth`)
    suffix: bool = False  # graft a suffix match's continuations on (retrieval where the text repeats)
    suffix_k: int = 16  # most suffix tokens grafted on
    cost_aware: bool = True

    def __post_init__(self) -> None:
        self._check_shape()
        self._require(1 <= self.suffix_k <= 128, f"suffix_k must be between 1 and 128, got {self.suffix_k}")
        self._require(0.0 <= self.min_prob < 1.0, f"min_prob must be in [0, 1), got {self.min_prob}")

    @property
    def capabilities(self) -> Capabilities:
        return replace(
            self.kind,
            drafts="tree" if self.suffix or self.width > 1 else "chain",
            cost_aware=self.cost_aware,
            head=self.head,
        )

    @property
    def pass_size(self) -> int:
        return super().pass_size + (self.suffix_k if self.suffix else 0)

    def drafter_factory(self, target: LoadedModel, *, draft_model: LoadedModel | None, log: Log) -> DrafterFactory:
        from leapdecode.drafters.eagle3 import Eagle3Drafter
        from leapdecode.drafters.head_suffix import HeadWithSuffix
        from leapdecode.drafters.suffix import SuffixDrafter
        from leapdecode.heads.eagle3_format import load_eagle3
        from leapdecode.heads.store import head_folder

        self._target_layers(target)
        folder = head_folder(self.head, target, self.name)
        head = load_eagle3(folder, target.model)
        self._like_target(head, target, log)
        log(
            f"eagle3 head from {folder}: layers {list(head.config.aux_layers)}, draft vocabulary "
            f"{head.config.draft_vocab_size}"
        )

        def factory(
            sampling: SamplingParams, noise: PositionNoise
        ) -> Drafter:  # drafts are deterministic: exact under sampling too
            drafter = Eagle3Drafter(
                head, depth=self.depth, width=self.width, nodes=self.tree_nodes, min_prob=self.min_prob
            )
            return HeadWithSuffix(drafter, SuffixDrafter(self.suffix_k)) if self.suffix else drafter

        return factory


@dataclass(frozen=True)
class Medusa(_HeadMethod):
    """Medusa-1 (2401.10774): heads on the target's last state each guess one more token ahead."""

    name: ClassVar[str] = "medusa"
    summary: ClassVar[str] = (
        "Medusa: trained heads on the target's last state guess the next tokens, as a chain or a tree"
    )
    head: str = ""
    depth: int = 4  # heads used (at most the checkpoint's)
    width: int = 1
    nodes: int = 0
    cost_aware: bool = True

    def __post_init__(self) -> None:
        self._check_shape()

    def drafter_factory(self, target: LoadedModel, *, draft_model: LoadedModel | None, log: Log) -> DrafterFactory:
        from leapdecode.drafters.medusa import MedusaDrafter
        from leapdecode.heads.medusa_format import load_medusa
        from leapdecode.heads.store import head_folder

        layers = self._target_layers(target)
        folder = head_folder(self.head, target, self.name)
        heads = load_medusa(folder, target.model)
        self._like_target(heads, target, log)
        if target.quantize != "none" and heads.quantize_shared_head():
            log(f"{self.name}: the shared LM head quantized to int8, as the target's output layer")
        depth = min(self.depth, heads.config.num_heads)
        log(f"medusa heads from {folder}: {heads.config.num_heads} heads of {heads.config.num_layers} layers")

        def factory(sampling: SamplingParams, noise: PositionNoise) -> Drafter:
            return MedusaDrafter(
                heads, layers, tree=self.width > 1, nodes=self.tree_nodes, depth=depth, width=self.width
            )

        return factory
