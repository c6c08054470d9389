"""A request alone: the scheduler with a batch of one, a step per pass.

`decode` is the decode loop as a generator, for the library and the tests; there is no other
loop: the scheduler's pass for one request is the decode loop's step (`BatchScheduler`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

from leapdecode.engine.loop import SequenceRun, Step
from leapdecode.engine.scheduler import BatchScheduler
from leapdecode.engine.submission import Submission

if TYPE_CHECKING:
    from leapdecode.engine.backend import Backend
    from leapdecode.engine.drafting import Drafter
    from leapdecode.engine.loop import TreeVerifier, Verifier
    from leapdecode.engine.prefix_cache import PrefixCache
    from leapdecode.engine.stopping import StopCriteria


def decode(
    backend: Backend,
    prompt_ids: Sequence[int],
    drafter: Drafter,
    stop: StopCriteria,
    verifier: Verifier,
    tree_verifier: TreeVerifier,
) -> Iterator[Step]:
    """Generate after `prompt_ids`, yielding one `Step` per target forward pass."""
    return decode_run(backend, SequenceRun(prompt_ids, drafter, stop, verifier, tree_verifier))


def decode_run(backend: Backend, run: SequenceRun, prefix_cache: PrefixCache | None = None) -> Iterator[Step]:
    """Drive one `SequenceRun` alone: the scheduler with a batch of one, a step per pass, each
    step yielded as its pass ends; an error in the request is raised here. `prefix_cache`: where
    it starts from a kept prefix of its prompt and leaves its cache (see `BatchScheduler`)."""
    scheduler = BatchScheduler.alone(backend, prefix_cache)
    steps: list[Step] = []
    ended: list[str] = []
    submission = scheduler.submit(Submission(run, steps.append, ended.append))
    while not ended:
        scheduler.step()
        yield from steps
        steps.clear()
    if submission.error is not None:
        raise submission.error
