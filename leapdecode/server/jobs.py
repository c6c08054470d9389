"""One admitted request's generation: what the route asked for, and how it ended.

A request with `n` choices is `n` jobs (`Job.siblings`) sharing one cancel event: a choice that
fails, times out or loses its client ends the others at the next pass.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from leapdecode.api import Decoder
from leapdecode.engine.backend import Backend
from leapdecode.engine.loop import SequenceRun
from leapdecode.methods import Method
from leapdecode.request import RequestSpec


@dataclass
class Job:
    """One choice of an admitted request, run by the scheduler (`server.batching`).

    Its decoder is built (cached per canonical method string) when it is submitted; its prefill
    has a time limit of its own from when it joins the batch (waiting in the queue does not
    count), and its decoding one from its first token (`engine.submission.Submission.overdue`)."""

    method: Method
    decoder_for: Callable[[Method], Decoder]
    prompt_ids: list[int]
    spec: RequestSpec  # its options and limits, checked when the route made it
    timeout_s: float
    cancel: threading.Event = field(default_factory=threading.Event)
    finish_reason: str = "length"
    timed_out: bool = False
    method_name: str = ""
    cached_tokens: int = 0  # prompt tokens a kept cache held (not prefilled)

    def siblings(self, n: int) -> list[Job]:
        """This job as `n` choices sharing one cancel: choice i samples with seed + i (choice 0
        is the n=1 response; without a seed each draws its own), greedy choices are equal."""
        seed = self.spec.sampling.seed
        seeds = [None if seed is None else (seed + i + 2**63) % 2**64 - 2**63 for i in range(n)]  # wrapped to int64
        return [self if i == 0 else self._seeded(s) for i, s in enumerate(seeds)]

    def _seeded(self, seed: int | None) -> Job:
        """This job with another seed (a sibling choice)."""
        sampling = dataclasses.replace(self.spec.sampling, seed=seed)
        return dataclasses.replace(self, spec=dataclasses.replace(self.spec, sampling=sampling))

    def start(self) -> tuple[SequenceRun, Backend]:
        """The generation as a run, and the backend it was made for (a method that runs the
        target's layers its own way has its own: it does not share passes); raises on bad input."""
        decoder = self.decoder_for(self.method)
        self.method_name = str(decoder.method)
        return decoder.run_for(self.prompt_ids, self.spec), decoder.backend

    def ended(self, reason: str, cached_tokens: int = 0) -> None:
        """Record how the generation ended (the scheduler's reason) and how much of its prompt
        came from the prefix cache."""
        if reason in ("stop", "length", "cancelled"):
            self.finish_reason = reason
        self.timed_out = reason == "timeout"
        self.cached_tokens = cached_tokens
