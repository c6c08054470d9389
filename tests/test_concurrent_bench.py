"""`bench --concurrency`'s rounds: methods take turns at each concurrency, each cell's rounds merged."""

from __future__ import annotations

import dataclasses

import pytest

from leapdecode.bench.concurrent import concurrency_table, run_concurrency_bench
from leapdecode.bench.concurrent_result import SOLO, ConcurrentResult
from leapdecode.errors import InputError
from leapdecode.models.row_exact import use_row_exact
from tests.helpers import make_tiny_model, prompts, tiny_lm


@pytest.fixture(scope="module")
def exact_tiny():
    """A tiny model made row-exact, as the API loads it: shared passes need its kernels."""
    model = make_tiny_model("llama")
    use_row_exact(model)
    return dataclasses.replace(tiny_lm(model), row_exact=True)


def test_rounds_merge_their_requests_tokens_and_seconds() -> None:
    first = ConcurrentResult("ar", "4", 3, 30, 2.0, [1.0, 2.0, 3.0], [0.1] * 3, 3, 10, 20, 90, 0, [[1], [2], [3]])
    second = ConcurrentResult("ar", "4", 3, 36, 4.0, [4.0, 5.0, 6.0], [0.2] * 3, 3, 12, 30, 90, 45, [[1], [2], [3]])
    both = ConcurrentResult.merged([first, second])
    assert (both.requests, both.new_tokens, both.wall_s, both.identical) == (6, 66, 6.0, 6)
    assert (both.passes, both.rows, both.prompt_tokens, both.cached_tokens) == (22, 50, 180, 45)
    assert both.tokens_per_s == 11.0 and both.latencies_s == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    assert both.outputs == first.outputs and both.summary()["latency_p50_s"] == 3.0
    assert both.round_rates == [15.0, 9.0] and both.summary()["round_rates"] == [15.0, 9.0]
    assert "| ar | 4 | 11.0 (15.0, 9.0) |" in concurrency_table([both])
    with pytest.raises(ValueError, match="one method at one concurrency"):
        ConcurrentResult.merged([first, ConcurrentResult("ar", "2", 3, 30, 2.0)])


def test_methods_take_turns_at_each_concurrency_round_after_round(exact_tiny) -> None:
    said: list[str] = []
    ids = prompts(3, seed=5)
    results = run_concurrency_bench(exact_tiny, ["ar", "anpd"], ids, 6, [1, 2], rounds=2, log=said.append)
    turns = [line for line in said if line.startswith("round ")]
    assert turns == [
        "round 1/2, one at a time: ar",
        "round 1/2, one at a time: anpd",
        "round 1/2, 1 at once: anpd",
        "round 1/2, 1 at once: ar",
        "round 1/2, 2 at once: ar",
        "round 1/2, 2 at once: anpd",
        "round 2/2, one at a time: anpd",
        "round 2/2, one at a time: ar",
        "round 2/2, 1 at once: ar",
        "round 2/2, 1 at once: anpd",
        "round 2/2, 2 at once: anpd",
        "round 2/2, 2 at once: ar",
    ]
    assert [(r.method.split(":")[0], r.concurrency) for r in results] == [
        (m, c) for m in ("ar", "anpd") for c in (SOLO, "1", "2")
    ]
    assert all(r.requests == r.identical == 6 and r.new_tokens > 0 for r in results)


def test_rounds_below_one_are_refused_before_anything_runs(exact_tiny) -> None:
    said: list[str] = []
    with pytest.raises(InputError, match="rounds must be >= 1"):
        run_concurrency_bench(exact_tiny, ["ar"], prompts(1), 4, [1], rounds=0, log=said.append)
    assert said == []
