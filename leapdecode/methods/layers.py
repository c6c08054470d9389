"""Methods that run the target's own layers: self-speculation, early-exit drafting, CALM."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, ClassVar

from leapdecode.choices import CALM_MEASURES
from leapdecode.early_exit.layer_sets import format_layer_set, parse_layer_set
from leapdecode.errors import MethodError
from leapdecode.methods.base import Capabilities, DrafterFactory, Log, Method, logger

if TYPE_CHECKING:
    from leapdecode.engine.backend import Backend
    from leapdecode.engine.drafting import Drafter
    from leapdecode.models.loading import LoadedModel


def _num_layers(target: LoadedModel) -> int:
    """Decoder layers of a PyTorch model; layer-level methods cannot reach inside llama.cpp."""
    if target.backend != "torch":
        raise MethodError(
            f"layer-level methods (self-spec, layerskip, calm) run on the torch backend, not {target.backend}"
        )
    return int(target.model.config.get_text_config().num_hidden_layers)


class _OwnLayerDrafting(Method):
    """What self-spec and layerskip share: the target drafts up to k tokens with a subset of its
    own layers (its backend says which), stopping after a token its draft doubts."""

    kind: ClassVar[Capabilities] = Capabilities("chain")
    k: int  # fields of the dataclasses below
    threshold: float
    coupled: bool

    @property
    def chain_length(self) -> int:
        return self.k

    @property
    def capabilities(self) -> Capabilities:
        return replace(self.kind, drafts="chain", coupled=self.coupled)

    def _check_drafting(self) -> None:
        self._require(1 <= self.k <= 64, f"k must be between 1 and 64, got {self.k}")
        self._require(0.0 <= self.threshold < 1.0, f"threshold must be in [0, 1), got {self.threshold}")

    def drafter_factory(self, target: LoadedModel, *, draft_model: LoadedModel | None, log: Log) -> DrafterFactory:
        from leapdecode.drafters.self_draft import SelfDrafter

        return lambda sampling, noise: SelfDrafter(
            self.k, self.threshold, sampling=sampling, noise=noise, coupled=self.coupled
        )

    def _backend(self, target: LoadedModel, draft_layers: tuple[int, ...]) -> Backend:
        from leapdecode.early_exit.backend import SelfDraftBackend

        return SelfDraftBackend(target.model, draft_layers)


@dataclass(frozen=True)
class SelfSpec(_OwnLayerDrafting):
    """Self-speculative decoding (Draft & Verify, arXiv 2309.08168): the target skipping layers drafts."""

    name: ClassVar[str] = "self-spec"
    summary: ClassVar[str] = "self-speculative (Draft & Verify): draft with a set of layers skipped, verify with all"
    skip: str = ""  # layers to skip, e.g. 4-9/12; empty: the set saved by `leapdecode calibrate layer-skip`
    k: int = 4
    threshold: float = 0.5  # stop drafting after a token the draft gives less than this
    coupled: bool = True  # sampling: draft with the target's per-position uniforms (see DraftModel)

    def __post_init__(self) -> None:
        if self.skip:
            parse_layer_set(self.skip)
        self._check_drafting()

    def skip_layers(self, target: LoadedModel, log: Log | None = None) -> tuple[int, ...]:
        """The explicit skip set, or the one calibrated for this model's weights, or (never
        calibrated) the default: the ceil(L/10) layers at the middle of the model, which is where
        calibration landed on the models tried (SmolLM2-135M: 13-14 of 30; Qwen2.5-Coder-1.5B:
        14-17 of 28)."""
        from leapdecode.early_exit.layer_sets import LayerSkipCalibration, calibration_path
        from leapdecode.models import default_cache_dir

        layers = _num_layers(target)
        if self.skip:
            skip = parse_layer_set(self.skip)
        else:
            path = calibration_path(default_cache_dir(), target.fingerprint)
            if not path.exists():
                count = -(-layers // 10)
                first = max(1, (layers - count) // 2)
                skip = tuple(range(first, min(first + count, layers - 1)))
                (log or logger.info)(
                    f"self-spec: {target.name!r} has no calibrated skip set; skipping the default, the middle layers "
                    f"{format_layer_set(skip)} (run `leapdecode calibrate layer-skip --model {target.name}` to find a "
                    f"faster set)"
                )
                return skip
            calibration = LayerSkipCalibration.load(path)
            self._require(
                calibration.fingerprint == target.fingerprint and calibration.num_layers == layers,
                f"calibration {path} is for another model",
            )
            skip = parse_layer_set(calibration.skip)
        self._require(max(skip) < layers, f"skip {self.skip!r} names layers past the last, {layers - 1}")
        return skip

    def make_backend(self, target: LoadedModel) -> Backend:
        skip = set(self.skip_layers(target))
        return self._backend(target, tuple(i for i in range(_num_layers(target)) if i not in skip))


@dataclass(frozen=True)
class LayerSkip(_OwnLayerDrafting):
    """LayerSkip-style early-exit drafting (arXiv 2404.16710): draft from layer E, verify with the rest."""

    name: ClassVar[str] = "layerskip"
    summary: ClassVar[str] = (
        "early-exit drafting (LayerSkip): draft from the first E layers, the rest verify reusing their KV"
    )
    exit: int = 0  # drafting layers: 0..exit-1, then the final norm and LM head
    k: int = 4
    threshold: float = 0.0
    coupled: bool = True  # sampling: draft with the target's per-position uniforms (see DraftModel)

    def __post_init__(self) -> None:
        self._require(self.exit >= 1, f"needs exit=E, the number of layers that draft (>= 1), got {self.exit}")
        self._check_drafting()

    def make_backend(self, target: LoadedModel) -> Backend:
        self._require(
            self.exit < _num_layers(target),
            f"exit must be below the model's {_num_layers(target)} layers, got {self.exit}",
        )
        return self._backend(target, tuple(range(self.exit)))


@dataclass(frozen=True)
class Calm(Method):
    """CALM early exit (arXiv 2207.07061): each token leaves at the first confident layer. Lossy."""

    name: ClassVar[str] = "calm"
    summary: ClassVar[str] = (
        "CALM early exit (lossy): a token exits at the first layer whose confidence passes threshold"
    )
    kind: ClassVar[Capabilities] = Capabilities(lossless=False)
    threshold: float = 0.9  # 1 never exits (plain decoding)
    measure: str = "softmax"  # softmax: top-1 minus top-2 probability; state: cosine to the previous layer
    first: int = 0  # first layer after which a token may exit (0-based)
    every: int = 1  # check confidence every this many layers

    def __post_init__(self) -> None:
        self._require(0.0 <= self.threshold <= 1.0, f"threshold must be in [0, 1], got {self.threshold}")
        self._require(
            self.measure in CALM_MEASURES, f"measure must be one of {', '.join(CALM_MEASURES)}, got {self.measure!r}"
        )
        self._require(self.first >= 0, f"first must be >= 0, got {self.first}")
        self._require(self.every >= 1, f"every must be >= 1, got {self.every}")

    def make_backend(self, target: LoadedModel) -> Backend:
        from leapdecode.early_exit.calm import CalmBackend

        self._require(self.first < _num_layers(target), f"first must be below the model's {_num_layers(target)} layers")
        return CalmBackend(target.model, self.measure, self.threshold, self.first, self.every)

    def build_drafter(self) -> Drafter:
        from leapdecode.drafters.base import NoDrafter

        return NoDrafter()
