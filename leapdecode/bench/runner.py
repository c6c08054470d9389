"""Run methods side by side on the same prompts, following BENCHMARK.md:
same process and model, interleaved per prompt (plain decoding first), one warm-up generation
per method, greedy, fixed max_new_tokens, fixed threads, and a lossless check on every sample.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

import torch

from leapdecode.api import Decoder, encode_prompt
from leapdecode.bench.datasets import BenchPrompt
from leapdecode.bench.memory import PeakRss, parameter_mb
from leapdecode.engine import GenerationStats, StopCriteria
from leapdecode.errors import MethodError
from leapdecode.methods import (
    Autoregressive, DraftModel, HfAssisted, HfGenerate, HfPromptLookup, Method, check_same_vocabulary, parse_method,
)
from leapdecode.models import LoadedModel, load_model

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
    peak_memory_mb: float = 0.0  # parameters of the models used + peak RSS growth while generating

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class Runner(Protocol):
    method: Method
    weights_mb: float  # parameters of every model the method runs

    def run(self, prompt_ids: list[int], max_new_tokens: int) -> RunOutput: ...


class EngineRunner:
    """A method of this project, through the shared decode loop."""

    def __init__(self, lm: LoadedModel, method: Method, draft_model: LoadedModel | None = None) -> None:
        self.method = method
        self.decoder = Decoder(lm, method, draft_model=draft_model)
        self.weights_mb = parameter_mb(lm.model) + (parameter_mb(draft_model.model) if draft_model else 0.0)

    def run(self, prompt_ids: list[int], max_new_tokens: int) -> RunOutput:
        result = self.decoder.generate(prompt_ids, max_new_tokens=max_new_tokens)
        return RunOutput(result.token_ids, result.stats)


class HfRunner:
    """A peer: Hugging Face `generate`, greedy, with the same end-of-turn ids.

    Target forward passes are counted with a forward hook on the model (public API), so that
    tau is comparable with the engine's.
    """

    def __init__(self, lm: LoadedModel, method: Method, assistant: LoadedModel | None = None) -> None:
        self.method = method
        self.lm = lm
        self.kwargs: dict[str, Any] = {}
        self.weights_mb = parameter_mb(lm.model)
        if isinstance(method, HfPromptLookup):
            self.kwargs = dict(prompt_lookup_num_tokens=method.tokens, max_matching_ngram_size=method.max_ngram)
        elif isinstance(method, HfAssisted):
            if assistant is None:
                raise MethodError("hf-assisted needs its draft model loaded")
            check_same_vocabulary(lm, assistant)
            # transformers reads these from the assistant's own generation config
            config = assistant.model.generation_config
            config.num_assistant_tokens = method.tokens
            config.num_assistant_tokens_schedule = method.schedule
            config.assistant_confidence_threshold = method.threshold
            self.kwargs = dict(assistant_model=assistant.model)
            self.weights_mb += parameter_mb(assistant.model)
        elif not isinstance(method, HfGenerate):
            raise MethodError(f"{method.name} is not a Hugging Face peer")

    def run(self, prompt_ids: list[int], max_new_tokens: int) -> RunOutput:
        model = self.lm.model
        ids = torch.tensor([prompt_ids], device=model.device)  # [1, T]
        calls = [0]
        hook = model.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
        try:
            start = time.perf_counter()
            with torch.inference_mode():
                out = model.generate(
                    ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
                    eos_token_id=sorted(self.lm.eos_token_ids), pad_token_id=_pad_id(self.lm), **self.kwargs,
                )
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


def _pad_id(lm: LoadedModel) -> int:
    pad = lm.tokenizer.pad_token_id
    return pad if pad is not None else min(lm.eos_token_ids)


def make_runner(lm: LoadedModel, method: Method, load_draft: Callable[[str], LoadedModel]) -> Runner:
    draft = load_draft(method.model) if isinstance(method, (DraftModel, HfAssisted)) and method.model else None
    return HfRunner(lm, method, draft) if method.peer else EngineRunner(lm, method, draft)


def parse_methods(text: str | Sequence[str]) -> list[Method]:
    """A comma list of method strings; parameters attach to the method before them:
    `ar,anpd:n=5,k=7,hf-pld:tokens=10` is ar, anpd:n=5,k=7 and hf-pld:tokens=10."""
    items = [t.strip() for t in (text.split(",") if isinstance(text, str) else text) if t.strip()]
    groups: list[str] = []
    for item in items:
        if "=" in item and ":" not in item and groups:
            groups[-1] += "," + item
        else:
            groups.append(item)
    methods = [parse_method(g) for g in groups]
    labels = [str(m) for m in methods]
    duplicates = {label for label in labels if labels.count(label) > 1}
    if duplicates:
        raise MethodError(f"method listed twice: {', '.join(sorted(duplicates))}")
    return methods


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def run_benchmark(
    lm: LoadedModel,
    methods: Sequence[Method],
    prompts: Sequence[BenchPrompt],
    max_new_tokens: int,
    on_sample: Callable[[Sample], None] = lambda s: None,
    log: Callable[[str], None] = lambda m: None,
) -> list[Sample]:
    """Every method on every prompt, plain decoding first; returns one Sample per pair."""
    ordered = [Autoregressive()] + [m for m in methods if str(m) != BASELINE]
    drafts: dict[str, LoadedModel] = {}

    def load_draft(name: str) -> LoadedModel:  # one copy of each draft model for the whole run
        if name not in drafts:
            drafts[name] = load_model(name, device=lm.device, dtype=lm.model.dtype, log=log)
        return drafts[name]

    runners = [make_runner(lm, m, load_draft) for m in ordered]
    encoded = [encode_prompt(lm, p.text, chat=p.chat) for p in prompts]
    for runner in runners:  # one warm-up generation per method
        runner.run(encoded[0], min(16, max_new_tokens))
    samples: list[Sample] = []
    for prompt, prompt_ids in zip(prompts, encoded):
        plain_tokens: list[int] = []
        for runner in runners:
            with PeakRss(lm.device) as memory:
                out = runner.run(prompt_ids, max_new_tokens)
            label = str(runner.method)
            if label == BASELINE:
                plain_tokens = out.token_ids
            diff = None if label == BASELINE else first_difference(plain_tokens, out.token_ids)
            s = out.stats
            sample = Sample(
                method=label, prompt_id=prompt.id, category=prompt.category, prompt_tokens=len(prompt_ids),
                new_tokens=s.new_tokens, wall_time_s=s.wall_time_s, forward_passes=s.forward_passes,
                drafted_tokens=s.drafted_tokens, accepted_tokens=s.accepted_tokens,
                accepted_lengths=list(s.accepted_lengths), tau=s.tau, alpha=s.alpha, tokens_per_s=s.tokens_per_s,
                lossless=runner.method.lossless, equal_to_plain=None if label == BASELINE else diff is None,
                first_difference=diff, token_ids=out.token_ids,
                peak_memory_mb=runner.weights_mb + memory.growth_mb,
            )
            samples.append(sample)
            on_sample(sample)
    return samples
