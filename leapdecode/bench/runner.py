"""Run methods side by side on the same prompts, following BENCHMARK.md:
same process and model, interleaved per prompt (the order of the methods rotates from prompt to
prompt and repeat to repeat, so none always runs first), warm-up generations on a few prompts per
method, greedy, fixed max_new_tokens, fixed threads, the device synchronised at the timer's edges,
`repeats` timed runs per sample (median, with the spread kept), peak memory in a separate untimed
pass, and a lossless check on every sample.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

import torch

from leapdecode.api import Decoder, encode_prompt
from leapdecode.bench.datasets import BenchPrompt
from leapdecode.bench.entries import Entry, Variant, refuse_twice
from leapdecode.bench.memory import PeakRss, weights_mb
from leapdecode.bench.peers import HfRunner, LlamaCppPeerRunner
from leapdecode.bench.timing import RunOutput, synchronize
from leapdecode.engine.reference import agreement, full_model_predictions
from leapdecode.engine.sampling import SamplingParams
from leapdecode.errors import InputError, MethodError
from leapdecode.methods import (
    Autoregressive,
    DraftModel,
    HfAssisted,
    LlamaCppPlain,
    LlamaCppPromptLookup,
    LlamaCppSpeculative,
    Method,
)
from leapdecode.models import LoadedModel, load_model

BASELINE = str(Autoregressive())


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

    def run(self, prompt_ids: list[int], max_new_tokens: int, seed: int | None = None) -> RunOutput:
        """One generation: greedy, or sampled with the runner's sampling and this `seed`."""
        ...


class EngineRunner:
    """A method of this project, through the shared decode loop."""

    def __init__(
        self,
        lm: LoadedModel,
        method: Method,
        draft_model: LoadedModel | None = None,
        label: str = "",
        sampling: SamplingParams = SamplingParams(),
    ) -> None:
        self.method = method
        self.lm = lm
        self.label = label or str(method)
        self.sampling = sampling
        self.decoder = Decoder(lm, method, draft_model=draft_model)
        self.weights_mb = weights_mb(lm) + (weights_mb(draft_model) if draft_model else 0.0)
        self._draft_model = draft_model
        self._untimed: Decoder | None = None

    def warm(self, prompt_ids: list[int], max_new_tokens: int) -> RunOutput:
        """An untimed run (warm-up, memory) on a second decoder of the same method: methods that
        share state across requests (`shared=true`) must not meet a prompt before its timed run."""
        if self._untimed is None:
            self._untimed = Decoder(self.lm, self.method, draft_model=self._draft_model)
        return self._timed(self._untimed, prompt_ids, max_new_tokens, 0)

    def run(self, prompt_ids: list[int], max_new_tokens: int, seed: int | None = None) -> RunOutput:
        return self._timed(self.decoder, prompt_ids, max_new_tokens, seed)

    def _timed(self, decoder: Decoder, prompt_ids: list[int], max_new_tokens: int, seed: int | None) -> RunOutput:
        sampling = self.sampling
        synchronize(self.lm.device)
        start = time.perf_counter()
        result = decoder.generate(
            prompt_ids,
            max_new_tokens=max_new_tokens,
            temperature=sampling.temperature,
            top_k=sampling.top_k,
            top_p=sampling.top_p,
            seed=None if sampling.greedy else (seed or 0),
        )
        synchronize(self.lm.device)
        return RunOutput(result.token_ids, dataclasses.replace(result.stats, wall_time_s=time.perf_counter() - start))


def make_runner(
    lm: LoadedModel,
    entry: Entry,
    load_draft: Callable[..., LoadedModel],
    sampling: SamplingParams = SamplingParams(),
) -> Runner:
    method = entry.method
    if isinstance(method, (LlamaCppPlain, LlamaCppPromptLookup)):
        return LlamaCppPeerRunner(lm, method, entry.label, sampling)
    if isinstance(method, LlamaCppSpeculative):
        from leapdecode.bench.llamacpp_tools import LlamaCppSpeculativeRunner

        return LlamaCppSpeculativeRunner(lm, method, load_draft(method.model, lm), entry.label, sampling)
    draft = None
    if isinstance(method, DraftModel) and method.model:
        draft = load_draft(method.model, lm, method)
    elif isinstance(method, HfAssisted) and method.model:
        draft = load_draft(method.model, lm)
    if method.capabilities.peer:
        return HfRunner(lm, method, draft, entry.label, sampling)
    return EngineRunner(lm, method, draft, entry.label, sampling)


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
    """A prompt's token ids, after its system message if it has one; a later turn of a conversation
    comes after the earlier turns, each followed by the target's answer to it (`answer`: plain
    greedy decoding, the same for every method)."""
    if not prompt.earlier and not prompt.system:
        return encode_prompt(lm, prompt.text, chat=prompt.chat)
    if not prompt.chat:
        raise InputError(f"prompt {prompt.id}: a system message or a later turn needs the chat template")
    messages = [{"role": "system", "content": prompt.system}] if prompt.system else []
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
    sampling: SamplingParams = SamplingParams(),
) -> list[Sample]:
    """Every method on every prompt, `repeats` timed runs each; returns one Sample per pair.
    An entry with a model variant runs on the model `load_variant(variant)` gives (which returns
    `lm` itself for a variant that is the run's own model). With a temperature in `sampling`,
    every method samples prompt i with seed `sampling.seed + i`: a lossless method's text must
    equal plain sampling's, token for token, as a greedy one's equals plain decoding's."""
    if repeats < 1:
        raise MethodError(f"repeats must be >= 1, got {repeats}")
    drafts: dict[tuple[str, str, str], LoadedModel] = {}
    models: dict[Variant, LoadedModel] = {Variant(): lm}

    def load_draft(name: str, target: LoadedModel, method: DraftModel | None = None) -> LoadedModel:
        """One copy of each draft model per target dtype and quantization, loaded as the target is
        (in llama.cpp for a target there); for this engine's draft-model method, as the method
        loads it for a user (its `precision`: on a CPU, int4 for drafting), one copy per precision."""
        if method is not None and target.backend == "torch":
            key = (name, f"draft:{method.precision}", f"{target.model.dtype} {target.quantize}")
            if key not in drafts:
                drafts[key] = method.load_draft(target, log)
            return drafts[key]
        if target.backend == "llama.cpp":
            key = (name, "llama.cpp", "")
            if key not in drafts:
                drafts[key] = load_model(name, backend="llama.cpp", log=log)
            return drafts[key]
        key = (name, str(target.model.dtype), target.quantize)
        if key not in drafts:
            drafts[key] = load_model(
                name, device=target.device, dtype=target.model.dtype, quantize=target.quantize, log=log
            )
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
    runners = [make_runner(model, e, load_draft, sampling) for e, model in placed]
    # a later turn follows the target's greedy answers to the earlier ones, whatever the sampling
    answer = EngineRunner(lm, Autoregressive(), label=BASELINE)
    encoded = [encode_turns(lm, p, lambda ids: answer.run(ids, max_new_tokens).token_ids) for p in prompts]
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
                out = runner.run(prompt_ids, max_new_tokens, (sampling.seed or 0) + index)
                outputs.setdefault(runner.label, out)
                times[runner.label].append(out.stats.wall_time_s)
        for runner in runners:
            label = runner.label
            out = outputs[label]
            reference = outputs.get(plain_label[label]) if label != plain_label[label] else None
            if not sampling.greedy and not runner.method.capabilities.coupled:
                reference = None  # min(1, p/q) keeps the distribution, not plain sampling's tokens
            diff = None if reference is None else first_difference(reference.token_ids, out.token_ids)
            agreed = (
                None if runner.method.capabilities.lossless else token_agreement(runner.lm, prompt_ids, out.token_ids)
            )
            s = out.stats
            wall = statistics.median(times[label])
            sample = Sample(
                method=label,
                prompt_id=prompt.id,
                category=prompt.category,
                prompt_tokens=len(prompt_ids),
                new_tokens=s.new_tokens,
                wall_time_s=wall,
                forward_passes=s.forward_passes,
                drafted_tokens=s.drafted_tokens,
                accepted_tokens=s.accepted_tokens,
                accepted_lengths=list(s.accepted_lengths),
                tau=s.tau,
                alpha=s.alpha,
                tokens_per_s=s.new_tokens / wall if wall > 0 else 0.0,
                lossless=runner.method.capabilities.lossless,
                equal_to_plain=None if reference is None else diff is None,
                first_difference=diff,
                token_ids=out.token_ids,
                peak_memory_mb=memory_mb[label],
                agreement=agreed,
                wall_time_runs=times[label],
            )
            samples.append(sample)
            on_sample(sample)
    return samples
