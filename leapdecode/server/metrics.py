"""The server's Prometheus metrics, and the one place it turns a request's steps into tau and alpha.

Labels are bounded: a request's `endpoint` is its route's template (`/v1/models/{model_id}`),
and every path no route serves is `other`, so no client can grow the series (routes x statuses)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from starlette.routing import Match, Route
from starlette.types import Scope

from leapdecode.engine import GenerationStats, Step

UNMATCHED = "other"  # the endpoint label of a path no route serves


def step_stats(steps: Sequence[Step]) -> GenerationStats:
    """Counts, tau and alpha of one request's steps, as the engine defines them (the server times
    requests itself, so no wall time)."""
    return GenerationStats.from_steps(steps, wall_time_s=0.0)


class Metrics:
    """Prometheus metrics in a registry of this app's own (no process-global state)."""

    def __init__(self) -> None:
        self.routes: tuple[Route, ...] = ()  # the app's routes, whose templates label requests (`create_app` sets them)
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "leapdecode_requests", "HTTP requests by endpoint and status", ["endpoint", "status"], registry=r
        )
        self.prompt_tokens = Counter("leapdecode_prompt_tokens", "Prompt tokens processed", registry=r)
        self.cached_prompt_tokens = Counter(
            "leapdecode_cached_prompt_tokens", "Prompt tokens a kept cache held (not prefilled)", registry=r
        )
        self.generated_tokens = Counter("leapdecode_generated_tokens", "Tokens generated", registry=r)
        self.forward_passes = Counter("leapdecode_forward_passes", "Target-model forward passes", registry=r)
        self.drafted_tokens = Counter("leapdecode_drafted_tokens", "Drafted tokens", registry=r)
        self.accepted_tokens = Counter("leapdecode_accepted_tokens", "Drafted tokens accepted", registry=r)
        self.tau = Gauge(
            "leapdecode_mean_accepted_tokens_per_pass", "Generated tokens / forward passes (tau)", registry=r
        )
        self.alpha = Gauge("leapdecode_draft_hit_ratio", "Accepted / drafted tokens (alpha)", registry=r)
        # both count generations (a request with n choices counts n), as --max-queue admits them
        self.queue_depth = Gauge(
            "leapdecode_queue_depth",
            "Generations admitted and not yet decoding (waiting for a batch slot or the worker)",
            registry=r,
        )
        self.running = Gauge(
            "leapdecode_running_requests", "Generations in the batch (prefilling or decoding)", registry=r
        )
        self.prefix_cache_tokens = Gauge(
            "leapdecode_prefix_cache_tokens", "Tokens of finished requests' caches kept (the prefix cache)", registry=r
        )
        self.latency = Histogram(
            "leapdecode_request_latency_seconds",
            "Request latency",
            ["endpoint"],
            registry=r,
            buckets=(0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64, 128, float("inf")),
        )
        self.first_token = Histogram(
            "leapdecode_time_to_first_token_seconds",
            "Time to first token (streaming)",
            registry=r,
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, float("inf")),
        )
        # shared passes (`--max-batch` above 1): how full each pass was, what it cost, how long requests waited
        self.batch_sequences = Histogram(
            "leapdecode_batch_sequences",
            "Requests with rows in a shared pass",
            registry=r,
            buckets=(1, 2, 3, 4, 6, 8, 12, 16, 24, 32, float("inf")),
        )
        self.pass_rows = Histogram(
            "leapdecode_pass_rows",
            "Tokens scored by a shared pass (pending, drafted and prompt tokens)",
            registry=r,
            buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, float("inf")),
        )
        self.pass_seconds = Histogram(
            "leapdecode_pass_seconds",
            "Seconds of a shared pass",
            registry=r,
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, float("inf")),
        )
        self.queue_time = Histogram(
            "leapdecode_queue_time_seconds",
            "Seconds from admission to joining the batch",
            registry=r,
            buckets=(0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, float("inf")),
        )
        self._total = step_stats(())  # every recorded request's counts, for the tau and alpha gauges

    def endpoint(self, scope: Scope) -> str:
        """The `endpoint` label of a request: the template of the route that serves its path
        (whatever its method), else `other`."""
        for route in self.routes:
            if route.matches(scope)[0] != Match.NONE:
                return route.path_format
        return UNMATCHED

    def record(self, prompt_tokens: int, steps: list[Step], cached_tokens: int = 0) -> None:
        """Count a finished request (`cached_tokens`: of its prompt, those the prefix cache held);
        tau and alpha are over every request recorded so far."""
        done = step_stats(steps)
        self.prompt_tokens.inc(prompt_tokens)
        self.cached_prompt_tokens.inc(cached_tokens)
        self.generated_tokens.inc(done.new_tokens)
        self.forward_passes.inc(done.forward_passes)
        self.drafted_tokens.inc(done.drafted_tokens)
        self.accepted_tokens.inc(done.accepted_tokens)
        total = self._total
        self._total = dataclasses.replace(
            total,
            new_tokens=total.new_tokens + done.new_tokens,
            forward_passes=total.forward_passes + done.forward_passes,
            drafted_tokens=total.drafted_tokens + done.drafted_tokens,
            accepted_tokens=total.accepted_tokens + done.accepted_tokens,
        )
        self.tau.set(self._total.tau)
        self.alpha.set(self._total.alpha)
