"""Run methods side by side on the same prompts, following BENCHMARK.md:
same process and model, interleaved per prompt (the order of the methods rotates from prompt to
prompt and repeat to repeat, so none always runs first), warm-up generations on a few prompts per
method, greedy, fixed max_new_tokens, fixed threads, the device synchronised at the timer's edges,
`repeats` timed runs per sample (median, with the spread kept), peak memory in a separate untimed
pass, and a lossless check on every sample.
"""

from __future__ import annotations

import copy
import dataclasses
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

import torch

from leapdecode.api import Decoder, encode_prompt
from leapdecode.bench.datasets import BenchPrompt
from leapdecode.bench.memory import PeakRss, parameter_mb
from leapdecode.engine import GenerationStats, StopCriteria
from leapdecode.engine.reference import agreement, full_model_predictions
from leapdecode.errors import InputError, MethodError
from leapdecode.methods import (
    Autoregressive, DraftModel, HfAssisted, HfGenerate, HfPromptLookup, LlamaCppPlain, LlamaCppPromptLookup, Method,
    check_same_vocabulary, parse_method,
)
from leapdecode.models import LoadedModel, load_model
from leapdecode.models.loading import BACKENDS, DTYPES
from leapdecode.models.quantize import QUANTIZE_MODES

BASELINE = str(Autoregressive())


@dataclass(frozen=True)
class RunOutput:
    token_ids: list[int]
    stats: GenerationStats


@dataclass
class Sample:
    """One method on one prompt: the per-sample record written to samples.jsonl."""

    method: str
    prompt_id: str
    category: str
    prompt_tokens: int
    new_tokens: int
    wall_time_s: float
    forward_passes: int
    drafted_tokens: int
    accepted_tokens: int
    accepted_lengths: list[int]
    tau: float
    alpha: float
    tokens_per_s: float
    lossless: bool
    equal_to_plain: bool | None = None  # None for the baseline itself
    first_difference: int | None = None  # first differing position, when not equal
    token_ids: list[int] = field(default_factory=list)
    peak_memory_mb: float = 0.0  # parameters of the models used + peak RSS growth while generating (untimed pass)
    agreement: float | None = None  # lossy methods: share of tokens equal to the full model's on the same prefix
    wall_time_runs: list[float] = field(default_factory=list)  # every timed run; wall_time_s is their median

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class Runner(Protocol):
    method: Method
    label: str  # the method's name in the results, with @backend when not the run's
    lm: LoadedModel
    weights_mb: float  # parameters of every model the method runs

    def run(self, prompt_ids: list[int], max_new_tokens: int) -> RunOutput: ...


def weights_mb(lm: LoadedModel) -> float:
    """Memory of a model's parameters: float tensors for PyTorch, the GGUF file for llama.cpp."""
    if lm.backend == "llama.cpp":
        from leapdecode.models.llamacpp import parameter_mb as gguf_mb

        return gguf_mb(lm.model)
    return parameter_mb(lm.model)


class EngineRunner:
    """A method of this project, through the shared decode loop."""

    def __init__(self, lm: LoadedModel, method: Method, draft_model: LoadedModel | None = None, label: str = "") -> None:
        self.method = method
        self.lm = lm
        self.label = label or str(method)
        self.decoder = Decoder(lm, method, draft_model=draft_model)
        self.weights_mb = weights_mb(lm) + (weights_mb(draft_model) if draft_model else 0.0)
        self._draft_model = draft_model
        self._untimed: Decoder | None = None

    def warm(self, prompt_ids: list[int], max_new_tokens: int) -> RunOutput:
        """An untimed run (warm-up, memory) on a second decoder of the same method: methods that
        share state across requests (`shared=true`) must not meet a prompt before its timed run."""
        if self._untimed is None:
            self._untimed = Decoder(self.lm, self.method, draft_model=self._draft_model)
        return self._timed(self._untimed, prompt_ids, max_new_tokens)

    def run(self, prompt_ids: list[int], max_new_tokens: int) -> RunOutput:
        return self._timed(self.decoder, prompt_ids, max_new_tokens)

    def _timed(self, decoder: Decoder, prompt_ids: list[int], max_new_tokens: int) -> RunOutput:
        synchronize(self.lm.device)
        start = time.perf_counter()
        result = decoder.generate(prompt_ids, max_new_tokens=max_new_tokens)
        synchronize(self.lm.device)
        return RunOutput(result.token_ids, dataclasses.replace(result.stats, wall_time_s=time.perf_counter() - start))


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work, so that a timer edge is where the work is."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class HfRunner:
    """A peer: Hugging Face `generate`, greedy, with the same end-of-turn ids.

    Target forward passes are counted with a forward hook on the model (public API), so that
    tau is comparable with the engine's.
    """

    def __init__(self, lm: LoadedModel, method: Method, assistant: LoadedModel | None = None, label: str = "") -> None:
        self.method = method
        self.lm = lm
        self.label = label or str(method)
        if lm.backend != "torch":
            raise MethodError(f"{method.name} runs Hugging Face generate: give it the torch backend ({method.name}@torch)")
        self.kwargs: dict[str, Any] = {}
        self.weights_mb = parameter_mb(lm.model)
        if isinstance(method, HfPromptLookup):
            self.kwargs = dict(prompt_lookup_num_tokens=method.tokens, max_matching_ngram_size=method.max_ngram)
        elif isinstance(method, HfAssisted):
            if assistant is None:
                raise MethodError("hf-assisted needs its draft model loaded")
            check_same_vocabulary(lm, assistant)
            self.kwargs = dict(assistant_model=_with_assistant_settings(assistant.model, method))
            self.weights_mb += parameter_mb(assistant.model)
        elif not isinstance(method, HfGenerate):
            raise MethodError(f"{method.name} is not a Hugging Face peer")

    def run(self, prompt_ids: list[int], max_new_tokens: int) -> RunOutput:
        model = self.lm.model
        ids = torch.tensor([prompt_ids], device=model.device)  # [1, T]
        calls = [0]
        hook = model.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
        try:
            synchronize(model.device)
            start = time.perf_counter()
            with torch.inference_mode():
                out = model.generate(
                    ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
                    eos_token_id=sorted(self.lm.eos_token_ids), pad_token_id=_pad_id(self.lm), **self.kwargs,
                )
            synchronize(model.device)
            elapsed = time.perf_counter() - start
        finally:
            hook.remove()
        tokens = out[0, len(prompt_ids) :].tolist()
        # generate pads finished sequences only in batches; cut at the first end-of-turn id anyway
        keep, _ = StopCriteria(self.lm.eos_token_ids, max_new_tokens).cut([], tokens)
        tokens = tokens[:keep]
        stats = GenerationStats(
            new_tokens=len(tokens), forward_passes=calls[0], drafted_tokens=0, accepted_tokens=0,
            wall_time_s=elapsed, accepted_lengths=(),
        )
        return RunOutput(tokens, stats)


class LlamaCppPeerRunner:
    """A peer: llama-cpp-python's own generator, greedy, on the same GGUF and thread count;
    with `llama-cpp-pld`, its prompt-lookup speculative decoding (`LlamaPromptLookupDecoding`).
    Forward passes are counted by a subclass that counts `eval` calls."""

    def __init__(self, lm: LoadedModel, method: Method, label: str = "") -> None:
        if lm.backend != "llama.cpp":
            raise MethodError(f"{method.name} is llama-cpp-python itself: run the bench with --backend llama.cpp")
        from llama_cpp import Llama
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        class CountingLlama(Llama):
            evals = 0

            def eval(self, tokens: Sequence[int]) -> None:
                self.evals += 1
                super().eval(tokens)

        self.method = method
        self.lm = lm
        self.label = label or str(method)
        draft = None
        if isinstance(method, LlamaCppPromptLookup):
            draft = LlamaPromptLookupDecoding(num_pred_tokens=method.tokens, max_ngram_size=method.max_ngram)
        model = lm.model
        # With a draft model, Llama keeps logits for every position but sizes that buffer from
        # logits_all: say it, or it overflows past n_batch tokens (llama-cpp-python 0.3.36).
        self.llm = CountingLlama(
            model_path=str(model.path), n_ctx=model.n_ctx, n_batch=model.n_batch, n_threads=model.n_threads,
            n_threads_batch=model.n_threads, draft_model=draft, logits_all=draft is not None, verbose=False,
        )
        self.weights_mb = weights_mb(lm)

    def run(self, prompt_ids: list[int], max_new_tokens: int) -> RunOutput:
        llm = self.llm
        llm.reset()  # no prefix reuse from the previous prompt: every method starts cold
        llm.evals = 0
        tokens: list[int] = []
        start = time.perf_counter()
        for token in llm.generate(prompt_ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True):
            tokens.append(int(token))
            if token in self.lm.eos_token_ids or len(tokens) >= max_new_tokens:
                break
        elapsed = time.perf_counter() - start
        stats = GenerationStats(
            new_tokens=len(tokens), forward_passes=llm.evals, drafted_tokens=0, accepted_tokens=0,
            wall_time_s=elapsed, accepted_lengths=(),
        )
        return RunOutput(tokens, stats)


def _with_assistant_settings(model: Any, method: HfAssisted) -> Any:
    """The draft model as transformers' assisted generation should see it: transformers reads the
    draft length, schedule and confidence threshold from the assistant's own generation config,
    so this peer gets a shallow copy of the model (same modules and weights) with a config of its
    own, and the loaded draft model that other methods share is left as it was."""
    view = copy.copy(model)
    config = copy.deepcopy(model.generation_config)
    config.num_assistant_tokens = method.tokens
    config.num_assistant_tokens_schedule = method.schedule
    config.assistant_confidence_threshold = method.threshold
    view.generation_config = config
    return view


def _pad_id(lm: LoadedModel) -> int:
    pad = lm.tokenizer.pad_token_id
    return pad if pad is not None else min(lm.eos_token_ids)


def make_runner(lm: LoadedModel, entry: Entry, load_draft: Callable[[str, LoadedModel], LoadedModel]) -> Runner:
    method = entry.method
    if isinstance(method, (LlamaCppPlain, LlamaCppPromptLookup)):
        return LlamaCppPeerRunner(lm, method, entry.label)
    draft = load_draft(method.model, lm) if isinstance(method, (DraftModel, HfAssisted)) and method.model else None
    return HfRunner(lm, method, draft, entry.label) if method.peer else EngineRunner(lm, method, draft, entry.label)


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
        dtype = self.dtype or ("float32" if quantize != "none" else dtype)
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


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def token_agreement(lm: LoadedModel, prompt_ids: list[int], token_ids: list[int]) -> float:
    """A lossy method's agreement (CALM's consistency): the share of its tokens that the full
    model would have chosen after the same prefix; measured after the timed run."""
    if not token_ids:
        return 1.0
    predicted = full_model_predictions(lm.model, prompt_ids, token_ids)  # [T]
    return agreement(predicted, torch.tensor(token_ids, device=predicted.device))


def encode_turns(lm: LoadedModel, prompt: BenchPrompt, answer: Callable[[list[int]], list[int]]) -> list[int]:
    """A prompt's token ids; a later turn of a conversation comes after the earlier turns, each
    followed by the target's answer to it (`answer`: plain greedy decoding, the same for every method)."""
    if not prompt.earlier:
        return encode_prompt(lm, prompt.text, chat=prompt.chat)
    if not prompt.chat:
        raise InputError(f"prompt {prompt.id}: a conversation's later turn needs the chat template")
    messages: list[dict[str, str]] = []
    for turn in prompt.earlier:
        messages.append({"role": "user", "content": turn})
        reply = answer(encode_prompt(lm, messages))
        messages.append({"role": "assistant", "content": lm.tokenizer.decode(reply, skip_special_tokens=True)})
    return encode_prompt(lm, [*messages, {"role": "user", "content": prompt.text}])


def warm(runner: Runner, prompt_ids: list[int], max_new_tokens: int) -> None:
    """An untimed run that leaves no trace in the runner's timed decoder (engine runners)."""
    if isinstance(runner, EngineRunner):
        runner.warm(prompt_ids, max_new_tokens)
    else:
        runner.run(prompt_ids, max_new_tokens)


def run_benchmark(
    lm: LoadedModel,
    methods: Sequence[Method | Entry],
    prompts: Sequence[BenchPrompt],
    max_new_tokens: int,
    on_sample: Callable[[Sample], None] = lambda s: None,
    log: Callable[[str], None] = lambda m: None,
    load_variant: Callable[[Variant], LoadedModel] | None = None,
    repeats: int = 1,
    warmup_prompts: int = 3,
) -> list[Sample]:
    """Every method on every prompt, `repeats` timed runs each; returns one Sample per pair.
    An entry with a model variant runs on the model `load_variant(variant)` gives (which returns
    `lm` itself for a variant that is the run's own model)."""
    if repeats < 1:
        raise MethodError(f"repeats must be >= 1, got {repeats}")
    drafts: dict[tuple[str, str, str], LoadedModel] = {}
    models: dict[Variant, LoadedModel] = {Variant(): lm}

    def load_draft(name: str, target: LoadedModel) -> LoadedModel:
        """One copy of each draft model per target dtype and quantization, loaded as the target is."""
        key = (name, str(target.model.dtype), target.quantize)
        if key not in drafts:
            drafts[key] = load_model(name, device=target.device, dtype=target.model.dtype, quantize=target.quantize, log=log)
        return drafts[key]

    def with_model(entry: Entry) -> tuple[Entry, LoadedModel]:
        if entry.variant == Variant(backend=lm.backend):
            return Entry(entry.method), lm
        if entry.variant not in models:
            if load_variant is None:
                raise MethodError(f"{entry.label}: this benchmark cannot load the model @{entry.variant}")
            models[entry.variant] = load_variant(entry.variant)
        model = models[entry.variant]
        return (Entry(entry.method) if model is lm else entry), model

    placed = [with_model(m if isinstance(m, Entry) else Entry(m)) for m in methods]
    refuse_twice([e for e, _ in placed], " on the run's own model")
    placed = [(Entry(Autoregressive()), lm)] + [(e, model) for e, model in placed if e.label != BASELINE]
    runners = [make_runner(model, e, load_draft) for e, model in placed]
    encoded = [encode_turns(lm, p, lambda ids: runners[0].run(ids, max_new_tokens).token_ids) for p in prompts]
    for runner in runners:  # warm-up generations on a few prompts
        for prompt_ids in encoded[:warmup_prompts]:
            warm(runner, prompt_ids, min(16, max_new_tokens))
    # Peak memory in its own untimed pass (a sampling thread would steal time from a timed run):
    # each method once on the longest prompt.
    longest = max(encoded, key=len)
    memory_mb: dict[str, float] = {}
    for runner in runners:
        with PeakRss(lm.device) as memory:
            warm(runner, longest, max_new_tokens)
        memory_mb[runner.label] = runner.weights_mb + memory.growth_mb
    samples: list[Sample] = []
    # Each model's output is checked against plain decoding on that model when the run has it
    # (`ar@int4` for `anpd@int4`): two models' numerics differ, so their tokens may too.
    plain_label = {
        r.label: next((p.label for p in runners if isinstance(p.method, Autoregressive) and p.lm is r.lm), "")
        for r in runners
    }
    for index, (prompt, prompt_ids) in enumerate(zip(prompts, encoded)):
        outputs: dict[str, RunOutput] = {}
        times: dict[str, list[float]] = {r.label: [] for r in runners}
        for repeat in range(repeats):
            shift = (index * repeats + repeat) % len(runners)
            for runner in runners[shift:] + runners[:shift]:
                out = runner.run(prompt_ids, max_new_tokens)
                outputs.setdefault(runner.label, out)
                times[runner.label].append(out.stats.wall_time_s)
        for runner in runners:
            label = runner.label
            out = outputs[label]
            reference = outputs.get(plain_label[label]) if label != plain_label[label] else None
            diff = None if reference is None else first_difference(reference.token_ids, out.token_ids)
            agreed = None if runner.method.lossless else token_agreement(runner.lm, prompt_ids, out.token_ids)
            s = out.stats
            wall = statistics.median(times[label])
            sample = Sample(
                method=label, prompt_id=prompt.id, category=prompt.category, prompt_tokens=len(prompt_ids),
                new_tokens=s.new_tokens, wall_time_s=wall, forward_passes=s.forward_passes,
                drafted_tokens=s.drafted_tokens, accepted_tokens=s.accepted_tokens,
                accepted_lengths=list(s.accepted_lengths), tau=s.tau, alpha=s.alpha,
                tokens_per_s=s.new_tokens / wall if wall > 0 else 0.0,
                lossless=runner.method.lossless, equal_to_plain=None if reference is None else diff is None,
                first_difference=diff, token_ids=out.token_ids,
                peak_memory_mb=memory_mb[label], agreement=agreed, wall_time_runs=times[label],
            )
            samples.append(sample)
            on_sample(sample)
    return samples
