"""The method a model gets when none is named: the fastest lossless path measured for it.

A preset may name a smaller model with its tokenizer that drafts for it (`Preset.draft`). Where
that draft model is installed, the default is the draft-model method with retrieval first
(`draft:model=...`: a suffix match drafts where text repeats, the draft model elsewhere, both cut
by the measured pass costs), the fastest lossless path measured on Spec-Bench and HumanEval for
the 1.5B on a 2-core CPU (docs/benchmarks.md). Anything else gets `anpd`, which needs nothing
but the model. What was chosen, and why, goes to the caller's log.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from leapdecode.models.presets import get_preset

if TYPE_CHECKING:
    from leapdecode.models.loading import LoadedModel

FALLBACK = "anpd"  # needs nothing but the model: n-grams of the prompt and the output


@dataclass(frozen=True)
class DefaultMethod:
    """A method string chosen for a model, and the reason, said to the user."""

    method: str
    reason: str


def default_method(lm: LoadedModel) -> DefaultMethod:
    """The lossless method `lm` runs fastest with, among what is installed (module doc)."""
    if not lm.preset:
        return DefaultMethod(FALLBACK, "no draft model is known for a model that is not a preset")
    draft = get_preset(lm.preset).draft
    if not draft:
        return DefaultMethod(FALLBACK, f"preset {lm.preset} names no draft model")
    if lm.backend != "torch":
        return DefaultMethod(FALLBACK, f"a draft model runs on the torch backend, not {lm.backend}")
    if not get_preset(draft).installed:
        return DefaultMethod(
            FALLBACK, f"its draft model {draft} is not installed (leapdecode models pull {draft} makes it the default)"
        )
    return DefaultMethod(f"draft:model={draft}", f"its preset's draft model {draft} is installed")
