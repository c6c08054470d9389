"""Whether the draft model runs, when the costs measured at load are wrong: live costs against
the costs as measured, each with a clean measurement and with one caught in a burst of other load.

Usage: python live_costs.py [LIMIT] [NEW_TOKENS]. The chat prompts of Spec-Bench's multi-turn,
QA, math and translation categories (LIMIT of each, default 3), greedy, alone, 2 threads, at
most NEW_TOKENS new tokens (default 64). Four decoders of `draft:model=qwen2.5-coder-0.5b`, all
over one loaded target (so all share its cost curve, measured once, on a quiet machine):
- clean live / clean fixed: the draft model's costs measured on a quiet machine, with live
  costs (the default) and with `live_cost=false`;
- burst live / burst fixed: the same, their draft model's costs measured while another process
  spins on one of the two cores (what a measurement at load meets when something else runs for a
  few seconds), then run on the quiet machine.
Each prompt runs on every decoder in turn (the order rotating), after plain decoding's reference;
every output must equal plain decoding's.
"""

import subprocess
import sys

import torch

import leapdecode
from leapdecode.bench.datasets import load_dataset
from leapdecode.bench.runner import encode_turns
from leapdecode.engine.cost import scale_of

METHOD = "draft:model=qwen2.5-coder-0.5b"
SIDES = ("clean live", "clean fixed", "burst live", "burst fixed")


def costs(decoder) -> str:
    """The decoder's draft pricing: a draft pass and a target pass now, and their live scales."""
    cost = decoder.start([1, 2], max_new_tokens=1).drafter.cost
    return (
        f"draft pass {1000 * cost.draft.of(1):.1f} ms (x{scale_of(cost.draft):.2f}), "
        f"target pass {1000 * cost.target.of(1):.1f} ms (x{scale_of(cost.target):.2f}), "
        f"prefill {1000 * cost.catch_up:.2f} ms a token"
    )


def main() -> None:
    torch.set_num_threads(2)
    limit = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    new_tokens = int(sys.argv[2]) if len(sys.argv) > 2 else 64
    target = leapdecode.load_model("qwen2.5-coder-1.5b")
    plain = leapdecode.wrap(target, "ar")
    decoders = {
        "clean live": leapdecode.wrap(target, METHOD),
        "clean fixed": leapdecode.wrap(target, METHOD + ",live_cost=false"),
    }
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        decoders["burst live"] = leapdecode.wrap(target, METHOD)
        decoders["burst fixed"] = leapdecode.wrap(target, METHOD + ",live_cost=false")
    finally:
        spinner.kill()
        spinner.wait()
    for side in SIDES:
        print(f"{side:<12} at load: {costs(decoders[side])}")
    spec = "spec-bench:multi-turn+spec-bench:qa+spec-bench:math_reasoning+spec-bench:translation"
    prompts = load_dataset(spec, limit)

    def answer(ids):
        return plain.generate(ids, max_new_tokens=new_tokens)

    totals = {side: [0.0, 0, 0, 0, 0] for side in (*SIDES, "plain")}  # s, tokens, passes, drafted, accepted
    print(f"{'prompt':<10} {'plain s':>7} " + " ".join(f"{side + ' s':>13} {'acc':>7}" for side in SIDES))
    for index, prompt in enumerate(prompts):
        ids = encode_turns(target, prompt, lambda ids: answer(ids).token_ids)
        reference = answer(ids)
        stats = reference.stats
        totals["plain"][0] += stats.wall_time_s
        totals["plain"][1] += len(reference.token_ids)
        cells = {}
        order = SIDES[index % len(SIDES) :] + SIDES[: index % len(SIDES)]
        for side in order:
            result = decoders[side].generate(ids, max_new_tokens=new_tokens)
            assert result.token_ids == reference.token_ids, f"{side} differs from plain decoding on {prompt.id}"
            s = result.stats
            cells[side] = (s.wall_time_s, s.drafted_tokens, s.accepted_tokens)
            for i, v in enumerate(
                (s.wall_time_s, len(result.token_ids), s.forward_passes, s.drafted_tokens, s.accepted_tokens)
            ):
                totals[side][i] += v
        row = " ".join(f"{t:>13.2f} {a:>3}/{d:<3}" for t, d, a in (cells[side] for side in SIDES))
        print(f"{prompt.id:<10} {stats.wall_time_s:>7.2f} {row}", flush=True)
    plain_s = totals["plain"][0]
    for side in SIDES:
        seconds, tokens, passes, drafted, accepted = totals[side]
        print(
            f"{side:<12} {plain_s / seconds:.2f}x plain ({tokens / seconds:.1f} tok/s), tau {tokens / passes:.2f}, "
            f"{accepted}/{drafted} drafted tokens accepted; now: {costs(decoders[side])}"
        )
    print(f"plain        {totals['plain'][1] / plain_s:.1f} tok/s")


if __name__ == "__main__":
    main()
