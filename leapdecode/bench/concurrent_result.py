"""One method's figures at one concurrency (`bench --concurrency`), engine rows and peers alike."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

SOLO = "solo"  # the concurrency label of one request at a time without the scheduler


@dataclass
class ConcurrentResult:
    """One method at one concurrency, over every prompt."""

    method: str
    concurrency: str  # "1", "2", ..., or SOLO
    requests: int
    new_tokens: int
    wall_s: float
    latencies_s: list[float] = field(default_factory=list)
    first_token_s: list[float] = field(default_factory=list)
    identical: int = 0  # requests whose tokens equal plain decoding's alone
    passes: int = 0
    rows: int = 0
    prompt_tokens: int = 0  # all requests' prompt tokens
    cached_tokens: int = 0  # of those, how many came from a kept or running request's cache, not a prefill
    outputs: list[list[int]] = field(default_factory=list, repr=False)  # each request's tokens, in prompt order
    peer: bool = False  # another program's rows (llama-server): its numerics differ, so `identical` is only counted
    round_rates: list[float] = field(default_factory=list)  # merged rounds: each round's tok/s, the spread

    @classmethod
    def over(
        cls, method: str, concurrency: str, prompts: Sequence[Sequence[int]], peer: bool = False
    ) -> ConcurrentResult:
        """An empty result for a run over `prompts` (their count and tokens), to be filled in."""
        return cls(method, concurrency, len(prompts), 0, 0.0, prompt_tokens=sum(map(len, prompts)), peer=peer)

    @classmethod
    def merged(cls, rounds: Sequence[ConcurrentResult]) -> ConcurrentResult:
        """One method at one concurrency over several rounds: every round's requests, tokens and
        seconds together (the aggregate rate is all tokens over all wall time; the percentiles
        over every request); the outputs are the first round's."""
        first = rounds[0]
        if any((r.method, r.concurrency) != (first.method, first.concurrency) for r in rounds):
            raise ValueError("only rounds of one method at one concurrency merge")
        return cls(
            first.method,
            first.concurrency,
            sum(r.requests for r in rounds),
            sum(r.new_tokens for r in rounds),
            sum(r.wall_s for r in rounds),
            [s for r in rounds for s in r.latencies_s],
            [s for r in rounds for s in r.first_token_s],
            sum(r.identical for r in rounds),
            sum(r.passes for r in rounds),
            sum(r.rows for r in rounds),
            sum(r.prompt_tokens for r in rounds),
            sum(r.cached_tokens for r in rounds),
            first.outputs,
            first.peer,
            [r.tokens_per_s for r in rounds],
        )

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.wall_s if self.wall_s else 0.0

    def percentile(self, values: Sequence[float], q: float) -> float:
        ordered = sorted(values)
        return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))] if ordered else 0.0

    def summary(self) -> dict[str, Any]:
        data = asdict(self)
        data.pop("latencies_s")
        data.pop("first_token_s")
        data.pop("outputs")
        data.pop("peer")
        data.update(
            tokens_per_s=self.tokens_per_s,
            latency_p50_s=self.percentile(self.latencies_s, 0.5),
            latency_p95_s=self.percentile(self.latencies_s, 0.95),
            first_token_p50_s=self.percentile(self.first_token_s, 0.5),
            rows_per_pass=self.rows / self.passes if self.passes else 0.0,
        )
        return data
