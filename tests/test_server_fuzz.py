"""Schemathesis over the app's own OpenAPI schema, bounded: bodies that fit the schema (with the
served model's name and a small token budget, so they reach decoding) and bodies that do not,
on every operation. No answer may be a server error, every error has an OpenAI-style body, and
every slot is free afterwards. In-process on the real small model."""

from __future__ import annotations

import time
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis.generation.modes import GenerationMode

MODEL = "smollm2-135m"
EXAMPLES = {GenerationMode.POSITIVE: 60, GenerationMode.NEGATIVE: 30}  # per operation


def reaching_decoding(body: Any) -> Any:
    """A generated body made to reach decoding where it fits the schema: the served model, a few
    tokens (a null budget too: unbounded, one request outlasts the test client's 10 s read), a
    couple of choices (the fields' shapes and every other value as generated)."""
    if not isinstance(body, dict):
        return body
    out = dict(body)
    out["model"] = MODEL
    for key in ("max_tokens", "max_completion_tokens"):
        if isinstance(out.get(key), int):
            out[key] = max(-2, min(out[key], 4))
    if not any(isinstance(out.get(key), int) for key in ("max_tokens", "max_completion_tokens")):
        out["max_tokens"] = 4  # absent or null: the server's default runs to the context's end
    if isinstance(out.get("n"), int):
        out["n"] = max(0, min(out["n"], 2))
    return out


@pytest.fixture(scope="module")
def app(real_lm):
    from leapdecode.server.app import ServerConfig, create_app

    return create_app(
        real_lm, ServerConfig(model_name=MODEL, default_method="anpd", max_queue=4, max_batch=2, timeout_s=60)
    )


@pytest.mark.parametrize("mode", list(EXAMPLES), ids=str)
def test_no_generated_request_gets_a_server_error(app, mode) -> None:
    schema = schemathesis.openapi.from_asgi("/openapi.json", app)
    answered: dict[tuple[str, int], int] = {}  # by (path, status)
    for result in schema.get_all_operations():
        fuzz_operation(result.ok(), mode, answered)
    refused = sum(n for (_, status), n in answered.items() if 400 <= status < 500)
    if mode is GenerationMode.POSITIVE:  # valid bodies reached decoding on both generation routes
        assert answered.get(("/v1/completions", 200)) and answered.get(("/v1/chat/completions", 200)), answered
    print(sorted(answered.items()))
    assert refused > 0, answered
    # a stream the client cut at its event limit leaves the batch at its next pass: every slot is
    # free within a pass or so (a leak never frees it)
    server = app.state.server
    deadline = time.monotonic() + 30
    while (server.admitted or server.running()) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert server.admitted == 0 and server.running() == 0


def fuzz_operation(operation, mode, answered: dict[tuple[str, int], int]) -> None:
    """Hypothesis over one operation's generated requests, counted in `answered` by (path, status)."""

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(
        max_examples=EXAMPLES[mode],
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    def call(case) -> None:
        if mode is GenerationMode.POSITIVE:
            case.body = reaching_decoding(case.body)
        response = case.call()
        key = (operation.path, response.status_code)
        answered[key] = answered.get(key, 0) + 1
        assert response.status_code < 500, (case.method, case.path, case.body, response.text[:500])
        if response.status_code >= 400:
            error = response.json()["error"]
            assert isinstance(error["message"], str) and error["message"] and "type" in error

    try:
        call()
    except Unsatisfiable:  # nothing of a GET can be made invalid (no body; any string is a model id)
        assert mode is GenerationMode.NEGATIVE and operation.method.upper() == "GET"
