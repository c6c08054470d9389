"""The one registry of methods and the one factory from method strings."""

from __future__ import annotations

import dataclasses
from typing import Any

from leapdecode.errors import MethodError
from leapdecode.methods.base import Method
from leapdecode.methods.draft_model import DraftModel
from leapdecode.methods.heads import Eagle3, Medusa
from leapdecode.methods.layers import Calm, LayerSkip, SelfSpec
from leapdecode.methods.ngram import Anpd, PromptLookup
from leapdecode.methods.parallel import Jacobi, Lookahead
from leapdecode.methods.peers import (
    HfAssisted,
    HfGenerate,
    HfPromptLookup,
    LlamaCppPlain,
    LlamaCppPromptLookup,
    LlamaCppServer,
    LlamaCppSpeculative,
)
from leapdecode.methods.plain import Autoregressive
from leapdecode.methods.suffix import ArcticSuffix, Suffix
from leapdecode.methods.trees import AnpdTree, Hybrid, Recycle, Rest, Trie

# Every method, in the order `leapdecode methods` and error messages list them.
METHODS: tuple[type[Method], ...] = (
    Autoregressive,
    Anpd,
    PromptLookup,
    Suffix,
    AnpdTree,
    Trie,
    Recycle,
    Hybrid,
    Rest,
    Jacobi,
    Lookahead,
    DraftModel,
    Eagle3,
    Medusa,
    SelfSpec,
    LayerSkip,
    Calm,
    ArcticSuffix,
    HfGenerate,
    HfPromptLookup,
    HfAssisted,
    LlamaCppPlain,
    LlamaCppPromptLookup,
    LlamaCppServer,
    LlamaCppSpeculative,
)


def method_names() -> list[str]:
    return [m.name for m in METHODS]


def method_class(name: str) -> type[Method]:
    """The registered method called `name` (case and spaces ignored)."""
    key = name.strip().lower()
    cls = next((m for m in METHODS if m.name == key), None)
    if cls is None:
        known = "\n".join(f"  {m.name:12s} {m.summary}" for m in METHODS)
        raise MethodError(f"unknown method {key or name!r}; known methods:\n{known}")
    return cls


def _convert(cls: type[Method], field: dataclasses.Field[Any], raw: str) -> Any:
    kind = (
        field.type
        if isinstance(field.type, type)
        else {"int": int, "float": float, "str": str, "bool": bool}[str(field.type)]
    )
    try:
        if kind is bool:
            if raw.lower() not in ("1", "0", "true", "false", "yes", "no"):
                raise ValueError(raw)
            return raw.lower() in ("1", "true", "yes")
        value = kind(raw)
    except ValueError:
        raise MethodError(f"{cls.name}: parameter {field.name} must be {kind.__name__}, got {raw!r}") from None
    if kind is float and value != value:  # NaN passes every range check by comparing False
        raise MethodError(f"{cls.name}: parameter {field.name} must be a number, got {raw!r}")
    return value


def parse_method(spec: str | Method) -> Method:
    """Build a method from its string, e.g. `anpd`, `anpd:n=5,k=7`, `hf-pld:tokens=10`."""
    if isinstance(spec, Method):
        return spec
    if not isinstance(spec, str):
        raise MethodError(f"a method is a string such as 'anpd:n=5,k=7', not {type(spec).__name__}")
    text = spec.strip()
    name, _, params = text.partition(":")
    cls = method_class(name if name.strip() else text)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    values: dict[str, Any] = {}
    for item in filter(None, (p.strip() for p in params.split(","))):
        key, eq, raw = item.partition("=")
        key = key.strip()
        if not eq or not raw.strip():
            raise MethodError(f"{cls.name}: parameter {item!r} must look like name=value")
        if key not in fields:
            accepted = ", ".join(fields) or "none"
            raise MethodError(f"{cls.name}: unknown parameter {key!r}; accepted: {accepted}")
        if key in values:
            raise MethodError(f"{cls.name}: parameter {key!r} given twice")
        values[key] = _convert(cls, fields[key], raw.strip())
    return cls(**values)
