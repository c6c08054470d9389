"""Request bodies of the OpenAI-compatible API (pydantic), with the OpenAI defaults."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StrictInt, field_validator, model_validator

from leapdecode.verifiers.verdict import MAX_TOP_LOGPROBS

MAX_STOP_STRINGS = 4  # as in the OpenAI API
MAX_SEED = 2**63 - 1  # what a torch generator takes
MAX_CHOICES = 128  # `n`, as in the OpenAI API

# Fields the OpenAI API has and this server does not implement: refused, never silently ignored.
UNSUPPORTED = (
    "echo",
    "best_of",
    "suffix",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logit_bias",
    "response_format",
    "tools",
    "tool_choice",
    "functions",
    "function_call",
)
# MAX_TOP_LOGPROBS (verifiers.verdict), as in the OpenAI API (chat); completions' `logprobs` takes the same bound


def _valid_unicode(value: str) -> str:
    """JSON may carry lone surrogates (\\ud800), which no tokenizer or UTF-8 encoder accepts."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("contains invalid Unicode (a lone surrogate)") from None
    return value


Text = Annotated[str, AfterValidator(_valid_unicode)]


class LeapDecodeOptions(BaseModel):
    """The extra `leapdecode` field: per-request method choice."""

    model_config = ConfigDict(extra="forbid")
    method: Text | None = None


class StreamOptions(BaseModel):
    include_usage: bool = Field(default=False, strict=True)


class _Common(BaseModel):
    # Unknown fields are kept aside and ignored (clients send newer ones), except the OpenAI
    # fields this server does not implement (`unsupported`); known fields are strictly typed.
    model_config = ConfigDict(extra="allow")

    model: Text
    max_tokens: int | None = Field(default=None, strict=True)
    # a non-finite number is refused as such (NaN compares false with every bound)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0, strict=True, allow_inf_nan=False)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, strict=True, allow_inf_nan=False)
    stop: Text | list[Text] | None = None
    seed: int | None = Field(default=None, strict=True, ge=-MAX_SEED - 1, le=MAX_SEED)
    stream: bool = Field(default=False, strict=True)
    stream_options: StreamOptions | None = None
    n: int = Field(
        default=1, strict=True, ge=1, le=MAX_CHOICES
    )  # choices, sharing the prompt's prefill where passes are shared
    leapdecode: LeapDecodeOptions | None = None

    @field_validator("stop")
    @classmethod
    def _stop(cls, value: str | list[str] | None) -> list[str]:
        stops = [value] if isinstance(value, str) else list(value or [])
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop sequences")
        return [s for s in stops if s]

    def unsupported(self) -> list[str]:
        """OpenAI fields this request sets that the server does not implement."""
        extra = self.model_extra or {}
        return [name for name in UNSUPPORTED if extra.get(name) not in (None, False, 0, [], {})]


class CompletionRequest(_Common):
    prompt: Text | list[Text] | list[StrictInt]  # token ids are integers, never booleans
    max_tokens: int | None = Field(default=16, strict=True)  # the OpenAI default for completions
    logprobs: int | None = Field(default=None, strict=True, ge=0, le=MAX_TOP_LOGPROBS)  # the top alternatives per token

    @property
    def logprob_count(self) -> int | None:
        """How many alternatives to report per token, or None for no log-probabilities."""
        return self.logprobs

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, value: str | list[Any]) -> str | list[int]:
        if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
            if len(value) != 1:
                raise ValueError("only one prompt per request is supported")
            return value[0]
        return value


class ContentPart(BaseModel):
    type: Literal["text"]
    text: Text


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: Text | list[ContentPart] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, strict=True)
    logprobs: bool = Field(default=False, strict=True)
    top_logprobs: int | None = Field(default=None, strict=True, ge=0, le=MAX_TOP_LOGPROBS)

    @model_validator(mode="after")
    def _top_needs_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        return self

    @property
    def logprob_count(self) -> int | None:
        """How many alternatives to report per token, or None for no log-probabilities."""
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
