"""What every method is: frozen parameters, named by one string, that build a drafter.

A method is a frozen dataclass whose fields are its parameters, validated on construction;
`leapdecode.methods.parse_method` is the one factory from a string and `str(method)` gives the
canonical string back. An engine method says what runs the target (`make_backend`) and how to
build a fresh drafter for each request (`drafter_factory`); `prepare` adds what all methods
share (cost-aware cutting, for methods with a `cost_aware` field). Peers (`hf`, `llama-cpp`,
...) only carry parameters: the benchmark runs them through their own libraries.

This module, and every method module, imports no torch at import time: `leapdecode methods`
and `--help` stay fast. Drafters, backends and models are imported where they are built.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Literal

from leapdecode.errors import MethodError

if TYPE_CHECKING:
    from leapdecode.engine.backend import Backend
    from leapdecode.engine.cost import ForwardCost
    from leapdecode.engine.cost_store import CurveKey
    from leapdecode.engine.drafting import Drafter, PassCost
    from leapdecode.engine.noise import PositionNoise
    from leapdecode.engine.sampling import SamplingParams
    from leapdecode.models.loading import LoadedModel

# Builds a fresh drafter for one request, given how that request samples.
# (the request's sampling, its per-position noise) -> a fresh drafter for that request
DrafterFactory = Callable[["SamplingParams", "PositionNoise"], "Drafter"]
Log = Callable[[str], None]

logger = logging.getLogger("leapdecode")

DraftShape = Literal["none", "chain", "tree"]
DRAFT_SHAPES: tuple[DraftShape, ...] = ("none", "chain", "tree")
MAX_DRAFT = 128  # longest chain a method may draft per pass


@dataclass(frozen=True)
class Capabilities:
    """What a method does, as typed fields: what the engine, the server, the benchmark and the
    vLLM integration read of a method (never an attribute looked up by name)."""

    drafts: DraftShape = "none"  # what one pass verifies: nothing, a chain or a tree
    cost_aware: bool = False  # each draft cut to what pays under the measured pass cost (`Method.prepare`)
    head: str | None = None  # a trained head it drafts with: where it is ("": the one trained here); None: no head
    coupled: bool = True  # sampled drafts use the target's per-position uniforms (False: only the distribution is kept)
    lossless: bool = True  # greedy output is plain decoding's token for token (else lossy: its agreement is measured)
    peer: bool = False  # runs another library's generate instead of the engine (a benchmark baseline)
    loads_files: bool = False  # loads a model or data named by its parameters


@dataclass(frozen=True)
class Method:
    name: ClassVar[str]
    summary: ClassVar[str]
    # what every method of the class does; `capabilities` refines it where parameters change it
    kind: ClassVar[Capabilities] = Capabilities()

    @property
    def capabilities(self) -> Capabilities:
        """What this method does: its class's `kind`, refined by a method whose parameters change it."""
        return self.kind

    @property
    def drafts(self) -> DraftShape:
        """What one pass verifies: nothing, a chain or a tree."""
        return self.capabilities.drafts

    def build_drafter(self) -> Drafter:
        """A fresh drafter for one request (methods whose drafter needs nothing loaded)."""
        raise MethodError(f"method {self.name!r} is a peer baseline; it runs only in the benchmark")

    def drafter_factory(self, target: LoadedModel, *, draft_model: LoadedModel | None, log: Log) -> DrafterFactory:
        """Load what the method needs once per model (a draft model, a datastore) and return a
        per-request drafter factory. The default builds `build_drafter()` for each request."""
        return lambda sampling, noise: self.build_drafter()

    def prepare(
        self,
        target: LoadedModel,
        *,
        draft_model: LoadedModel | None = None,
        log: Log | None = None,
        backend: Backend | None = None,
        cost: ForwardCost | None = None,
    ) -> DrafterFactory:
        """The per-request drafter factory, cut by the cost of `backend`'s passes when the method
        has `cost_aware` set: `cost` when given (a curve measured once per model, e.g. by the
        server at start), else the one measured on this model before, else measured once, here."""
        log = log or logger.info
        factory = self.drafter_factory(target, draft_model=draft_model, log=log)
        if self.capabilities.cost_aware:
            if cost is None:
                backend = backend or self.make_backend(target)
                cost = cached_cost(target, backend, self.pass_size, log, tree=self.drafts == "tree")
            factory = cost_aware_factory(factory, cost)
        return factory

    def make_backend(self, target: LoadedModel) -> Backend:
        """What runs the target for this method: the model's own backend (PyTorch or
        llama.cpp), unless the method runs it layer by layer (early exit, self-speculation)."""
        return backend_for(target)

    @property
    def chain_length(self) -> int:
        """The parameter that bounds a chain's length (K); a method that drafts chains overrides
        it with its field. 0: no chain of its own."""
        return 0

    @property
    def draft_length(self) -> int:
        """Most tokens of a chain drafted per pass (K), for the alpha*K+1 bound: `chain_length`.
        0 when nothing is drafted, and for trees (whose alpha counts every node, so the bound does
        not apply)."""
        return self.chain_length if self.drafts == "chain" else 0

    @property
    def pass_size(self) -> int:
        """Most tokens one verification pass scores: the pending token and the longest chain (a
        method that drafts trees overrides it with its tree's size; tests/test_architecture.py
        checks that every one does)."""
        return self.draft_length + 1

    def __str__(self) -> str:
        """The canonical string: every parameter, except switches left off and names left unset
        (a default of False or "")."""
        params = ",".join(
            f"{f.name}={getattr(self, f.name)}"
            for f in dataclasses.fields(self)
            if not ((f.default is False or f.default == "") and getattr(self, f.name) == f.default)
        )
        return f"{self.name}:{params}" if params else self.name

    def _require(self, ok: bool, message: str) -> None:
        if not ok:
            raise MethodError(f"{self.name}: {message}")


def backend_for(target: LoadedModel) -> Backend:
    """The plain backend of a loaded model."""
    if target.backend == "llama.cpp":
        from leapdecode.engine.llamacpp_backend import LlamaCppBackend

        return LlamaCppBackend(target.model)
    from leapdecode.engine.backend import TorchBackend

    return TorchBackend(target.model, exact_tokens=target.exact_tokens)


def cached_cost(target: LoadedModel, backend: Backend, max_tokens: int, log: Log, *, tree: bool = False) -> ForwardCost:
    """The cost curve of `backend` over `target` (passes of chains, or of trees), measured once per
    model, backend kind, thread count and shape (a longer curve measured before serves a shorter
    need), on this machine: kept on disk for later processes (`engine.cost_store`)."""
    import torch

    from leapdecode.engine.cost_store import default_store

    key = (type(backend).__name__, torch.get_num_threads(), tree)
    known = target.costs.get(key)
    if known is None or len(known.seconds) < max_tokens:
        stored = curve_key(target, backend, tree=tree)
        known, kept = default_store().curve(
            stored, lambda: measure_cost(backend, max_tokens, log, tree=tree), max_tokens
        )
        if kept:
            log(f"forward cost of 1..{len(known.seconds)} tokens ({stored.kind}): as measured before on this machine")
        target.costs[key] = known
    return known


def curve_key(target: LoadedModel, backend: Backend, *, tree: bool = False) -> CurveKey:
    """What `cached_cost` keeps `backend`'s curve over `target` under (chains, or trees)."""
    import torch

    from leapdecode.engine.cost_store import CurveKey

    return CurveKey(model_key(target, backend), "trees" if tree else "chains", torch.get_num_threads())


def model_key(lm: LoadedModel, backend: Backend) -> str:
    """What a stored cost curve of `backend` over `lm` is kept under: the weights' fingerprint,
    how they run (the precision, the device, the paths that actually run: the quantized kernel
    or its fallback, the lean forward or the model's own) and the backend's kind."""
    from leapdecode.engine.backend import TorchBackend
    from leapdecode.models.quantize import kernel

    paths = []
    if lm.quantize != "none":
        paths.append("kernel" if kernel() is not None else "no kernel")
    if isinstance(backend, TorchBackend):
        lean = backend.lean
        paths.append("own forward" if lean is None else "lean native" if lean.native is not None else "lean python")
    return f"{lm.fingerprint} {lm.describe} {lm.device} {' '.join(paths)} {type(backend).__name__}"


def measure_cost(backend: Backend, max_tokens: int, log: Log, *, tree: bool = False) -> ForwardCost:
    """The backend's cost of passes over 1..max_tokens tokens (chains, or trees), measured now."""
    from leapdecode.engine.cost_measure import measure_forward_cost

    log(f"measuring the forward cost of 1..{max_tokens} tokens ({'trees' if tree else 'chains'})")
    cost = measure_forward_cost(backend, max_tokens, tree=tree)
    log("forward cost (ms): " + " ".join(f"{n}:{1000 * s:.0f}" for n, s in enumerate(cost.seconds, 1)))
    return cost


def cost_aware_factory(factory: DrafterFactory, cost: PassCost) -> DrafterFactory:
    """Wrap every drafter `factory` builds in a `CostAwareDrafter` over `cost`: each step keeps
    only the part of a draft worth its cost (past the measured sizes, the curve's last slope goes
    on). Greedy requests share one acceptance estimate: each starts from what earlier ones learned
    (their output does not depend on the drafts). A sampled request keeps its own: sampled
    acceptance differs from greedy's (its text does not depend on the drafts either: the noise
    is per position, `leapdecode.engine.noise`)."""
    from leapdecode.drafters.cost_aware import AcceptanceEstimate, CostAwareDrafter

    shared = AcceptanceEstimate()

    def build(sampling: SamplingParams, noise: PositionNoise) -> Drafter:
        estimate = shared if sampling.greedy else AcceptanceEstimate()
        return CostAwareDrafter(factory(sampling, noise), cost, estimate)

    return build
