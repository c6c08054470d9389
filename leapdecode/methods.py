"""Methods and their parameters, named by one string everywhere: `anpd:n=5,k=7`.

Each method is a frozen dataclass whose fields are its parameters, validated on
construction. `parse_method` is the one factory from a string; `str(method)` gives the
canonical string back. Engine methods build a drafter for the shared decode loop; peer
methods (`hf`, `hf-pld`, `hf-assisted`) run Hugging Face `generate` for comparison.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from leapdecode.drafters import AnpdDrafter, DraftModelDrafter, Drafter, NoDrafter, PromptLookupDrafter
from leapdecode.drafters.anpd_tree import AnpdTreeDrafter
from leapdecode.drafters.draft_model import SCHEDULES
from leapdecode.drafters.jacobi import INITS, MODES, JacobiDrafter
from leapdecode.drafters.lookahead import LookaheadDrafter
from leapdecode.drafters.rest import Datastore, RestDrafter
from leapdecode.drafters.trie import TrieDrafter
from leapdecode.drafters.cost_aware import CostAwareDrafter
from leapdecode.drafters.self_draft import SelfDrafter
from leapdecode.early_exit.backend import SelfDraftBackend
from leapdecode.early_exit.calibrate import LayerSkipCalibration, calibration_path, parse_layer_set
from leapdecode.early_exit.calm import MEASURES, CalmBackend
from leapdecode.engine import Backend, TorchBackend
from leapdecode.engine.cost import measure_forward_cost
from leapdecode.errors import MethodError, ModelLoadError
from leapdecode.models import LoadedModel, default_cache_dir, load_model
from leapdecode.verifiers import SamplingParams

# Builds a fresh drafter for one request, given how that request samples.
DrafterFactory = Callable[[SamplingParams, "torch.Generator | None"], Drafter]


@dataclass(frozen=True)
class Method:
    name: ClassVar[str]
    summary: ClassVar[str]
    lossless: ClassVar[bool] = True
    peer: ClassVar[bool] = False  # runs Hugging Face generate instead of the engine
    loads_files: ClassVar[bool] = False  # loads a model or data named by its parameters

    def build_drafter(self) -> Drafter:
        raise MethodError(f"method {self.name!r} is a peer baseline; it runs through Hugging Face generate")

    def prepare(
        self, target: LoadedModel, *, draft_model: LoadedModel | None = None, log: Callable[[str], None] = print,
        backend: Backend | None = None,
    ) -> DrafterFactory:
        """Load what the method needs once per model (a draft model; the forward cost of
        `backend`, which runs the target); return a per-request drafter factory."""
        return lambda sampling, generator: self.build_drafter()

    def make_backend(self, target: LoadedModel) -> Backend:
        """What runs the target for this method: the model's own backend (PyTorch or
        llama.cpp), unless the method runs it layer by layer (early exit, self-speculation)."""
        return backend_for(target)

    @property
    def draft_length(self) -> int:
        """Most tokens of a chain drafted per pass (K), for the alpha*K+1 bound; 0 when nothing is
        drafted, and for trees (whose alpha counts every node, so the bound does not apply)."""
        return 0

    def __str__(self) -> str:
        """The canonical string: every parameter, except switches left off and names left unset
        (a default of False or "")."""
        params = ",".join(
            f"{f.name}={getattr(self, f.name)}" for f in dataclasses.fields(self)
            if not ((f.default is False or f.default == "") and getattr(self, f.name) == f.default)
        )
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
    cost_aware: bool = False  # keep only the part of each draft worth its measured cost

    def __post_init__(self) -> None:
        self._require(self.n >= 2, f"n must be >= 2 (an n-gram needs context), got {self.n}")
        self._require(self.k >= 1, f"k must be >= 1 (draft length), got {self.k}")
        self._require(self.n <= 32 and self.k <= 128, f"n <= 32 and k <= 128 expected, got n={self.n}, k={self.k}")

    def build_drafter(self) -> Drafter:
        return AnpdDrafter(n=self.n, k=self.k)

    def prepare(
        self, target: LoadedModel, *, draft_model: LoadedModel | None = None, log: Callable[[str], None] = print,
        backend: Backend | None = None,
    ) -> DrafterFactory:
        return _maybe_cost_aware(self.cost_aware, self.build_drafter, self.k, target, backend, log)

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
    cost_aware: bool = False  # keep only the part of each draft worth its measured cost

    def __post_init__(self) -> None:
        self._require(self.k >= 1, f"k must be >= 1, got {self.k}")
        self._require(1 <= self.min_ngram <= self.max_ngram, f"need 1 <= min_ngram <= max_ngram, got {self.min_ngram}, {self.max_ngram}")

    def build_drafter(self) -> Drafter:
        return PromptLookupDrafter(k=self.k, max_ngram=self.max_ngram, min_ngram=self.min_ngram)

    def prepare(
        self, target: LoadedModel, *, draft_model: LoadedModel | None = None, log: Callable[[str], None] = print,
        backend: Backend | None = None,
    ) -> DrafterFactory:
        return _maybe_cost_aware(self.cost_aware, self.build_drafter, self.k, target, backend, log)


def _maybe_cost_aware(
    enabled: bool, build: Callable[[], Drafter], k: int, target: LoadedModel, backend: Backend | None,
    log: Callable[[str], None],
) -> DrafterFactory:
    """The plain drafter, or (cost_aware) the drafter cut by the backend's cost, measured once here."""
    if not enabled:
        return lambda sampling, generator: build()
    backend = backend if backend is not None else backend_for(target)
    log(f"measuring the forward cost of 1..{k + 1} tokens on the {target.backend} backend")
    cost = measure_forward_cost(backend, k + 1)
    log("forward cost (ms): " + " ".join(f"{n}:{1000 * s:.0f}" for n, s in enumerate(cost.seconds, 1)))
    return lambda sampling, generator: CostAwareDrafter(build(), cost)

    @property
    def draft_length(self) -> int:
        return self.k


@dataclass(frozen=True)
class AnpdTree(Method):
    """ANPD's N-gram module drafting a token tree (top continuations across MLN levels)."""

    name: ClassVar[str] = "anpd-tree"
    summary: ClassVar[str] = "ANPD drafting a token tree: top n-gram continuations merged, verified in one pass"
    n: int = 5
    nodes: int = 8
    depth: int = 4
    width: int = 3

    def __post_init__(self) -> None:
        self._require(2 <= self.n <= 32, f"n must be between 2 and 32, got {self.n}")
        _check_tree(self, self.nodes, self.depth)
        self._require(1 <= self.width <= 16, f"width must be between 1 and 16, got {self.width}")

    def build_drafter(self) -> Drafter:
        return AnpdTreeDrafter(n=self.n, nodes=self.nodes, depth=self.depth, width=self.width)


@dataclass(frozen=True)
class Trie(Method):
    """Lookahead-style multi-branch retrieval from a trie of the prompt's and output's n-grams."""

    name: ClassVar[str] = "trie"
    summary: ClassVar[str] = "trie of the prompt's and output's n-grams: the latest match's frequent branches as a tree"
    nodes: int = 8
    depth: int = 4
    window: int = 12
    max_match: int = 4
    prompt_weight: int = 2

    def __post_init__(self) -> None:
        _check_tree(self, self.nodes, self.depth)
        self._require(2 <= self.window <= 64, f"window must be between 2 and 64, got {self.window}")
        self._require(1 <= self.max_match < self.window, f"need 1 <= max_match < window, got {self.max_match}")
        self._require(self.prompt_weight >= 1, f"prompt_weight must be >= 1, got {self.prompt_weight}")

    def build_drafter(self) -> Drafter:
        return TrieDrafter(self.nodes, self.depth, self.window, self.max_match, self.prompt_weight)


@dataclass(frozen=True)
class Rest(Method):
    """REST: retrieval from a datastore built with `leapdecode datastore build`."""

    name: ClassVar[str] = "rest"
    summary: ClassVar[str] = "REST: continuations retrieved from a datastore (suffix array) merged into a tree"
    loads_files: ClassVar[bool] = True
    datastore: str = ""
    nodes: int = 8
    depth: int = 4
    matches: int = 64
    max_suffix: int = 8
    min_suffix: int = 2

    def __post_init__(self) -> None:
        self._require(bool(self.datastore), "needs datastore=DIR (build one with `leapdecode datastore build`)")
        _check_tree(self, self.nodes, self.depth)
        self._require(1 <= self.matches <= 4096, f"matches must be between 1 and 4096, got {self.matches}")
        self._require(1 <= self.min_suffix <= self.max_suffix <= 16, f"need 1 <= min_suffix <= max_suffix <= 16, got {self.min_suffix}, {self.max_suffix}")

    def prepare(
        self, target: LoadedModel, *, draft_model: LoadedModel | None = None, log: Callable[[str], None] = print,
        backend: Backend | None = None,
    ) -> DrafterFactory:
        store = Datastore.load(self.datastore)
        store.check_tokenizer(target.tokenizer, target.name)
        return lambda sampling, generator: RestDrafter(
            store, self.nodes, self.depth, self.matches, self.max_suffix, self.min_suffix,
        )


@dataclass(frozen=True)
class Jacobi(Method):
    """Jacobi decoding (arXiv 2305.10427): guess a block, refine every guess from one pass."""

    name: ClassVar[str] = "jacobi"
    summary: ClassVar[str] = "Jacobi decoding: a block of guesses refined by the model's own predictions each pass"
    block: int = 3
    mode: str = "sliding"
    init: str = "repeat"

    def __post_init__(self) -> None:
        self._require(1 <= self.block <= 64, f"block must be between 1 and 64, got {self.block}")
        self._require(self.mode in MODES, f"mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        self._require(self.init in INITS, f"init must be one of {', '.join(INITS)}, got {self.init!r}")

    def build_drafter(self) -> Drafter:
        return JacobiDrafter(self.block, self.mode, self.init)

    @property
    def draft_length(self) -> int:
        return self.block


@dataclass(frozen=True)
class Lookahead(Method):
    """Lookahead decoding (arXiv 2402.02057): a Jacobi window feeding an n-gram pool, verified in the same pass."""

    name: ClassVar[str] = "lookahead"
    summary: ClassVar[str] = "Lookahead decoding: Jacobi window (w x n-1) fills an n-gram pool; g n-grams verified per pass"
    w: int = 2
    n: int = 3
    g: int = 2
    anpd: bool = False

    def __post_init__(self) -> None:
        self._require(2 <= self.w <= 32, f"w (window) must be between 2 and 32, got {self.w}")
        self._require(2 <= self.n <= 8, f"n (n-gram size) must be between 2 and 8, got {self.n}")
        self._require(0 <= self.g <= 32, f"g (verified n-grams) must be between 0 and 32, got {self.g}")

    def build_drafter(self) -> Drafter:
        return LookaheadDrafter(self.w, self.n, self.g, self.anpd)


def _check_tree(method: Method, nodes: int, depth: int) -> None:
    method._require(1 <= nodes <= 128, f"nodes must be between 1 and 128, got {nodes}")
    method._require(1 <= depth <= 64, f"depth must be between 1 and 64, got {depth}")


@dataclass(frozen=True)
class DraftModel(Method):
    """Speculative decoding with a smaller draft model (Leviathan et al.; Chen et al.)."""

    name: ClassVar[str] = "draft"
    summary: ClassVar[str] = "draft-model speculative decoding: a smaller model with the same tokenizer drafts k tokens"
    loads_files: ClassVar[bool] = True
    model: str = ""
    k: int = 5
    schedule: str = "constant"  # or "heuristic": adapt k from the last verdict
    threshold: float = 0.0  # stop drafting after a token the draft model gives less than this
    cascade: bool = False  # ANPD drafts for the draft model (vertical cascade)

    def __post_init__(self) -> None:
        self._require(1 <= self.k <= 64, f"k must be between 1 and 64, got {self.k}")
        self._require(self.schedule in SCHEDULES, f"schedule must be one of {', '.join(SCHEDULES)}, got {self.schedule!r}")
        self._require(0.0 <= self.threshold < 1.0, f"threshold must be in [0, 1), got {self.threshold}")

    def prepare(
        self, target: LoadedModel, *, draft_model: LoadedModel | None = None, log: Callable[[str], None] = print,
        backend: Backend | None = None,
    ) -> DrafterFactory:
        if target.backend != "torch":
            raise MethodError(f"draft: draft-model decoding runs on the torch backend, not {target.backend}")
        if draft_model is None:
            if not self.model:
                raise MethodError("draft: needs model=NAME (a preset, folder, .gguf or hub id) for the draft model")
            draft_model = load_model(self.model, device=target.device, dtype=target.model.dtype, log=log)
        check_same_vocabulary(target, draft_model)
        backend = TorchBackend(draft_model.model)
        cascade_n = 5 if self.cascade else 0

        def factory(sampling: SamplingParams, generator: torch.Generator | None) -> Drafter:
            return DraftModelDrafter(
                backend, self.k, sampling=sampling, generator=generator, schedule=self.schedule,
                threshold=self.threshold, cascade_n=cascade_n,
            )

        return factory

    @property
    def draft_length(self) -> int:
        return self.k


def backend_for(target: LoadedModel) -> Backend:
    """The plain backend of a loaded model."""
    if target.backend == "llama.cpp":
        from leapdecode.engine.llamacpp_backend import LlamaCppBackend

        return LlamaCppBackend(target.model)
    return TorchBackend(target.model)


def _num_layers(target: LoadedModel) -> int:
    """Decoder layers of a PyTorch model; layer-level methods cannot reach inside llama.cpp."""
    if target.backend != "torch":
        raise MethodError(f"layer-level methods (self-spec, layerskip, calm) run on the torch backend, not {target.backend}")
    return int(target.model.config.get_text_config().num_hidden_layers)


class _OwnLayerDrafting(Method):
    """What self-spec and layerskip share: the target drafts up to k tokens with a subset of its
    own layers (its backend says which), stopping after a token its draft doubts."""

    k: int  # fields of the dataclasses below
    threshold: float

    def _check_drafting(self) -> None:
        self._require(1 <= self.k <= 64, f"k must be between 1 and 64, got {self.k}")
        self._require(0.0 <= self.threshold < 1.0, f"threshold must be in [0, 1), got {self.threshold}")

    def prepare(
        self, target: LoadedModel, *, draft_model: LoadedModel | None = None, log: Callable[[str], None] = print,
        backend: Backend | None = None,
    ) -> DrafterFactory:
        return lambda sampling, generator: SelfDrafter(self.k, self.threshold, sampling=sampling, generator=generator)

    @property
    def draft_length(self) -> int:
        return self.k


@dataclass(frozen=True)
class SelfSpec(_OwnLayerDrafting):
    """Self-speculative decoding (Draft & Verify, arXiv 2309.08168): the target skipping layers drafts."""

    name: ClassVar[str] = "self-spec"
    summary: ClassVar[str] = "self-speculative (Draft & Verify): draft with a set of layers skipped, verify with all"
    skip: str = ""  # layers to skip, e.g. 4-9/12; empty: the set saved by `leapdecode calibrate layer-skip`
    k: int = 4
    threshold: float = 0.5  # stop drafting after a token the draft gives less than this

    def __post_init__(self) -> None:
        if self.skip:
            parse_layer_set(self.skip)
        self._check_drafting()

    def skip_layers(self, target: LoadedModel) -> tuple[int, ...]:
        """The explicit skip set, or the calibrated one for this model."""
        if self.skip:
            skip = parse_layer_set(self.skip)
        else:
            path = calibration_path(default_cache_dir(), target.name)
            if not path.exists():
                raise MethodError(
                    f"self-spec: no skip set for {target.name!r}; give skip=LAYERS (e.g. skip=4-9/12) or run "
                    f"`leapdecode calibrate layer-skip --model {target.name}` first"
                )
            calibration = LayerSkipCalibration.load(path)
            self._require(calibration.num_layers == _num_layers(target), f"calibration {path} is for another model")
            skip = parse_layer_set(calibration.skip)
        self._require(max(skip) < _num_layers(target), f"skip {self.skip!r} names layers past the last, {_num_layers(target) - 1}")
        return skip

    def make_backend(self, target: LoadedModel) -> Backend:
        skip = set(self.skip_layers(target))
        return SelfDraftBackend(target.model, tuple(i for i in range(_num_layers(target)) if i not in skip))


@dataclass(frozen=True)
class LayerSkip(_OwnLayerDrafting):
    """LayerSkip-style early-exit drafting (arXiv 2404.16710): draft from layer E, verify with the rest."""

    name: ClassVar[str] = "layerskip"
    summary: ClassVar[str] = "early-exit drafting (LayerSkip): draft from the first E layers, the rest verify reusing their KV"
    exit: int = 0  # drafting layers: 0..exit-1, then the final norm and LM head
    k: int = 4
    threshold: float = 0.0

    def __post_init__(self) -> None:
        self._require(self.exit >= 1, f"needs exit=E, the number of layers that draft (>= 1), got {self.exit}")
        self._check_drafting()

    def make_backend(self, target: LoadedModel) -> Backend:
        self._require(self.exit < _num_layers(target), f"exit must be below the model's {_num_layers(target)} layers, got {self.exit}")
        return SelfDraftBackend(target.model, tuple(range(self.exit)))


@dataclass(frozen=True)
class Calm(Method):
    """CALM early exit (arXiv 2207.07061): each token leaves at the first confident layer. Lossy."""

    name: ClassVar[str] = "calm"
    summary: ClassVar[str] = "CALM early exit (lossy): a token exits at the first layer whose confidence passes threshold"
    lossless: ClassVar[bool] = False
    threshold: float = 0.9  # 1 never exits (plain decoding)
    measure: str = "softmax"  # softmax: top-1 minus top-2 probability; state: cosine to the previous layer
    first: int = 0  # first layer after which a token may exit (0-based)
    every: int = 1  # check confidence every this many layers

    def __post_init__(self) -> None:
        self._require(0.0 <= self.threshold <= 1.0, f"threshold must be in [0, 1], got {self.threshold}")
        self._require(self.measure in MEASURES, f"measure must be one of {', '.join(MEASURES)}, got {self.measure!r}")
        self._require(self.first >= 0, f"first must be >= 0, got {self.first}")
        self._require(self.every >= 1, f"every must be >= 1, got {self.every}")

    def make_backend(self, target: LoadedModel) -> Backend:
        self._require(self.first < _num_layers(target), f"first must be below the model's {_num_layers(target)} layers")
        return CalmBackend(target.model, self.measure, self.threshold, self.first, self.every)

    def build_drafter(self) -> Drafter:
        return NoDrafter()


def check_same_vocabulary(target: LoadedModel, draft: LoadedModel) -> None:
    """Speculative decoding compares p and q token by token: both models must share one vocabulary."""
    width = (target.model.config.get_text_config().vocab_size, draft.model.config.get_text_config().vocab_size)
    if width[0] != width[1]:
        raise ModelLoadError(
            f"draft model {draft.name!r} scores {width[1]} tokens but {target.name!r} scores {width[0]}: "
            "a draft model must share the target's tokenizer"
        )
    if target.tokenizer.get_vocab() != draft.tokenizer.get_vocab():
        raise ModelLoadError(f"draft model {draft.name!r} has a different tokenizer vocabulary from {target.name!r}")


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
    loads_files: ClassVar[bool] = True
    peer: ClassVar[bool] = True
    model: str = ""
    tokens: int = 20  # transformers' defaults: num_assistant_tokens,
    schedule: str = "constant"  # num_assistant_tokens_schedule,
    threshold: float = 0.4  # assistant_confidence_threshold

    def __post_init__(self) -> None:
        self._require(bool(self.model), "needs model=NAME (a preset, folder, .gguf or hub id) for the draft model")
        self._require(self.tokens >= 1, f"tokens must be >= 1, got {self.tokens}")
        self._require(self.schedule in ("constant", "heuristic", "heuristic_transient"), f"unknown schedule {self.schedule!r}")
        self._require(0.0 <= self.threshold < 1.0, f"threshold must be in [0, 1), got {self.threshold}")

    @property
    def draft_length(self) -> int:
        return self.tokens


@dataclass(frozen=True)
class LlamaCppPlain(Method):
    name: ClassVar[str] = "llama-cpp"
    summary: ClassVar[str] = "peer: llama-cpp-python's own greedy generation (--backend llama.cpp)"
    peer: ClassVar[bool] = True


@dataclass(frozen=True)
class LlamaCppPromptLookup(Method):
    name: ClassVar[str] = "llama-cpp-pld"
    summary: ClassVar[str] = "peer: llama-cpp-python with LlamaPromptLookupDecoding (--backend llama.cpp)"
    peer: ClassVar[bool] = True
    tokens: int = 10  # num_pred_tokens, its default
    max_ngram: int = 2  # max_ngram_size, its default

    def __post_init__(self) -> None:
        self._require(self.tokens >= 1, f"tokens must be >= 1, got {self.tokens}")
        self._require(self.max_ngram >= 1, f"max_ngram must be >= 1, got {self.max_ngram}")

    @property
    def draft_length(self) -> int:
        return self.tokens


METHODS: tuple[type[Method], ...] = (
    Autoregressive, Anpd, PromptLookup, AnpdTree, Trie, Rest, Jacobi, Lookahead, DraftModel, SelfSpec, LayerSkip, Calm,
    HfGenerate, HfPromptLookup, HfAssisted, LlamaCppPlain, LlamaCppPromptLookup,
)


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
