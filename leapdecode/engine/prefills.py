"""The prompts a scheduler is prefilling in shared passes: their next chunks, and who follows whom.

A scheduler holds, in order of admission, each prompt being prefilled (`Prefill`: its cache so
far, how many of its tokens are in, and the requests following it: the same prompt wanting the
same states, which get copies of its cache once it is in). These are its rules, as functions over
that mapping.
"""

from __future__ import annotations

from collections.abc import Mapping

from leapdecode.engine.batch import BatchItem
from leapdecode.engine.cost import share_rows
from leapdecode.engine.loop import SequenceRun
from leapdecode.engine.submission import Prefill, Submission


def leader_of(prefilling: Mapping[Submission, Prefill], run: SequenceRun) -> Submission | None:
    """The request prefilling `run`'s prompt for the same states, which `run` can follow."""
    return next((s for s in prefilling if s.run.prompt_ids == run.prompt_ids and s.run.features == run.features), None)


def prompt_chunks(prefilling: Mapping[Submission, Prefill], rows: int) -> list[tuple[Submission, BatchItem]]:
    """The next chunk of each prompt being prefilled within `rows` (at least one: a prefilling
    request holds a batch slot, so fewer than `max_rows` requests decode), the rows shared fairly
    (`share_rows`): a short prompt behind a long one is in after a pass or two, not after the long
    one's whole prefill."""
    prefills = list(prefilling.items())
    left = [len(s.run.prompt_ids) - p.done for s, p in prefills]
    chunks = []
    for (submission, prefill), size in zip(prefills, share_rows(left, rows)):
        if size > 0:
            tokens = submission.run.prompt_ids[prefill.done : prefill.done + size]
            chunks.append((submission, BatchItem(prefill.seq, tokens, None, last_only=True)))
    return chunks


def hand_over(
    prefilling: Mapping[Submission, Prefill], submission: Submission
) -> tuple[dict[Submission, Prefill], Prefill | None]:
    """`submission` no longer waits on a prefill: a follower leaves its list; a prefilling request
    hands its prefill (cache so far) to its first follower, in its place, in the same order.
    Returns the prompts being prefilled after it, and the prefill no one goes on with (it had no
    follower), else None."""
    prefill = prefilling.get(submission)
    if prefill is None:
        for other in prefilling.values():
            if submission in other.followers:
                other.followers.remove(submission)
        return dict(prefilling), None
    heir = prefill.followers.pop(0) if prefill.followers else None
    after: dict[Submission, Prefill] = {}
    for leader, waiting in prefilling.items():
        if leader is not submission:
            after[leader] = waiting
        elif heir is not None:  # in its place
            after[heir] = waiting
    return after, prefill if heir is None else None
