"""Peers: what a user would run instead, with its own library, side by side in the benchmark.

Only their parameters live here; `leapdecode.bench.runner` runs them (Hugging Face `generate`,
llama-cpp-python's generator).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from leapdecode.methods.base import Capabilities, Method

MAX_TOKENS = 128


@dataclass(frozen=True)
class HfGenerate(Method):
    name: ClassVar[str] = "hf"
    summary: ClassVar[str] = "peer: Hugging Face generate(do_sample=False)"
    kind: ClassVar[Capabilities] = Capabilities(peer=True)


class _PromptLookupPeer(Method):
    """What the two peers' prompt lookups share: `tokens` drafted from the latest match of up to
    `max_ngram` tokens."""

    kind: ClassVar[Capabilities] = Capabilities("chain", peer=True)
    tokens: int  # fields of the dataclasses below
    max_ngram: int

    @property
    def chain_length(self) -> int:
        return self.tokens

    def __post_init__(self) -> None:
        self._require(1 <= self.tokens <= MAX_TOKENS, f"tokens must be between 1 and {MAX_TOKENS}, got {self.tokens}")
        self._require(1 <= self.max_ngram <= 32, f"max_ngram must be between 1 and 32, got {self.max_ngram}")


@dataclass(frozen=True)
class HfPromptLookup(_PromptLookupPeer):
    name: ClassVar[str] = "hf-pld"
    summary: ClassVar[str] = "peer: Hugging Face generate(prompt_lookup_num_tokens=tokens)"
    tokens: int = 10
    max_ngram: int = 2


@dataclass(frozen=True)
class HfAssisted(Method):
    name: ClassVar[str] = "hf-assisted"
    summary: ClassVar[str] = "peer: Hugging Face generate(assistant_model=model), a draft model"
    kind: ClassVar[Capabilities] = Capabilities("chain", peer=True, loads_files=True)
    model: str = ""
    tokens: int = 20  # transformers' defaults: num_assistant_tokens,
    schedule: str = "constant"  # num_assistant_tokens_schedule,
    threshold: float = 0.4  # assistant_confidence_threshold

    @property
    def chain_length(self) -> int:
        return self.tokens

    def __post_init__(self) -> None:
        self._require(bool(self.model), "needs model=NAME (a preset, folder, .gguf or hub id) for the draft model")
        self._require(1 <= self.tokens <= MAX_TOKENS, f"tokens must be between 1 and {MAX_TOKENS}, got {self.tokens}")
        self._require(
            self.schedule in ("constant", "heuristic", "heuristic_transient"), f"unknown schedule {self.schedule!r}"
        )
        self._require(0.0 <= self.threshold < 1.0, f"threshold must be in [0, 1), got {self.threshold}")


@dataclass(frozen=True)
class LlamaCppPlain(Method):
    name: ClassVar[str] = "llama-cpp"
    summary: ClassVar[str] = "peer: llama-cpp-python's own greedy generation (--backend llama.cpp)"
    kind: ClassVar[Capabilities] = Capabilities(peer=True)


@dataclass(frozen=True)
class LlamaCppPromptLookup(_PromptLookupPeer):
    name: ClassVar[str] = "llama-cpp-pld"
    summary: ClassVar[str] = "peer: llama-cpp-python with LlamaPromptLookupDecoding (--backend llama.cpp)"
    tokens: int = 10  # num_pred_tokens, its default
    max_ngram: int = 2  # max_ngram_size, its default


@dataclass(frozen=True)
class LlamaCppSpeculative(Method):
    """llama.cpp's own draft-model speculative decoding, the program a llama.cpp user runs
    (`llama-speculative-simple`, built from the llama.cpp source in llama-cpp-python's sdist by
    `make llamacpp-tools`), one process per prompt on the same GGUFs and threads."""

    name: ClassVar[str] = "llama-cpp-spec"
    summary: ClassVar[str] = (
        "peer: llama.cpp's draft-model speculative decoding (llama-speculative-simple, --backend llama.cpp)"
    )
    kind: ClassVar[Capabilities] = Capabilities("chain", peer=True, loads_files=True)
    model: str = ""  # the draft model: a preset or .gguf
    k: int = 3  # --spec-draft-n-max, its default
    p_min: float = 0.0  # --spec-draft-p-min: stop a draft at a token the draft gives less (its default: never)

    @property
    def chain_length(self) -> int:
        return self.k

    def __post_init__(self) -> None:
        self._require(bool(self.model), "needs model=NAME (a preset or .gguf) for the draft model")
        self._require(1 <= self.k <= MAX_TOKENS, f"k must be between 1 and {MAX_TOKENS}, got {self.k}")
        self._require(0.0 <= self.p_min < 1.0, f"p_min must be in [0, 1), got {self.p_min}")


@dataclass(frozen=True)
class LlamaCppServer(Method):
    """llama.cpp's server with a parallel slot per client (`llama-server -np C`, built by `make
    llamacpp-tools`): what a llama.cpp user serves many clients with; a throughput peer for
    `bench --concurrency`, on the same GGUF and threads."""

    name: ClassVar[str] = "llama-server"
    summary: ClassVar[str] = "peer: llama.cpp's server, a slot per client (bench --concurrency only)"
    kind: ClassVar[Capabilities] = Capabilities(peer=True)
