"""What the scheduler holds per request: a submitted request (`Submission`), a prompt being
prefilled in chunks (`Prefill`), and what one pass did (`PassReport`). Plain records: the
scheduler (`engine.scheduler`) owns every decision about them."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from leapdecode.engine.backend import Backend, CacheState
    from leapdecode.engine.loop import SequenceRun, Step


@dataclass(frozen=True)
class PassReport:
    """What one shared pass did."""

    sequences: int  # requests with rows in the pass
    rows: int  # tokens scored
    prefill_rows: int  # of which prompt tokens
    drafted: int  # of which drafted tokens
    emitted: int  # tokens the pass emitted, all requests together
    seconds: float


@dataclass(eq=False)
class Submission:
    """One request handed to the scheduler. `on_step` gets each step as it is accepted (on the
    scheduler's thread); `on_end` once, with the finish reason: "stop", "length", "cancelled",
    "timeout" or "error" (then `error` holds the exception)."""

    run: SequenceRun
    on_step: Callable[[Step], None]
    on_end: Callable[[str], None]
    timeout_s: float | None = None
    cancelled: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None
    submitted_at: float = field(default_factory=time.monotonic)
    started_at: float | None = None  # when it joined the batch (queue time ends, its prefill's time limit starts)
    decoding_at: float | None = (
        None  # when its prompt was in and its first token out (its decoding's time limit starts)
    )
    backend: Backend | None = None  # the backend its run was made for; None: the scheduler's
    alone: bool = field(default=False, init=False)  # runs in passes of its own (set by the scheduler at submit)
    keeps_prefix: bool = field(default=False, init=False)  # starts from and leaves a kept prefix (set at submit)
    cached_tokens: int = field(default=0, init=False)  # prompt tokens a kept cache held (`engine.prefix_cache`)

    def overdue(self, now: float) -> bool:
        """Past its time limit: its decoding counted from its first token, its prefill (which
        waits on other prompts' chunks too) from joining the batch, each on a limit of its own;
        time in the queue never counts."""
        if self.timeout_s is None or self.started_at is None:
            return False
        since = self.decoding_at if self.decoding_at is not None else self.started_at
        return now - since > self.timeout_s

    def cancel(self) -> None:
        """Leave at the next pass (a client that went away): its rows and cache are freed there."""
        self.cancelled.set()


@dataclass(eq=False)
class Prefill:
    """A prompt being prefilled in chunks, and the requests with the same prompt waiting for it."""

    seq: CacheState
    done: int = 0  # prompt tokens in the cache
    features: list[torch.Tensor] = field(default_factory=list)  # per chunk [n, F], when the drafter wants states
    followers: list[Submission] = field(default_factory=list)
