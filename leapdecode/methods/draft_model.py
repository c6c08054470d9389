"""Draft-model speculative decoding: a smaller model with the same tokenizer drafts the chain."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, ClassVar

from leapdecode.choices import DRAFT_SCHEDULES
from leapdecode.errors import MethodError, ModelLoadError
from leapdecode.methods.base import (
    Capabilities,
    DrafterFactory,
    Log,
    Method,
    cached_cost,
    curve_key,
    logger,
    model_key,
)

if TYPE_CHECKING:
    from leapdecode.engine.backend import Backend, TorchBackend
    from leapdecode.engine.cost import ForwardCost
    from leapdecode.engine.drafting import Drafter
    from leapdecode.engine.noise import PositionNoise
    from leapdecode.engine.sampling import SamplingParams
    from leapdecode.models.loading import LoadedModel

PRECISIONS = (
    "int4",
    "own",
)  # the draft model's linear layers: the packed int4 kernel, or what the target's precision gives it
CASCADE_N = 5  # the n-gram order of ANPD at the bottom of the cascade
DRAFT_COST_ROWS = 8  # the draft pass's cost measured for 1..8 sequences of a row each (more: its last slope goes on)
MIN_WINDOW = 16  # the 4 attention sinks and a dozen recent tokens
MIN_VOCAB = 256  # a smaller draft vocabulary could not hold the end-of-turn and byte tokens a chat needs


@dataclass(frozen=True)
class DraftModel(Method):
    """Speculative decoding with a smaller draft model (Leviathan et al.; Chen et al.)."""

    name: ClassVar[str] = "draft"
    summary: ClassVar[str] = "draft-model speculative decoding: a smaller model with the same tokenizer drafts k tokens"
    kind: ClassVar[Capabilities] = Capabilities("chain", loads_files=True)
    model: str = ""
    k: int = 5
    schedule: str = "constant"  # or "heuristic": adapt k from the last verdict
    threshold: float = 0.0  # stop drafting after a token the draft model gives less than this
    cascade: bool = False  # ANPD drafts for the draft model (vertical cascade)
    # sampling: the draft model picks with the target's own per-position uniforms, so a sampled
    # text equals plain sampling's (False: its own noise, verified by min(1, p/q))
    coupled: bool = True
    # the draft model's own numerics never change the output (the target verifies every token):
    # by default it runs its cheapest path, int4 whatever its checkpoint holds, and scores only
    # the `vocab` tokens answers use most (0: its whole output layer)
    precision: str = "int4"
    vocab: int = 32768
    # with a draft vocabulary, the draft model's layers run a lean forward of few calls (in C++ where
    # it builds), checked bitwise against the model's own at load (false: transformers' forward)
    lean: bool = True
    # draft each next token only while it pays for its draft pass and its verification row, by
    # the draft's own probability calibrated online (`DraftModelDrafter`'s `cost`); not with the cascade
    cost_aware: bool = True
    # the measured costs follow what the request's own passes take (`engine.cost.LiveCost`), so
    # a machine that drifts, or a measurement at load caught in a burst of other load, does not
    # decide whether the draft model runs (false: the costs as measured at load, or kept from an
    # earlier measurement on this machine: `engine.cost_store`)
    live_cost: bool = True
    # retrieval first: where a suffix match (of at least `suffix_min` tokens) promises more than
    # the draft model, draft up to `suffix_k` tokens from it, a tree of what followed the match
    # (`suffix_tree`; false: its most probable path), and skip the draft model (with cost_aware)
    suffix: bool = True
    suffix_k: int = 16
    suffix_min: int = 1
    suffix_tree: bool = True
    # the draft model reads at most `window` tokens of the context before its first pass (the
    # prompt and what was emitted before it started), its first 4 (attention sinks) and its last,
    # so that a long prompt's draft prefill stays short (0: all of it)
    window: int = 128
    # tokens of finished requests' draft-model caches kept: a prompt that begins as an earlier
    # prompt and answer did (a chat's next turn) starts the draft model from that prefix, whole,
    # and it reads only the rest (at most `window` of it); 0: none
    prefix_cache: int = 8192

    @property
    def chain_length(self) -> int:
        return self.k

    @property
    def capabilities(self) -> Capabilities:
        return replace(self.kind, drafts="chain", cost_aware=self.cost_aware, coupled=self.coupled)

    @property
    def draft_length(self) -> int:
        """The longest chain a pass verifies: k, or a suffix match's `suffix_k` where retrieval drafts."""
        return max(self.k, self.suffix_k) if self.suffix and self.cost_aware and not self.cascade else self.k

    def __post_init__(self) -> None:
        self._require(1 <= self.k <= 64, f"k must be between 1 and 64, got {self.k}")
        self._require(
            self.schedule in DRAFT_SCHEDULES,
            f"schedule must be one of {', '.join(DRAFT_SCHEDULES)}, got {self.schedule!r}",
        )
        self._require(0.0 <= self.threshold < 1.0, f"threshold must be in [0, 1), got {self.threshold}")
        self._require(1 <= self.suffix_k <= 64, f"suffix_k must be between 1 and 64, got {self.suffix_k}")
        self._require(1 <= self.suffix_min <= 16, f"suffix_min must be between 1 and 16, got {self.suffix_min}")
        self._require(
            self.window == 0 or self.window >= MIN_WINDOW,
            f"window must be 0 (the whole context) or at least {MIN_WINDOW} tokens, got {self.window}",
        )
        self._require(self.prefix_cache >= 0, f"prefix_cache must be 0 (none) or more tokens, got {self.prefix_cache}")
        self._require(
            self.precision in PRECISIONS, f"precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}"
        )
        self._require(
            self.vocab == 0 or self.vocab >= MIN_VOCAB,
            f"vocab must be 0 (the whole output layer) or at least {MIN_VOCAB}, got {self.vocab}",
        )

    def prepare(
        self,
        target: LoadedModel,
        *,
        draft_model: LoadedModel | None = None,
        log: Log | None = None,
        backend: Backend | None = None,
        cost: ForwardCost | None = None,
    ) -> DrafterFactory:
        """The per-request drafter factory; with `cost_aware`, its drafters cut their own drafts
        by what a draft pass and a verification row cost (`cost`: the target's curve, measured
        here when not given), so no wrapper cuts them again."""
        log = log or logger.info
        if self.cost_aware and not self.cascade and cost is None:
            cost = cached_cost(target, backend or self.make_backend(target), self.pass_size, log)
        return self.build_factory(target, draft_model, log, cost if self.cost_aware and not self.cascade else None)

    def drafter_factory(self, target: LoadedModel, *, draft_model: LoadedModel | None, log: Log) -> DrafterFactory:
        return self.build_factory(target, draft_model, log, None)

    def build_factory(
        self, target: LoadedModel, draft_model: LoadedModel | None, log: Log, cost: ForwardCost | None
    ) -> DrafterFactory:
        import torch

        from leapdecode.drafters.cost_aware import AcceptanceEstimate, LengthEstimate
        from leapdecode.drafters.draft_model import DraftModelDrafter
        from leapdecode.drafters.draft_pricing import DraftCost
        from leapdecode.drafters.suffix import SuffixDrafter
        from leapdecode.engine.cost import LiveCost
        from leapdecode.engine.cost_measure import measure_batch_cost, measure_forward_cost, measure_prefill_cost
        from leapdecode.engine.cost_store import CurveKey, default_store
        from leapdecode.engine.prefix_cache import PrefixCache

        if target.backend != "torch":
            raise MethodError(f"draft: draft-model decoding runs on the torch backend, not {target.backend}")
        if draft_model is None:
            if not self.model:
                raise MethodError("draft: needs model=NAME (a preset, folder, .gguf or hub id) for the draft model")
            draft_model = self.load_draft(target, log)
        check_same_vocabulary(target, draft_model)
        backend = self.draft_backend(target, draft_model, log)
        cascade_n = CASCADE_N if self.cascade else 0
        draft_cost = None
        if cost is not None:
            # a shared round packs a row per request drafting: measured as such for 1-8 sequences
            # (larger batches extrapolate its last slope); a draft model that cannot pack
            # sequences scores each request's feed in a pass of its own: one pass each
            packs = backend.batchable is None
            store, threads = default_store(), torch.get_num_threads()
            what = f"{model_key(draft_model, backend)} vocab={self.vocab}"

            def measure_draft() -> ForwardCost:
                if packs:
                    return measure_batch_cost(backend, DRAFT_COST_ROWS, DRAFT_COST_ROWS)
                return measure_forward_cost(backend, 1)

            kind, rows = (f"draft batch {DRAFT_COST_ROWS}", DRAFT_COST_ROWS) if packs else ("draft pass", 1)
            draft_key = CurveKey(what, kind, threads)
            draft_curve = store.curve(draft_key, measure_draft, rows)[0]
            # its own prompt prefill, fed before its first draft, is priced against the steps it serves
            prefill_key = CurveKey(what, "prefill a token", threads)
            prefill = store.curve(prefill_key, lambda: measure_prefill_cost(backend))[0].seconds[0]
            if self.live_cost:  # the draft model's factor over the target's, which every step times
                # a curve whose shape the passes contradict is forgotten: the next start measures it again
                target_now = LiveCost(
                    cost, on_misshapen=lambda: store.forget(curve_key(target, self.make_backend(target)))
                )
                draft_live = LiveCost(draft_curve, leader=target_now, on_misshapen=lambda: store.forget(draft_key))
                draft_cost = DraftCost(draft_live, target_now, prefill)
            else:
                draft_cost = DraftCost(draft_curve, cost, prefill)
            log(
                f"draft pass {1000 * draft_cost.draft_pass:.1f} ms ({DRAFT_COST_ROWS} rows "
                f"{1000 * draft_cost.draft.of(DRAFT_COST_ROWS):.1f} ms, prefill "
                f"{1000 * draft_cost.catch_up:.2f} ms a token), target pass {1000 * cost.of(1):.1f} ms"
            )
        shared = AcceptanceEstimate()  # greedy requests share what acceptance the draft's confidence means
        kept = PrefixCache(self.prefix_cache) if self.prefix_cache else None  # the requests' draft caches
        lengths = LengthEstimate()  # every request learns from earlier ones how long answers run

        def factory(sampling: SamplingParams, noise: PositionNoise) -> Drafter:
            return DraftModelDrafter(
                backend,
                self.k,
                sampling=sampling,
                noise=noise,
                coupled=self.coupled,
                schedule=self.schedule,
                threshold=self.threshold,
                cascade_n=cascade_n,
                cost=draft_cost,
                estimate=shared if sampling.greedy else AcceptanceEstimate(),
                lengths=lengths,
                retrieval=(
                    SuffixDrafter(self.suffix_k, min_match=self.suffix_min, tree=self.suffix_tree)
                    if self.suffix
                    else None
                ),
                window=self.window,
                prefix_cache=kept,
            )

        return factory

    def load_draft(self, target: LoadedModel, log: Log) -> LoadedModel:
        """The draft model on its cheapest path: int4 (rounded from float32, whatever its file
        holds; its output layer too, which a target keeps at int8) on a CPU, unless
        `precision=own` (then as the target's precision gives it)."""
        import dataclasses

        from leapdecode.models.loading import QUANTIZED_FORMAT, default_cache_dir, load_model
        from leapdecode.models.quantize import quantize_model, quantize_through_cache
        from leapdecode.models.rounding import rounding_version

        if self.precision == "own" or target.device.type != "cpu":
            return load_model(
                self.model,
                device=target.device,
                dtype=target.model.dtype,
                quantize=target.quantize,
                log=log,
                share_tokenizer=target,
            )
        draft = load_model(
            self.model, device=target.device, dtype="float32", quantize="none", log=log, share_tokenizer=target
        )
        # rounded once per model (seconds), then read back from the cache, as a GGUF's blocks are;
        # the name holds the rounding's own version, so a changed rounding is never read back
        name = f"{draft.fingerprint}-draft-int4-r{rounding_version()}-v{QUANTIZED_FORMAT}.safetensors"
        saved = default_cache_dir() / "quantized" / name

        def swap(read_back: bool) -> int:  # every layer the saved file did not hold (all, without one)
            swapped = quantize_model(draft.model, "int4", head_bits=4)
            if swapped:
                log(f"draft model {draft.name}: rounded its linear layers, output layer too, to int4 for drafting")
            return swapped

        if quantize_through_cache(draft.model, saved, f"{draft.fingerprint}-draft-int4-*.safetensors", swap, log):
            log(f"draft model {draft.name}: int4 for drafting, as rounded before ({saved.name})")
        return dataclasses.replace(draft, quantize="int4", precision="int4, rounded for drafting")

    def draft_backend(self, target: LoadedModel, draft: LoadedModel, log: Log) -> TorchBackend:
        """The draft model's backend: its output layer cut to the draft vocabulary (`vocab`)."""
        from leapdecode.engine.backend import TorchBackend
        from leapdecode.engine.draft_head import DraftHeadBackend
        from leapdecode.heads.vocabulary import draft_vocabulary
        from leapdecode.models.loading import default_cache_dir

        # row-exact, the draft model's passes can pack several requests' sequences (`batchable`)
        size = target.model.config.get_text_config().vocab_size
        if self.vocab == 0 or self.vocab >= size:
            return TorchBackend(draft.model, exact_tokens=draft.exact_tokens)
        vocab, source = draft_vocabulary(
            target.tokenizer, self.vocab, size, sorted(target.eos_token_ids), default_cache_dir()
        )
        log(f"draft vocabulary: {len(vocab.ids)} of {size} tokens ({source})")
        backend = DraftHeadBackend(draft.model, vocab.ids, exact_tokens=draft.exact_tokens, lean=self.lean)
        if backend.lean is not None:
            how = "its layers in one C++ call a pass" if backend.lean.native is not None else "a Python loop"
            log(f"draft model: the lean forward ({how}), bitwise its own forward's states")
        elif self.lean:
            log(f"draft model: transformers' forward ({backend.lean_reason})")
        return backend


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
