"""Where a request's prompt starts, when its model keeps prefixes: the scheduler's side of
`engine.prefix_cache`.

A joining request starts from a copy of the longest prefix of its prompt that a kept cache or a
running request's cache holds, or waits for a prompt being prefilled that will hold enough more
(`plan_start`): a burst of requests with one long system prompt prefills it once. A request that
ends leaves its cache to be kept. Only requests whose every row is bitwise their own pass take
part (`Submission.keeps_prefix`, set by the scheduler), which is what makes a copy lossless.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence

from leapdecode.engine.cache import CacheState, snapshot_cache
from leapdecode.engine.prefix_cache import PrefixCache, RunningSource, plan_start
from leapdecode.engine.submission import Prefill, Submission

logger = logging.getLogger("leapdecode")


class PrefixReuse:
    """A scheduler's prefix cache, and the requests waiting on another's prefill."""

    def __init__(self, cache: PrefixCache, wait_tokens: int) -> None:
        """`wait_tokens`: a joining request waits for a prompt being prefilled only when that will
        give it at least this many more tokens than it can copy at once."""
        self.cache = cache
        self.wait_tokens = wait_tokens
        # requests waiting for another's prefill to pass the prompt tokens they share: (it, how many)
        self.awaiting: dict[Submission, tuple[Submission, int]] = {}

    def start(
        self,
        submission: Submission,
        running: Sequence[Submission],
        prefilling: Mapping[Submission, Prefill],
        fork: Callable[[CacheState, int], CacheState],
    ) -> Prefill | None:
        """A joining request's prefill from a copy of the longest prefix it can take now
        (`submission.cached_tokens` says how long); None where it takes none: it then waits for a
        prefill (in `awaiting`; `ready` hands it back) or prefills from an empty cache."""
        sources = running_sources(submission, running, prefilling)
        kept = self.cache.longest(submission.run.prompt_ids)
        start = plan_start(submission.run.prompt_ids, kept, [source for _, source in sources], self.wait_tokens)
        if start is None:
            return None
        if start.source is None:
            seq = self.kept_prefix(submission, fork)
            return Prefill(seq, done=submission.cached_tokens) if seq is not None else None
        leader, source = sources[start.source]
        if start.wait:
            self.awaiting[submission] = (leader, start.length)
            return None
        try:
            copy = fork(source.seq, start.length)
        except Exception:  # noqa: BLE001 - e.g. out of memory: this request prefills its whole prompt
            logger.exception("copying a running request's prefix failed; prefilling the whole prompt")
            return None
        submission.cached_tokens = start.length
        return Prefill(copy, done=start.length)

    def kept_prefix(self, submission: Submission, fork: Callable[[CacheState, int], CacheState]) -> CacheState | None:
        """A copy of the longest kept prefix of the request's prompt (its length in
        `cached_tokens`), or None: none is kept, or the copy failed (logged; the cache only ever
        saves work, so the prompt is then prefilled whole)."""
        try:
            taken = self.cache.take(submission.run.prompt_ids, fork)
        except Exception:  # noqa: BLE001 - e.g. out of memory: this request prefills its whole prompt
            logger.exception("copying a kept prefix failed; prefilling the whole prompt")
            return None
        if taken is None:
            return None
        submission.cached_tokens = taken.length  # the target's entries skip nothing
        return taken.seq

    def ready(self, prefilling: Mapping[Submission, Prefill]) -> list[Submission]:
        """The waiting requests whose prefill has passed the tokens they share, or has left (they
        start from what else there is); they wait no more."""
        done = []
        for submission, (leader, length) in list(self.awaiting.items()):
            prefill = prefilling.get(leader)
            if prefill is None or prefill.done >= length:
                del self.awaiting[submission]
                done.append(submission)
        return done

    def leave(self, submission: Submission, reason: str, prefill: Prefill | None = None) -> None:
        """A request ends: it waits no more, and its cache is kept (not after an error), as it
        stands between passes: the prompt and what it emitted but the pending token (or past a
        stop string, accepted tokens the text was cut before). One that leaves while its prompt
        is being prefilled (cancelled, timed out), with no request following its prefill
        (`prefill`), leaves the chunks prefilled so far: the requests waiting on it, and a client
        that sends the prompt again, start from them."""
        self.awaiting.pop(submission, None)
        run = submission.run
        if not submission.keeps_prefix or reason == "error":
            return
        if run.seq is not None:
            tokens, seq = [*run.prompt_ids, *run.generated], run.seq
        elif prefill is not None and prefill.done:
            tokens, seq = list(run.prompt_ids[: prefill.done]), prefill.seq
        else:
            return
        try:
            self.cache.keep(tokens, seq, snapshot_cache)
        except Exception:  # noqa: BLE001 - e.g. out of memory: the request ended well, its cache is not kept
            logger.exception("keeping a finished request's cache failed")


def running_sources(
    submission: Submission, running: Sequence[Submission], prefilling: Mapping[Submission, Prefill]
) -> list[tuple[Submission, RunningSource]]:
    """The running requests whose caches `submission` may start from: their tokens in order and
    how many their caches hold (a prompt being prefilled, fewer than it will)."""
    sources = []
    for other in running:
        if other is submission or other.alone or not other.keeps_prefix:
            continue
        prefill = prefilling.get(other)
        if prefill is not None:
            sources.append((other, RunningSource(tuple(other.run.prompt_ids), prefill.done, prefill.seq)))
        elif other.run.seq is not None:  # decoding: the prompt and what it emitted, but the pending token
            held = (*other.run.prompt_ids, *other.run.generated)[: other.run.seq.length]
            sources.append((other, RunningSource(held, len(held), other.run.seq)))  # all ready: never waited on
    return sources
