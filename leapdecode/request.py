"""A generation's options and limits, in one value checked once: `RequestSpec`.

The library (`Decoder.start`), the command line and the server build the same value, so a rule
(a range, a type, the model's context) lives in one place and every caller refuses the same
input with the same message. Each refusal names the option it concerns (`RequestError.param`),
which the server reports as the OpenAI API's `param` (`max_new_tokens` is its `max_tokens`).
`SamplingParams` checks its own fields and names them the same way.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from leapdecode.engine.sampling import SamplingParams
from leapdecode.errors import RequestError
from leapdecode.verifiers.verdict import MAX_TOP_LOGPROBS

if TYPE_CHECKING:
    from leapdecode.models import LoadedModel

DEFAULT_MAX_NEW_TOKENS = 128


def _whole(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class RequestSpec:
    """What one generation asks for besides its prompt: its budget, its stop strings, how it
    samples (`SamplingParams`: greedy at temperature 0) and how many alternatives each emitted
    token's log-probability comes with (None: none)."""

    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    stop: tuple[str, ...] = ()
    sampling: SamplingParams = field(default_factory=SamplingParams)
    logprobs: int | None = None

    def __post_init__(self) -> None:
        if not _whole(self.max_new_tokens) or self.max_new_tokens <= 0:
            raise RequestError(
                f"max_new_tokens must be a positive integer, got {self.max_new_tokens!r}", "max_new_tokens"
            )
        if not all(isinstance(s, str) for s in self.stop):
            raise RequestError(f"stop must be strings, got {list(self.stop)!r}", "stop")
        if self.logprobs is not None and (not _whole(self.logprobs) or not 0 <= self.logprobs <= MAX_TOP_LOGPROBS):
            raise RequestError(
                f"logprobs must be an integer from 0 to {MAX_TOP_LOGPROBS} or None, got {self.logprobs!r}", "logprobs"
            )

    @classmethod
    def of(
        cls,
        *,
        max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
        stop: Sequence[str] = (),
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int | None = None,
        logprobs: int | None = None,
    ) -> RequestSpec:
        """The spec from the options as `Decoder.stream` takes them; raises `RequestError`."""
        sampling = SamplingParams(temperature, top_k, top_p, seed)  # raises RequestError, naming the option
        stops = (stop,) if isinstance(stop, str) else tuple(stop)
        return cls(max_new_tokens, stops, sampling, logprobs)

    def fit(self, lm: LoadedModel, prompt_ids: Sequence[int]) -> None:
        """Raise `RequestError` unless the prompt and the budget fit the model's context."""
        limit = lm.max_context
        if len(prompt_ids) >= limit:
            raise RequestError(
                f"the prompt is too long: {len(prompt_ids)} tokens; model {lm.name!r} takes at most {limit - 1}",
                "prompt",
                "context_length_exceeded",
            )
        if len(prompt_ids) + self.max_new_tokens > limit:
            raise RequestError(
                f"prompt ({len(prompt_ids)} tokens) + max_new_tokens ({self.max_new_tokens}) exceeds the context of "
                f"{limit}; ask for at most {limit - len(prompt_ids)} new tokens",
                "max_new_tokens",
                "context_length_exceeded",
            )
