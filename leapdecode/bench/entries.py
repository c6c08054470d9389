"""What a benchmark runs, as the user names it: method strings, each with an optional model
variant after `@` (`anpd:n=5,k=7`, `hf@bfloat16`, `anpd@torch+int4`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from leapdecode.errors import MethodError
from leapdecode.methods import Method, parse_method
from leapdecode.models.loading import BACKENDS, DTYPES
from leapdecode.models.quantize import QUANTIZE_MODES


@dataclass(frozen=True)
class Variant:
    """How an entry's model differs from the run's, written after `@` and joined with `+`:
    a backend (`anpd@llama.cpp`), a dtype (`hf@bfloat16`), a quantization (`anpd@int4`), or
    several (`ar@torch+int4`). A field left None is the run's."""

    backend: str | None = None
    dtype: str | None = None
    quantize: str | None = None

    @classmethod
    def parse(cls, text: str) -> Variant:
        kinds = {"backend": BACKENDS, "dtype": tuple(DTYPES), "quantize": QUANTIZE_MODES}
        found: dict[str, str] = {}
        for part in text.split("+"):
            word = part.strip().lower()
            kind = next((k for k, names in kinds.items() if word in names), None)
            if kind is None:
                raise MethodError(
                    f"unknown backend or weights {part.strip()!r} after @; known: backends {', '.join(BACKENDS)}, "
                    f"dtypes {', '.join(DTYPES)}, quantizations {', '.join(QUANTIZE_MODES)}"
                )
            if kind in found:
                raise MethodError(f"@{text} names two of one kind ({found[kind]}, {word})")
            found[kind] = word
        variant = cls(**found)
        if variant.backend == "llama.cpp" and (variant.dtype or variant.quantize):
            raise MethodError(f"@{text}: llama.cpp runs the GGUF's own types, without a dtype or quantization")
        if variant.quantize not in (None, "none") and variant.dtype not in (None, "float32"):
            raise MethodError(f"@{text}: quantized layers compute in float32, not {variant.dtype}")
        return variant

    def __str__(self) -> str:
        return "+".join(part for part in (self.backend, self.dtype, self.quantize) if part)

    def __bool__(self) -> bool:
        return bool(str(self))

    def load_arguments(self, backend: str, dtype: str, quantize: str) -> tuple[str, str, str]:
        """(backend, dtype, quantize) to load this variant with, in a run loaded with those: a
        dtype of its own drops the run's quantization, a quantization of its own computes in float32."""
        backend = self.backend or ("torch" if self.dtype or self.quantize else backend)  # only torch takes them
        if backend != "torch":
            return backend, "", "none"  # the GGUF's own types
        quantize = self.quantize or (quantize if self.dtype is None else "none")
        dtype = self.dtype or ("float32" if quantize in ("int8", "int4") else dtype)  # "auto" resolves at load
        return backend, dtype, quantize


@dataclass(frozen=True)
class Entry:
    """A method in a benchmark, with the model variant it runs on (empty: the run's own model)."""

    method: Method
    variant: Variant = Variant()

    @property
    def label(self) -> str:
        return f"{self.method}@{self.variant}" if self.variant else str(self.method)


def group_method_strings(text: str | Sequence[str]) -> list[str]:
    """Split a comma list of method strings; an item with `=` and no `:` is a parameter of the
    method before it (`ar,anpd:n=5,k=7` is `ar` and `anpd:n=5,k=7`)."""
    items = [t.strip() for t in (text.split(",") if isinstance(text, str) else text) if t.strip()]
    groups: list[str] = []
    for item in items:
        if "=" in item and ":" not in item and groups:
            groups[-1] += "," + item
        else:
            groups.append(item)
    return groups


def parse_entries(text: str | Sequence[str]) -> list[Entry]:
    """A comma list of method strings; parameters attach to the method before them:
    `ar,anpd:n=5,k=7,hf-pld:tokens=10` is ar, anpd:n=5,k=7 and hf-pld:tokens=10. A method may
    end in `@VARIANT` (`Variant`: `@llama.cpp`, `@bfloat16`, `@int4`, `@torch+int4`) to run on
    that model instead of the run's."""
    entries = []
    for group in group_method_strings(text):
        spec, at, variant = group.rpartition("@")
        entries.append(Entry(parse_method(spec), Variant.parse(variant)) if at else Entry(parse_method(group)))
    refuse_twice(entries, "")
    return entries


def refuse_twice(entries: Sequence[Entry], where: str) -> None:
    """A label names one runner and one row of the results: two entries may not share one."""
    labels = [e.label for e in entries]
    twice = sorted({label for label in labels if labels.count(label) > 1})
    if twice:
        raise MethodError(f"method listed twice{where}: {', '.join(twice)}")


def parse_methods(text: str | Sequence[str]) -> list[Method]:
    """`parse_entries` without the backends: the methods alone."""
    return [e.method for e in parse_entries(text)]
