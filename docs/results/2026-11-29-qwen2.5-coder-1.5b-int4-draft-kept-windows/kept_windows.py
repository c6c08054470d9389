"""What the draft model reads and spends per request after a long system prompt, with the caches
earlier requests kept (a windowed one kept with the tokens it skipped) and without any.

Usage: python kept_windows.py SYSTEM_FILE [LIMIT]. The chat prompts of Spec-Bench's multi-turn,
QA, math and translation categories (LIMIT of each, default 3), each after the system message in
SYSTEM_FILE (a later turn after the earlier turns and the target's plain answers), at most 64 new
tokens, greedy, alone, through one decoder (`draft:model=qwen2.5-coder-0.5b`, so both sides price
drafts by the same costs measured at load), twice in turn, which first alternating:
- kept: the draft model's prefix cache as the kept runs before left it;
- none: an empty one for the run (what it keeps is dropped after).
The draft model's passes are timed in place (every feed of a request alone is scored by
`engine.batch._alone`): the tokens it reads and the seconds its passes take. Both outputs must
equal plain decoding's.
"""

import sys
import time

import torch

import leapdecode
from leapdecode.bench.datasets import load_dataset, with_system
from leapdecode.bench.runner import encode_turns
from leapdecode.engine import batch

METHOD = "draft:model=qwen2.5-coder-0.5b"
NEW_TOKENS = 64
SIDES = ("kept", "none")


def timed(tally: list) -> None:
    """Add each draft-model feed's tokens and seconds to `tally`."""
    alone = batch._alone

    def timed_alone(backend, feed):
        start = time.perf_counter()
        try:
            return alone(backend, feed)
        finally:
            tally[0] += len(feed.tokens)
            tally[1] += time.perf_counter() - start

    batch._alone = timed_alone


def main() -> None:
    torch.set_num_threads(2)
    system = open(sys.argv[1], encoding="utf-8").read()
    limit = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    target = leapdecode.load_model("qwen2.5-coder-1.5b")
    plain = leapdecode.wrap(target, "ar")
    decoder = leapdecode.wrap(target, METHOD)
    kept = decoder.start([1, 2], max_new_tokens=1).drafter.prefix_cache  # the decoder's requests share it
    tally = [0, 0.0]  # the request running now: draft tokens read, seconds in draft passes
    timed(tally)
    spec = "spec-bench:multi-turn+spec-bench:qa+spec-bench:math_reasoning+spec-bench:translation"
    prompts = with_system(load_dataset(spec, limit), system)

    def answer(ids):
        return plain.generate(ids, max_new_tokens=NEW_TOKENS).token_ids

    def run(ids, side):
        saved = (kept.entries, kept.tokens)
        if side == "none":
            kept.entries, kept.tokens = [], 0
        tally[:] = [0, 0.0]
        try:
            result = decoder.generate(ids, max_new_tokens=NEW_TOKENS)
        finally:
            if side == "none":
                kept.entries, kept.tokens = saved
        return result, tally[0], tally[1]

    totals = {side: [0, 0.0, 0.0, 0, 0] for side in SIDES}  # read, draft s, request s, drafted, accepted
    print(
        f"{'prompt':<10} {'tokens':>6} "
        + " ".join(f"{side + ' read':>9} {'draft s':>7} {'s':>6} {'acc':>5}" for side in SIDES)
    )
    for index, prompt in enumerate(prompts):
        ids = encode_turns(target, prompt, answer)
        reference = answer(ids)
        cells = {}
        for side in SIDES if index % 2 == 0 else SIDES[::-1]:
            result, read, spent = run(ids, side)
            assert result.token_ids == reference, f"{side} differs from plain decoding on {prompt.id}"
            stats = result.stats
            cells[side] = (read, spent, stats.wall_time_s, stats.drafted_tokens, stats.accepted_tokens)
            for i, v in enumerate(cells[side]):
                totals[side][i] += v
        row = " ".join(f"{r:>9} {d:>7.2f} {s:>6.2f} {a:>2}/{n:<2}" for r, d, s, n, a in (cells[side] for side in SIDES))
        print(f"{prompt.id:<10} {len(ids):>6} {row}", flush=True)
    n = len(prompts)
    for side in SIDES:
        read, spent, seconds, drafted, accepted = totals[side]
        print(
            f"{side}: {read / n:.0f} draft tokens read a request, {spent / n:.2f} s in draft passes, "
            f"{seconds / n:.2f} s a request, {accepted}/{drafted} drafted tokens accepted"
        )


if __name__ == "__main__":
    main()
