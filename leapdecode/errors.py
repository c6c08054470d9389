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
