"""Peers: what a user would run instead, each through its own library on the same model and
prompts, timed and counted like this engine's methods (`methods.peers` holds their parameters)."""

from __future__ import annotations

import copy
import time
from collections.abc import Sequence
from typing import Any

import torch

from leapdecode.bench.memory import parameter_mb, weights_mb
from leapdecode.bench.timing import RunOutput, synchronize
from leapdecode.engine import GenerationStats, SamplingParams, StopCriteria
from leapdecode.errors import MethodError
from leapdecode.methods import (
    HfAssisted,
    HfGenerate,
    HfPromptLookup,
    LlamaCppPromptLookup,
    Method,
    check_same_vocabulary,
)
from leapdecode.models import LoadedModel


class HfRunner:
    """A peer: Hugging Face `generate`, greedy, with the same end-of-turn ids.

    Target forward passes are counted with a forward hook on the model (public API), so that
    tau is comparable with the engine's.
    """

    def __init__(
        self,
        lm: LoadedModel,
        method: Method,
        assistant: LoadedModel | None = None,
        label: str = "",
        sampling: SamplingParams = SamplingParams(),
    ) -> None:
        self.method = method
        self.lm = lm
        self.label = label or str(method)
        self.sampling = sampling
        if lm.backend != "torch":
            raise MethodError(
                f"{method.name} runs Hugging Face generate: give it the torch backend ({method.name}@torch)"
            )
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

    def run(self, prompt_ids: list[int], max_new_tokens: int, seed: int | None = None) -> RunOutput:
        """Greedy, or sampled as `sampling` says (HF's own sampler, seeded with `torch.manual_seed`:
        the same distribution as this engine's, other draws)."""
        model = self.lm.model
        ids = torch.tensor([prompt_ids], device=model.device)  # [1, T]
        sampled = self.sampling.temperature > 0
        decoding: dict[str, Any] = dict(do_sample=sampled)
        if sampled:
            decoding.update(temperature=self.sampling.temperature, top_k=self.sampling.top_k, top_p=self.sampling.top_p)
            torch.manual_seed(seed or 0)
        calls = [0]
        hook = model.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
        try:
            synchronize(model.device)
            start = time.perf_counter()
            with torch.inference_mode():
                out = model.generate(
                    ids,
                    attention_mask=torch.ones_like(ids),
                    max_new_tokens=max_new_tokens,
                    **decoding,
                    eos_token_id=sorted(self.lm.eos_token_ids),
                    pad_token_id=_pad_id(self.lm),
                    **self.kwargs,
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
            new_tokens=len(tokens),
            forward_passes=calls[0],
            drafted_tokens=0,
            accepted_tokens=0,
            wall_time_s=elapsed,
            accepted_lengths=(),
        )
        return RunOutput(tokens, stats)


class LlamaCppPeerRunner:
    """A peer: llama-cpp-python's own generator, greedy, on the same GGUF and thread count;
    with `llama-cpp-pld`, its prompt-lookup speculative decoding (`LlamaPromptLookupDecoding`).
    Forward passes are counted by a subclass that counts `eval` calls."""

    def __init__(
        self, lm: LoadedModel, method: Method, label: str = "", sampling: SamplingParams = SamplingParams()
    ) -> None:
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
        self.sampling = sampling
        draft = None
        if isinstance(method, LlamaCppPromptLookup):
            draft = LlamaPromptLookupDecoding(num_pred_tokens=method.tokens, max_ngram_size=method.max_ngram)
        model = lm.model
        # With a draft model, Llama keeps logits for every position but sizes that buffer from
        # logits_all: say it, or it overflows past n_batch tokens (llama-cpp-python 0.3.36).
        self.llm = CountingLlama(
            model_path=str(model.path),
            n_ctx=model.n_ctx,
            n_batch=model.n_batch,
            n_threads=model.n_threads,
            n_threads_batch=model.n_threads,
            draft_model=draft,
            logits_all=draft is not None,
            verbose=False,
        )
        self.weights_mb = weights_mb(lm)

    def run(self, prompt_ids: list[int], max_new_tokens: int, seed: int | None = None) -> RunOutput:
        """Greedy, or sampled with llama.cpp's own sampler seeded by `seed`."""
        llm = self.llm
        llm.reset()  # no prefix reuse from the previous prompt: every method starts cold
        llm.evals = 0
        tokens: list[int] = []
        sampling = self.sampling
        if sampling.temperature > 0:
            llm.set_seed(seed or 0)
            settings = dict(top_k=sampling.top_k, top_p=sampling.top_p, temp=sampling.temperature)
        else:
            settings = dict(top_k=1, top_p=1.0, temp=0.0)
        start = time.perf_counter()
        for token in llm.generate(prompt_ids, min_p=0.0, repeat_penalty=1.0, reset=True, **settings):
            tokens.append(int(token))
            if token in self.lm.eos_token_ids or len(tokens) >= max_new_tokens:
                break
        elapsed = time.perf_counter() - start
        stats = GenerationStats(
            new_tokens=len(tokens),
            forward_passes=llm.evals,
            drafted_tokens=0,
            accepted_tokens=0,
            wall_time_s=elapsed,
            accepted_lengths=(),
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
