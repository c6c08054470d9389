"""Errors a user can act on. Each message says what was wrong and what to do."""

from __future__ import annotations


class LeapDecodeError(Exception):
    """Base class: bad input or an unusable model, reported before anything changes."""


class ModelLoadError(LeapDecodeError):
    """A model could not be found, installed, verified or loaded."""


class MethodError(LeapDecodeError, ValueError):
    """An unknown method, or a method parameter that is missing, unknown or out of range."""


class InputError(LeapDecodeError, ValueError):
    """A prompt or generation setting that cannot be used (empty, too long, max_new_tokens <= 0)."""


class RequestError(InputError):
    """A generation option that cannot be used: `param` names it (the library's name), `code`
    (where set) says why in the OpenAI API's words (`context_length_exceeded`)."""

    def __init__(self, message: str, param: str, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code
