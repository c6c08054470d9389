"""Methods and their parameters, named by one string everywhere: `anpd:n=5,k=7`.

Each method is a frozen dataclass whose fields are its parameters, validated on
construction. `parse_method` is the one factory from a string; `str(method)` gives the
canonical string back. Engine methods build a drafter for the shared decode loop; peer
methods (`hf`, `hf-pld`, `hf-assisted`) run Hugging Face `generate` for comparison.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

from leapdecode.drafters import AnpdDrafter, Drafter, NoDrafter, PromptLookupDrafter
from leapdecode.errors import MethodError


@dataclass(frozen=True)
class Method:
    name: ClassVar[str]
    summary: ClassVar[str]
    lossless: ClassVar[bool] = True
    peer: ClassVar[bool] = False  # runs Hugging Face generate instead of the engine

    def build_drafter(self) -> Drafter:
        raise MethodError(f"method {self.name!r} is a peer baseline; it runs through Hugging Face generate")

    @property
    def draft_length(self) -> int:
        """Most tokens drafted per pass (K), for the alpha*K+1 bound; 0 when nothing is drafted."""
        return 0

    def __str__(self) -> str:
        params = ",".join(f"{f.name}={getattr(self, f.name)}" for f in dataclasses.fields(self))
        return f"{self.name}:{params}" if params else self.name

    def _require(self, ok: bool, message: str) -> None:
        if not ok:
            raise MethodError(f"{self.name}: {message}")


@dataclass(frozen=True)
class Autoregressive(Method):
    name: ClassVar[str] = "ar"
    summary: ClassVar[str] = "plain autoregressive decoding, one token per pass (the baseline)"

    def build_drafter(self) -> Drafter:
        return NoDrafter()


@dataclass(frozen=True)
class Anpd(Method):
    """Adaptive N-gram Parallel Decoding (arXiv 2404.08698) with Multi-Level N-gram fallback."""

    name: ClassVar[str] = "anpd"
    summary: ClassVar[str] = "Adaptive N-gram Parallel Decoding: n-gram table from prompt and output, MLN fallback"
    n: int = 5
    k: int = 7

    def __post_init__(self) -> None:
        self._require(self.n >= 2, f"n must be >= 2 (an n-gram needs context), got {self.n}")
        self._require(self.k >= 1, f"k must be >= 1 (draft length), got {self.k}")
        self._require(self.n <= 32 and self.k <= 128, f"n <= 32 and k <= 128 expected, got n={self.n}, k={self.k}")

    def build_drafter(self) -> Drafter:
        return AnpdDrafter(n=self.n, k=self.k)

    @property
    def draft_length(self) -> int:
        return self.k


@dataclass(frozen=True)
class PromptLookup(Method):
    """Prompt lookup decoding (LLMA, arXiv 2304.04487) inside the engine."""

    name: ClassVar[str] = "pld"
    summary: ClassVar[str] = "prompt lookup: copy what followed the latest earlier occurrence of the last tokens"
    k: int = 10
    max_ngram: int = 3
    min_ngram: int = 1

    def __post_init__(self) -> None:
        self._require(self.k >= 1, f"k must be >= 1, got {self.k}")
        self._require(1 <= self.min_ngram <= self.max_ngram, f"need 1 <= min_ngram <= max_ngram, got {self.min_ngram}, {self.max_ngram}")

    def build_drafter(self) -> Drafter:
        return PromptLookupDrafter(k=self.k, max_ngram=self.max_ngram, min_ngram=self.min_ngram)

    @property
    def draft_length(self) -> int:
        return self.k


@dataclass(frozen=True)
class HfGenerate(Method):
    name: ClassVar[str] = "hf"
    summary: ClassVar[str] = "peer: Hugging Face generate(do_sample=False)"
    peer: ClassVar[bool] = True


@dataclass(frozen=True)
class HfPromptLookup(Method):
    name: ClassVar[str] = "hf-pld"
    summary: ClassVar[str] = "peer: Hugging Face generate(prompt_lookup_num_tokens=tokens)"
    peer: ClassVar[bool] = True
    tokens: int = 10
    max_ngram: int = 2

    def __post_init__(self) -> None:
        self._require(self.tokens >= 1, f"tokens must be >= 1, got {self.tokens}")
        self._require(self.max_ngram >= 1, f"max_ngram must be >= 1, got {self.max_ngram}")

    @property
    def draft_length(self) -> int:
        return self.tokens


@dataclass(frozen=True)
class HfAssisted(Method):
    name: ClassVar[str] = "hf-assisted"
    summary: ClassVar[str] = "peer: Hugging Face generate(assistant_model=model), a draft model"
    peer: ClassVar[bool] = True
    model: str = ""

    def __post_init__(self) -> None:
        self._require(bool(self.model), "needs model=NAME (a preset, folder, .gguf or hub id) for the draft model")


METHODS: tuple[type[Method], ...] = (Autoregressive, Anpd, PromptLookup, HfGenerate, HfPromptLookup, HfAssisted)


def method_names() -> list[str]:
    return [m.name for m in METHODS]


def _convert(cls: type[Method], field: dataclasses.Field[Any], raw: str) -> Any:
    kind = field.type if isinstance(field.type, type) else {"int": int, "float": float, "str": str, "bool": bool}[str(field.type)]
    try:
        if kind is bool:
            if raw.lower() not in ("1", "0", "true", "false", "yes", "no"):
                raise ValueError(raw)
            return raw.lower() in ("1", "true", "yes")
        return kind(raw)
    except ValueError:
        raise MethodError(f"{cls.name}: parameter {field.name} must be {kind.__name__}, got {raw!r}") from None


def parse_method(spec: str | Method) -> Method:
    """Build a method from its string, e.g. `anpd`, `anpd:n=5,k=7`, `hf-pld:tokens=10`."""
    if isinstance(spec, Method):
        return spec
    text = spec.strip()
    name, _, params = text.partition(":")
    name = name.strip().lower()
    cls = next((m for m in METHODS if m.name == name), None)
    if cls is None:
        known = "\n".join(f"  {m.name:12s} {m.summary}" for m in METHODS)
        raise MethodError(f"unknown method {name or text!r}; known methods:\n{known}")
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
