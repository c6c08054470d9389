"""Plain decoding through the engine: the baseline every speed-up is measured against."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from leapdecode.methods.base import Method

if TYPE_CHECKING:
    from leapdecode.engine.drafting import Drafter


@dataclass(frozen=True)
class Autoregressive(Method):
    name: ClassVar[str] = "ar"
    summary: ClassVar[str] = "plain autoregressive decoding, one token per pass (the baseline)"

    def build_drafter(self) -> Drafter:
        from leapdecode.drafters.base import NoDrafter

        return NoDrafter()
