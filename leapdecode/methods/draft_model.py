"""Draft-model speculative decoding: a smaller model with the same tokenizer drafts the chain."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from leapdecode.errors import MethodError, ModelLoadError
from leapdecode.methods.base import DrafterFactory, Log, Method

if TYPE_CHECKING:
    from leapdecode.drafters.base import Drafter
    from leapdecode.engine.noise import PositionNoise
    from leapdecode.engine.sampling import SamplingParams
    from leapdecode.models.loading import LoadedModel

SCHEDULES = ("constant", "heuristic")  # as `leapdecode.drafters.draft_model.SCHEDULES`
CASCADE_N = 5  # the n-gram order of ANPD at the bottom of the cascade


@dataclass(frozen=True)
class DraftModel(Method):
    """Speculative decoding with a smaller draft model (Leviathan et al.; Chen et al.)."""

    name: ClassVar[str] = "draft"
    summary: ClassVar[str] = "draft-model speculative decoding: a smaller model with the same tokenizer drafts k tokens"
    drafts: ClassVar[str] = "chain"
    length_field: ClassVar[str] = "k"
    loads_files: ClassVar[bool] = True
    model: str = ""
    k: int = 5
    schedule: str = "constant"  # or "heuristic": adapt k from the last verdict
    threshold: float = 0.0  # stop drafting after a token the draft model gives less than this
    cascade: bool = False  # ANPD drafts for the draft model (vertical cascade)
    # sampling: the draft model picks with the target's own per-position uniforms, so a sampled
    # text equals plain sampling's (False: its own noise, verified by min(1, p/q))
    coupled: bool = True

    def __post_init__(self) -> None:
        self._require(1 <= self.k <= 64, f"k must be between 1 and 64, got {self.k}")
        self._require(self.schedule in SCHEDULES, f"schedule must be one of {', '.join(SCHEDULES)}, got {self.schedule!r}")
        self._require(0.0 <= self.threshold < 1.0, f"threshold must be in [0, 1), got {self.threshold}")

    def drafter_factory(self, target: LoadedModel, *, draft_model: LoadedModel | None, log: Log) -> DrafterFactory:
        from leapdecode.drafters.draft_model import DraftModelDrafter
        from leapdecode.engine.backend import TorchBackend
        from leapdecode.models.loading import load_model

        if target.backend != "torch":
            raise MethodError(f"draft: draft-model decoding runs on the torch backend, not {target.backend}")
        if draft_model is None:
            if not self.model:
                raise MethodError("draft: needs model=NAME (a preset, folder, .gguf or hub id) for the draft model")
            draft_model = load_model(self.model, device=target.device, dtype=target.model.dtype, quantize=target.quantize, log=log)
        check_same_vocabulary(target, draft_model)
        backend = TorchBackend(draft_model.model)
        cascade_n = CASCADE_N if self.cascade else 0

        def factory(sampling: SamplingParams, noise: PositionNoise) -> Drafter:
            return DraftModelDrafter(
                backend, self.k, sampling=sampling, noise=noise, coupled=self.coupled, schedule=self.schedule,
                threshold=self.threshold, cascade_n=cascade_n,
            )

        return factory


def check_same_vocabulary(target: LoadedModel, draft: LoadedModel) -> None:
    """Speculative decoding compares p and q token by token: both models must share one vocabulary."""
    width = (target.model.config.get_text_config().vocab_size, draft.model.config.get_text_config().vocab_size)
    if width[0] != width[1]:
        raise ModelLoadError(
            f"draft model {draft.name!r} scores {width[1]} tokens but {target.name!r} scores {width[0]}: "
            "a draft model must share the target's tokenizer"
        )
    if target.tokenizer.get_vocab() != draft.tokenizer.get_vocab():
        raise ModelLoadError(f"draft model {draft.name!r} has a different tokenizer vocabulary from {target.name!r}")
