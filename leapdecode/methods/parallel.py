"""Parallel decoding: the model guesses ahead of itself (Jacobi, Lookahead). No drafter model."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from leapdecode.choices import JACOBI_INITS, JACOBI_MODES
from leapdecode.methods.base import Capabilities, Method

if TYPE_CHECKING:
    from leapdecode.engine.drafting import Drafter


@dataclass(frozen=True)
class Jacobi(Method):
    """Jacobi decoding (arXiv 2305.10427): guess a block, refine every guess from one pass."""

    name: ClassVar[str] = "jacobi"
    summary: ClassVar[str] = "Jacobi decoding: a block of guesses refined by the model's own predictions each pass"
    kind: ClassVar[Capabilities] = Capabilities("chain")
    block: int = 3
    mode: str = "sliding"
    init: str = "repeat"

    @property
    def chain_length(self) -> int:
        return self.block

    def __post_init__(self) -> None:
        self._require(1 <= self.block <= 64, f"block must be between 1 and 64, got {self.block}")
        self._require(self.mode in JACOBI_MODES, f"mode must be one of {', '.join(JACOBI_MODES)}, got {self.mode!r}")
        self._require(self.init in JACOBI_INITS, f"init must be one of {', '.join(JACOBI_INITS)}, got {self.init!r}")

    def build_drafter(self) -> Drafter:
        from leapdecode.drafters.jacobi import JacobiDrafter

        return JacobiDrafter(self.block, self.mode, self.init)


@dataclass(frozen=True)
class Lookahead(Method):
    """Lookahead decoding (arXiv 2402.02057): a Jacobi window feeding an n-gram pool, verified in the same pass."""

    name: ClassVar[str] = "lookahead"
    summary: ClassVar[str] = (
        "Lookahead decoding: Jacobi window (w x n-1) fills an n-gram pool; g n-grams verified per pass"
    )
    kind: ClassVar[Capabilities] = Capabilities("tree")
    w: int = 2
    n: int = 3
    g: int = 2
    anpd: bool = False

    def __post_init__(self) -> None:
        self._require(2 <= self.w <= 32, f"w (window) must be between 2 and 32, got {self.w}")
        self._require(2 <= self.n <= 8, f"n (n-gram size) must be between 2 and 8, got {self.n}")
        self._require(0 <= self.g <= 32, f"g (verified n-grams) must be between 0 and 32, got {self.g}")

    @property
    def pass_size(self) -> int:
        """The pending token, the Jacobi window and the n-grams verified."""
        return 1 + (self.w + self.g) * (self.n - 1)

    def build_drafter(self) -> Drafter:
        from leapdecode.drafters.lookahead import LookaheadDrafter

        return LookaheadDrafter(self.w, self.n, self.g, self.anpd)
