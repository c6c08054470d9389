"""Self-speculative drafting: the target drafts with a subset of its own layers.

Papers: Draft & Verify (Zhang et al. 2309.08168: skip a searched set of layers) and LayerSkip
(Elhoushi et al. 2404.16710: exit after the first E layers). Both are this drafter over a
`SelfDraftBackend` built with a different layer subset; the target verifies, so the output is
the target's own.

The drafter writes into the target's KV cache (`start` hands it the sequence), one token per
draft pass, and stops early once the draft's own top probability falls below `threshold`
(Draft & Verify's adaptive draft exiting): a doubtful token is likely rejected, and every
further draft pass would be wasted.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from leapdecode.drafters.base import StreamDrafter
from leapdecode.early_exit.backend import LayeredSequence, SelfDraftBackend
from leapdecode.engine.drafting import Draft, Request
from leapdecode.engine.noise import PositionNoise, Stream, choose
from leapdecode.engine.sampling import SamplingParams, logits_to_probs
from leapdecode.errors import MethodError


class SelfDrafter(StreamDrafter):
    """Drafts up to k tokens with the target's draft layers, sharing the target's cache."""

    def __init__(
        self,
        k: int = 4,
        threshold: float = 0.0,
        *,
        sampling: SamplingParams = SamplingParams(),
        noise: PositionNoise | None = None,
        coupled: bool = True,
    ) -> None:
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        self.k = k
        self.threshold = threshold
        self.sampling = sampling
        # coupled: each drafted token is chosen with the target's own uniform at its output
        # position (q stays out of the verdict); else with the draft's own noise, for min(1, p/q)
        self.coupled = coupled
        noise = noise if noise is not None else PositionNoise(0)
        self.noise = noise if coupled else noise.derived(Stream.DRAFT)
        self.emitted = 0
        self.backend: SelfDraftBackend | None = None
        self.seq: LayeredSequence | None = None
        self.pending = -1  # the last emitted token: the target has not cached it yet
        self.draft_passes = 0

    def start(self, request: Request) -> None:
        backend, seq = request.backend, request.seq
        if not isinstance(backend, SelfDraftBackend) or not isinstance(seq, LayeredSequence):
            raise MethodError("self-speculative drafting needs the target run by a SelfDraftBackend")
        self.backend, self.seq = backend, seq
        super().start(request)

    def reset(self, prompt_ids: Sequence[int]) -> None:
        self.pending = -1
        self.emitted = 0
        self.draft_passes = 0

    def propose(self, max_tokens: int) -> Draft:
        if self.backend is None or self.seq is None:
            raise RuntimeError("SelfDrafter.propose before start: the request's start hands it the target's sequence")
        drafted: list[int] = []
        q_rows: list[torch.Tensor] = []  # each [1, vocab]
        token = self.pending
        for _ in range(min(self.k, max_tokens)):
            logits = self.backend.draft(self.seq, [token])  # [1, vocab]
            self.draft_passes += 1
            if self.sampling.greedy:
                probs = logits.float().softmax(-1) if self.threshold > 0 else None
                token = int(logits[0].argmax())
            else:
                probs = logits_to_probs(logits, self.sampling)  # [1, vocab]
                token = int(choose(probs, self.noise.uniforms([self.emitted + len(drafted)], device=probs.device))[0])
                if not self.coupled:
                    q_rows.append(probs)
            drafted.append(token)
            if probs is not None and float(probs[0, token]) < self.threshold:
                break
        q = torch.cat(q_rows) if q_rows else None  # [D, vocab]
        return Draft(drafted, q)

    def update(self, tokens: Sequence[int], num_accepted: int) -> None:
        self.pending = int(tokens[-1])
        self.emitted += len(tokens)
