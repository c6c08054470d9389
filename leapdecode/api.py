"""The library API: load, wrap with a method, generate.

import leapdecode
lm = leapdecode.load_model("smollm2-135m")
out = leapdecode.wrap(lm, "anpd:n=5,k=7").generate("def fib(n):", max_new_tokens=128)
print(out.text, out.stats.summary())
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypedDict, Unpack

import torch

from leapdecode.engine import (
    GenerationStats,
    SamplingParams,
    Step,
    StopCriteria,
    TreeVerifier,
    Verifier,
    truncate_at_stop,
)
from leapdecode.engine.alone import decode_run
from leapdecode.engine.loop import SequenceRun
from leapdecode.engine.noise import PositionNoise
from leapdecode.engine.prefix_cache import PrefixCache
from leapdecode.engine.scheduler import BatchScheduler
from leapdecode.engine.verdict import TokenLogprob
from leapdecode.errors import InputError
from leapdecode.gc_pause import gc_paused
from leapdecode.methods import Method, parse_method
from leapdecode.methods.defaults import default_method
from leapdecode.models import LoadedModel
from leapdecode.request import DEFAULT_MAX_NEW_TOKENS, RequestSpec
from leapdecode.verifiers import verify_greedy, verify_speculative, verify_tree_greedy, verify_tree_speculative

if TYPE_CHECKING:
    from leapdecode.engine.cost import ForwardCost

logger = logging.getLogger("leapdecode")

Message = dict[str, str]
Prompt = str | Sequence[Message] | Sequence[int]


@dataclass(frozen=True)
class GenerationResult:
    text: str  # the new text, special tokens skipped, cut before any stop string
    token_ids: list[int]  # the new token ids (an end-of-turn id that stopped generation included)
    prompt_ids: list[int]
    finish_reason: str  # "stop" or "length"
    stats: GenerationStats
    steps: tuple[Step, ...]  # one per target forward pass: drafted, accepted, emitted
    method: str
    logprobs: tuple[TokenLogprob, ...] | None = None  # one per token of token_ids, when asked for


class GenerationOptions(TypedDict, total=False):
    """What `Decoder.stream` and `Decoder.generate` take besides the prompt (see `stream`)."""

    max_new_tokens: int
    stop: Sequence[str]
    chat: bool
    temperature: float
    top_k: int
    top_p: float
    seed: int | None
    generator: torch.Generator | None
    logprobs: int | None


class StepStream(Iterator[Step]):
    """The steps of one generation, as they come (an iterator), with the encoded prompt."""

    def __init__(self, prompt_ids: list[int], steps: Iterator[Step]) -> None:
        self.prompt_ids = prompt_ids
        self._steps = steps

    def __next__(self) -> Step:
        return next(self._steps)

    def close(self) -> None:
        """Stop generating (frees the request's KV cache now rather than when collected)."""
        close = getattr(self._steps, "close", None)
        if close is not None:
            close()


def encode_prompt(lm: LoadedModel, prompt: Prompt, *, chat: bool = False) -> list[int]:
    """Token ids for a prompt: a string (through the chat template when `chat`), a list of
    chat messages (always through the template), or token ids as they are."""
    tokenizer = lm.tokenizer
    if isinstance(prompt, str):
        if not prompt.strip():
            raise InputError("the prompt is empty")
        if chat:
            return encode_prompt(lm, [{"role": "user", "content": prompt}])
        ids = tokenizer(prompt, add_special_tokens=True)["input_ids"]
    elif isinstance(prompt, Sequence) and prompt and all(isinstance(m, dict) for m in prompt):
        for message in prompt:
            if not isinstance(message.get("role"), str) or not isinstance(message.get("content"), str):
                raise InputError("each chat message needs a string 'role' and 'content'")
        if not any(m["content"].strip() for m in prompt):
            raise InputError("every chat message is empty")
        if not lm.has_chat_template:
            raise InputError(f"model {lm.name!r} has no chat template; pass a plain string prompt")
        text = tokenizer.apply_chat_template(list(prompt), tokenize=False, add_generation_prompt=True)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    elif isinstance(prompt, (Sequence, torch.Tensor)):
        ids = [int(t) for t in (prompt.flatten().tolist() if isinstance(prompt, torch.Tensor) else prompt)]
        vocab = len(tokenizer)
        bad = [t for t in ids if not 0 <= t < max(vocab, lm.vocab_size)]
        if bad:
            raise InputError(f"token ids out of the vocabulary: {bad[:5]}")
    else:
        raise InputError(f"a prompt is a string, a list of chat messages or token ids, not {type(prompt).__name__}")
    if not ids:
        raise InputError("the prompt is empty")
    return list(ids)


class Decoder:
    """A loaded model wrapped with one method; reusable across prompts."""

    @gc_paused()
    def __init__(
        self,
        lm: LoadedModel,
        method: str | Method | None = None,
        *,
        draft_model: LoadedModel | None = None,
        log: Callable[[str], None] | None = None,
        cost: ForwardCost | None = None,
        prefix_cache_tokens: int = 0,
    ) -> None:
        """`draft_model` gives an already loaded draft model to `draft` (instead of its model=NAME);
        `cost` a forward-cost curve already measured for this model (cost-aware methods measure
        one otherwise). Progress (loading a draft model, measuring forward cost) goes to `log`, by
        default the `leapdecode` logger; never to standard output. No `method`: the model's
        fastest lossless path (`methods.defaults`), said in the log. `prefix_cache_tokens`: keep
        up to that many tokens of finished generations' KV caches, so that a prompt that begins
        as an earlier prompt and its answer did (a chat's next turn) prefills only the rest, on a
        row-exact model (`engine.prefix_cache`; the same output); 0: none."""
        if prefix_cache_tokens < 0:
            raise InputError(f"prefix_cache_tokens must be >= 0 (0: no prefix cache), got {prefix_cache_tokens}")
        self.lm = lm
        if method is None:
            choice = default_method(lm)
            (log or logger.info)(f"method: {choice.method} ({choice.reason})")
            method = choice.method
        self.method = parse_method(method)
        if self.method.capabilities.peer:
            raise InputError(f"{self.method.name!r} is a benchmark peer (Hugging Face generate), not an engine method")
        self.backend = self.method.make_backend(lm)
        self.prefix_cache = PrefixCache(prefix_cache_tokens) if prefix_cache_tokens else None
        # the scheduler decides where kept caches are exact (a row-exact model); elsewhere it keeps none
        if self.prefix_cache is not None and BatchScheduler.alone(self.backend, self.prefix_cache).prefix_cache is None:
            # its prefills and decoding rows may differ in their last bits
            (log or logger.info)("prefix cache unused: the model is not row-exact here; prompts are prefilled whole")
        self._new_drafter = self.method.prepare(
            lm,
            draft_model=draft_model,
            log=log or logger.info,
            backend=self.backend,
            cost=cost,
        )

    @staticmethod
    def _verifiers(
        sampling: SamplingParams,
        noise: PositionNoise,
        logprobs: int | None,
        candidates: int = 0,
    ) -> tuple[Verifier, TreeVerifier]:
        """Greedy matching at temperature 0, else speculative sampling (exactly the target's
        distribution, from the request's per-position `noise`); each in its chain and its tree
        form. `candidates`: the top-k ids of every scored row that a recycling drafter asked for
        (greedy only)."""
        if sampling.greedy:
            if logprobs is None and not candidates:
                return verify_greedy, verify_tree_greedy
            return (
                functools.partial(verify_greedy, logprobs=logprobs, candidates=candidates),
                functools.partial(verify_tree_greedy, logprobs=logprobs, candidates=candidates),
            )
        return (
            functools.partial(verify_speculative, params=sampling, noise=noise, logprobs=logprobs),
            functools.partial(verify_tree_speculative, params=sampling, noise=noise, logprobs=logprobs),
        )

    def stream(
        self,
        prompt: Prompt,
        *,
        max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
        stop: Sequence[str] = (),
        chat: bool = False,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int | None = None,
        generator: torch.Generator | None = None,
        logprobs: int | None = None,
    ) -> StepStream:
        """The generation's steps, one `Step` per target forward pass, each as soon as its tokens
        are accepted (an iterator; `StepStream.prompt_ids` holds the encoded prompt).

        temperature 0 (the default) is greedy decoding; otherwise tokens are sampled with
        temperature / top_k / top_p as in Hugging Face `generate`. A `seed` gives the same text
        whatever the method drafted: every lossless method's sampled text equals plain sampling's
        with that seed, token for token (`leapdecode.engine.noise`). Without a seed, one is drawn
        from `generator`, else from torch's global generator (`torch.manual_seed` reproduces it).
        `logprobs=N` (0..20) records each emitted token's log-probability under the model's own
        distribution (raw logits, before temperature / top-k / top-p) with the N most likely
        tokens at its position (`Step.logprobs`); it changes no token.
        Bad arguments raise here, before the first step is asked for.
        """
        run = self.start(
            prompt,
            max_new_tokens=max_new_tokens,
            stop=stop,
            chat=chat,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            seed=seed,
            generator=generator,
            logprobs=logprobs,
        )
        return StepStream(run.prompt_ids, self._run(run))

    def start(self, prompt: Prompt, **options: Unpack[GenerationOptions]) -> SequenceRun:
        """The generation as a `SequenceRun` that has not run yet, for a batch scheduler
        (`leapdecode.engine.scheduler`) to drive with others; `stream` drives one alone. Takes
        `stream`'s options, checked here (`RequestSpec`)."""
        spec = RequestSpec.of(
            max_new_tokens=options.get("max_new_tokens", DEFAULT_MAX_NEW_TOKENS),
            stop=options.get("stop", ()),
            temperature=options.get("temperature", 0.0),
            top_k=options.get("top_k", 0),
            top_p=options.get("top_p", 1.0),
            seed=options.get("seed"),
            logprobs=options.get("logprobs"),
        )
        prompt_ids = encode_prompt(self.lm, prompt, chat=options.get("chat", False))
        return self.run_for(prompt_ids, spec, options.get("generator"))

    def run_for(
        self, prompt_ids: list[int], spec: RequestSpec, generator: torch.Generator | None = None
    ) -> SequenceRun:
        """`start` for a prompt already encoded and options already checked (the server's
        requests): the prompt and the budget are fitted to the model's context here."""
        spec.fit(self.lm, prompt_ids)
        sampling = spec.sampling
        criteria = StopCriteria(self.lm.eos_token_ids, spec.max_new_tokens, spec.stop, self.lm.tokenizer)
        # greedy draws nothing: no seed is taken from torch's global generator
        noise = PositionNoise(0) if sampling.greedy else PositionNoise.for_request(sampling.seed, generator)
        drafter = self._new_drafter(sampling, noise)
        verifier, tree_verifier = self._verifiers(sampling, noise, spec.logprobs, drafter.needs.candidates)
        return SequenceRun(prompt_ids, drafter, criteria, verifier, tree_verifier)

    def _run(self, run: SequenceRun) -> Iterator[Step]:
        with torch.inference_mode():
            yield from decode_run(self.backend, run, self.prefix_cache)

    def generate(self, prompt: Prompt, **options: Unpack[GenerationOptions]) -> GenerationResult:
        """Generate a completion: `stream`, collected. See `stream` for the options."""
        start = time.perf_counter()
        stream = self.stream(prompt, **options)
        steps = tuple(stream)
        elapsed = time.perf_counter() - start
        token_ids = [t for s in steps for t in s.tokens]
        return GenerationResult(
            text=truncate_at_stop(
                self.lm.tokenizer.decode(token_ids, skip_special_tokens=True), options.get("stop", ())
            ),
            token_ids=token_ids,
            prompt_ids=stream.prompt_ids,
            finish_reason=steps[-1].finish_reason or "length",
            stats=GenerationStats.from_steps(steps, elapsed),
            steps=steps,
            method=str(self.method),
            logprobs=None if options.get("logprobs") is None else tuple(lp for s in steps for lp in s.logprobs or ()),
        )


def wrap(lm: LoadedModel, method: str | Method | None = None, *, draft_model: LoadedModel | None = None) -> Decoder:
    """Wrap a loaded model with a method string such as `anpd:n=5,k=7`, `pld`, `ar` or
    `draft:model=qwen2.5-coder-0.5b,k=5` (or `draft:k=5` with an already loaded `draft_model`);
    none: the model's fastest lossless path (its preset's draft model where installed, else `anpd`)."""
    return Decoder(lm, method, draft_model=draft_model)


def generate(lm: LoadedModel, prompt: Prompt, method: str | Method | None = None, **kwargs: Any) -> GenerationResult:
    """One-shot convenience: `wrap(lm, method).generate(prompt, **kwargs)`."""
    return wrap(lm, method).generate(prompt, **kwargs)
