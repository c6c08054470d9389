"""The OpenAI-compatible server, started for real on a loopback port with `smollm2-135m`."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from openai import OpenAI

from leapdecode import wrap
from leapdecode.server.loadtest import run_load

MODEL = "smollm2-135m"
pytestmark = pytest.mark.real_model  # every test here serves the real small model


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(*options: str):
    """`leapdecode serve` on a free loopback port with `options`, once /health answers: (url, process)."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "leapdecode", "serve", "--model", MODEL, "--port", str(port), *options],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 180
    while time.time() < deadline:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return url, proc
        except httpx.HTTPError:
            time.sleep(0.5)
        assert proc.poll() is None, proc.stdout.read()
    proc.kill()
    pytest.fail("the server did not start")


@pytest.fixture(scope="module")
def server():
    url, proc = start_server(
        "--max-queue",
        "4",
        "--timeout",
        "60",
        "--max-batch",
        "4",
        "--body-timeout",
        "3",
        "--max-connections",
        "48",
        "--prefix-cache-tokens",  # bounded: it fills as requests end, well below a leak test's allowance
        "1024",
    )
    yield url, proc
    proc.terminate()
    proc.wait(timeout=30)


@pytest.fixture(scope="module")
def client(server):
    return OpenAI(base_url=server[0] + "/v1", api_key="not-needed", max_retries=0)


def still_serving(url: str) -> None:
    resp = httpx.post(
        url + "/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2, "temperature": 0}, timeout=60
    )
    assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] >= 1


def test_models_and_health(server, client) -> None:
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(server[0] + "/health").json()["status"] == "ok"


def test_completion_equals_the_library_greedy_output(client, real_lm) -> None:
    prompt = "def fibonacci(n):\n"
    resp = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0)
    expected = wrap(real_lm, "anpd").generate(prompt, max_new_tokens=24)
    assert resp.choices[0].text == expected.text
    assert resp.usage.completion_tokens == len(expected.token_ids)
    assert resp.usage.prompt_tokens == len(expected.prompt_ids)
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens
    assert resp.choices[0].finish_reason == "length"


def test_logprobs_are_the_library_ones_in_both_apis_streamed_or_not(client, real_lm) -> None:
    prompt = "def fibonacci(n):\n"
    expected = wrap(real_lm, "anpd").generate(prompt, max_new_tokens=16, logprobs=2)
    want = [r.logprob for r in expected.logprobs]
    resp = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0, logprobs=2)
    got = resp.choices[0].logprobs
    assert got.token_logprobs == pytest.approx(want, abs=1e-4)
    assert "".join(got.tokens) == resp.choices[0].text == expected.text
    assert got.text_offset == [sum(len(t) for t in got.tokens[:i]) for i in range(len(got.tokens))]
    assert all(
        len(top) <= 2 and max(top.values()) == pytest.approx(lp, abs=1e-4) for top, lp in zip(got.top_logprobs, want)
    )

    messages = [{"role": "user", "content": "Name three colours."}]
    chat = wrap(real_lm, "anpd").generate(messages, max_new_tokens=12, logprobs=3)
    whole = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=12, temperature=0, logprobs=True, top_logprobs=3
    )
    content = whole.choices[0].logprobs.content
    assert [c.logprob for c in content] == pytest.approx([r.logprob for r in chat.logprobs], abs=1e-4)
    assert all(len(c.top_logprobs) == 3 and c.bytes == list(c.token.encode()) for c in content)
    streamed = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=12, temperature=0, logprobs=True, stream=True
    )
    pieces = [c for chunk in streamed for choice in chunk.choices if choice.logprobs for c in choice.logprobs.content]
    assert [c.logprob for c in pieces] == pytest.approx([c.logprob for c in content], abs=1e-6)
    assert all(c.top_logprobs == [] for c in pieces)
    plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0)
    assert plain.choices[0].logprobs is None and plain.choices[0].message.content == whole.choices[0].message.content


def test_a_chats_next_turn_starts_from_the_kept_cache_and_equals_the_library(server, client, real_lm) -> None:
    first = [
        {"role": "system", "content": "You answer in one short line."},
        {"role": "user", "content": "Name a prime number."},
    ]
    answer = client.chat.completions.create(model=MODEL, messages=first, max_tokens=16, temperature=0)
    second = [
        *first,
        {"role": "assistant", "content": answer.choices[0].message.content},
        {"role": "user", "content": "And one more?"},
    ]
    expected = wrap(real_lm, "anpd").generate(second, max_new_tokens=16)
    resp = client.chat.completions.create(model=MODEL, messages=second, max_tokens=16, temperature=0)
    cached = resp.usage.prompt_tokens_details.cached_tokens
    assert answer.usage.prompt_tokens <= cached < resp.usage.prompt_tokens == len(expected.prompt_ids)
    assert resp.choices[0].message.content == expected.text
    streamed = client.chat.completions.create(
        model=MODEL, messages=second, max_tokens=16, temperature=0, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(streamed)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected.text
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == resp.usage.prompt_tokens - 1  # all but the last
    counted = [
        float(line.split()[-1])
        for line in httpx.get(server[0] + "/metrics").text.splitlines()
        if line.startswith("leapdecode_cached_prompt_tokens_total")
    ]
    assert counted and counted[0] >= cached + resp.usage.prompt_tokens - 1


def test_chat_streaming_and_not_agree_with_the_library(client, real_lm) -> None:
    messages = [{"role": "user", "content": "Name three colours."}]
    expected = wrap(real_lm, "anpd").generate(messages, max_new_tokens=40)
    resp = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=40, temperature=0)
    assert resp.choices[0].message.content == expected.text
    assert resp.choices[0].finish_reason == ("stop" if expected.finish_reason == "stop" else "length")
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=40,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected.text
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].usage.completion_tokens == len(expected.token_ids)


def test_stop_strings_over_the_api(client, real_lm) -> None:
    prompt = "def fibonacci(n):\n"
    expected = wrap(real_lm, "anpd").generate(prompt, max_new_tokens=40, stop=["return"])
    resp = client.completions.create(model=MODEL, prompt=prompt, max_tokens=40, temperature=0, stop=["return"])
    assert resp.choices[0].text == expected.text and resp.choices[0].finish_reason == "stop"
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=40, temperature=0, stop=["return"], stream=True
        )
    )
    assert streamed == expected.text and "return" not in streamed


def test_per_request_method_and_seeded_sampling(client) -> None:
    messages = [{"role": "user", "content": "Write a limerick about a cat."}]
    a = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=16, temperature=0, extra_body={"leapdecode": {"method": "pld:k=4"}}
    )
    b = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=16, temperature=0, extra_body={"leapdecode": {"method": "ar"}}
    )
    assert a.model_extra["leapdecode"]["method"] == "pld:k=4,max_ngram=3,min_ngram=1"
    assert b.model_extra["leapdecode"]["method"] == "ar"
    assert a.choices[0].message.content == b.choices[0].message.content
    s1 = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0.9, seed=7)
    s2 = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0.9, seed=7)
    assert s1.choices[0].message.content == s2.choices[0].message.content
    # a seed gives the same text whatever the method drafted: plain sampling's
    for method in ("ar", "suffix", "anpd-tree"):
        s3 = client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=16,
            temperature=0.9,
            seed=7,
            extra_body={"leapdecode": {"method": method}},
        )
        assert s3.choices[0].message.content == s1.choices[0].message.content, method


@pytest.mark.parametrize(
    "path, body, status, fragment",
    [
        ("/v1/completions", b"{not json", 400, "not valid JSON"),
        ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
        ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": -3}, 400, "max_tokens"),
        ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 100000}, 400, "exceeds the context"),
        ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": "many"}, 400, "max_tokens"),
        ("/v1/completions", {"model": MODEL, "prompt": "", "max_tokens": 4}, 400, "prompt is empty"),
        ("/v1/completions", {"model": MODEL, "prompt": "hi", "temperature": "hot"}, 400, "temperature"),
        ("/v1/completions", {"model": MODEL, "prompt": "hi", "n": 0}, 400, "n"),
        ("/v1/completions", {"model": MODEL, "prompt": "hi", "n": 129}, 400, "n"),
        ("/v1/completions", {"model": MODEL, "prompt": "hi", "n": 5}, 400, "--max-queue"),
        ("/v1/completions", {"model": "gpt-9", "prompt": "hi"}, 404, "does not exist"),
        ("/v1/completions", {"prompt": "hi"}, 400, "model"),
        ("/v1/chat/completions", {"model": MODEL, "messages": []}, 400, "messages"),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": ""}]}, 400, "empty"),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "wizard", "content": "hi"}]}, 400, "role"),
        (
            "/v1/chat/completions",
            {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "leapdecode": {"method": "warp"}},
            400,
            "unknown method",
        ),
        (
            "/v1/chat/completions",
            {
                "model": MODEL,
                "messages": [{"role": "user", "content": "hi"}],
                "leapdecode": {"method": "draft:model=/etc"},
            },
            400,
            "when the server starts",
        ),
        (
            "/v1/chat/completions",
            {
                "model": MODEL,
                "messages": [{"role": "user", "content": "hi"}],
                "leapdecode": {"method": "rest:datastore=/etc"},
            },
            400,
            "when the server starts",
        ),
        (
            "/v1/chat/completions",
            {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stop": ["a", "b", "c", "d", "e"]},
            400,
            "stop",
        ),
        # the hardening issue's requests, exactly
        ("/v1/completions", {"model": MODEL, "prompt": "Hi \ud800 there", "max_tokens": 4}, 400, "invalid Unicode"),
        ("/v1/completions", {"model": "\ud800", "prompt": "hi", "max_tokens": 4}, 400, "invalid Unicode"),
        (
            "/v1/completions",
            {"model": MODEL, "prompt": "hi", "max_tokens": 4, "seed": 18446744073709551616},
            400,
            "seed",
        ),
        (
            "/v1/completions",
            {"model": MODEL, "prompt": "hi", "max_tokens": 4, "stream": True, "seed": 18446744073709551616},
            400,
            "seed",
        ),
        (
            "/v1/completions",
            {"model": MODEL, "prompt": "Hi \ud800", "max_tokens": 4, "stream": True},
            400,
            "invalid Unicode",
        ),
        ("/v1/completions", {"model": MODEL, "prompt": "hi", "temperature": "0"}, 400, "temperature"),
        ("/v1/completions", {"model": MODEL, "prompt": "hi", "echo": True}, 400, "echo"),
        ("/v1/completions", {"model": MODEL, "prompt": "hi", "logprobs": 21}, 400, "logprobs"),
        ("/v1/completions", {"model": MODEL, "prompt": "hi", "logprobs": True}, 400, "logprobs"),
        (
            "/v1/chat/completions",
            {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "top_logprobs": 3},
            400,
            "top_logprobs requires",
        ),
        (
            "/v1/chat/completions",
            {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": -1},
            400,
            "top_logprobs",
        ),
        (
            "/v1/chat/completions",
            {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "logit_bias": {"5": 10}},
            400,
            "logit_bias",
        ),
        (
            "/v1/chat/completions",
            {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]},
            400,
            "tools",
        ),
        (
            "/v1/chat/completions",
            {
                "model": MODEL,
                "messages": [{"role": "user", "content": "hi"}],
                "response_format": {"type": "json_object"},
            },
            400,
            "response_format",
        ),
        (
            "/v1/chat/completions",
            {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "frequency_penalty": 0.5},
            400,
            "frequency_penalty",
        ),
        (
            "/v1/chat/completions",
            {
                "model": MODEL,
                "messages": [{"role": "user", "content": "hi"}],
                "leapdecode": {"method": "pld:k=1000000000"},
            },
            400,
            "k must be",
        ),
        (
            "/v1/chat/completions",
            {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "leapdecode": {"method": "calm"}},
            400,
            "not allowed",
        ),
        # parses, but building its decoder for this model fails: refused without holding a slot
        (
            "/v1/chat/completions",
            {
                "model": MODEL,
                "messages": [{"role": "user", "content": "hi"}],
                "leapdecode": {"method": "layerskip:exit=99"},
            },
            400,
            "exit must be below",
        ),
        (
            "/v1/chat/completions",
            {"model": MODEL, "messages": [{"role": "user", "content": "word " * 9000}]},
            400,
            "too long",
        ),
    ],
)
def test_bad_input_gets_an_openai_style_4xx_and_the_server_keeps_serving(server, path, body, status, fragment) -> None:
    url = server[0]
    # json.dumps escapes non-ASCII, so lone surrogates travel as the \\ud800 escapes a client sends
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    resp = httpx.post(url + path, timeout=60, content=content, headers={"content-type": "application/json"})
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert fragment in error["message"] or fragment in str(error.get("param"))
    assert set(error) == {"message", "type", "param", "code"}
    still_serving(url)
    assert httpx.get(url + "/health").json()["admitted"] == 0  # a refused request holds no slot


def test_cost_aware_per_request_uses_the_curve_measured_at_start(server) -> None:
    """`pld:k=48,cost_aware=true` once measured forward cost on the event loop, per raw string."""
    url = server[0]
    for method in ("pld:k=48,cost_aware=true", "PLD : k=48 , cost_aware=true "):
        body = {
            "model": MODEL,
            "prompt": "def f(x):",
            "max_tokens": 24,
            "temperature": 0,
            "leapdecode": {"method": method},
        }
        answers: list[httpx.Response] = []
        request = threading.Thread(
            target=lambda answers=answers, body=body: answers.append(
                httpx.post(url + "/v1/completions", json=body, timeout=60)
            )
        )
        request.start()
        assert httpx.get(url + "/health", timeout=30).status_code == 200  # while the request is handled
        request.join()
        assert answers[0].status_code == 200, answers[0].text
        assert answers[0].json()["leapdecode"]["method"] == "pld:k=48,max_ngram=3,min_ngram=1,cost_aware=True"


@pytest.mark.parametrize(
    "method, path, status", [("GET", "/nope", 404), ("GET", "/v1/completions", 405), ("GET", "/v1/models/gpt-9", 404)]
)
def test_unknown_routes_get_openai_error_bodies(server, method, path, status) -> None:
    resp = httpx.request(method, server[0] + path, timeout=10)
    assert resp.status_code == status and set(resp.json()["error"]) == {"message", "type", "param", "code"}


def test_model_card(server) -> None:
    resp = httpx.get(server[0] + f"/v1/models/{MODEL}", timeout=10)
    assert resp.status_code == 200 and resp.json()["id"] == MODEL


def test_oversized_body_gets_413(server) -> None:
    resp = httpx.post(server[0] + "/v1/completions", json={"model": MODEL, "prompt": "x" * (5 << 20)}, timeout=60)
    assert resp.status_code == 413 and "limit" in resp.json()["error"]["message"]
    still_serving(server[0])


def test_an_abandoned_non_streaming_request_stops_decoding(server) -> None:
    """A client that gives up on a long non-streaming request frees its slot at once, not when
    its generation would have ended (minutes here)."""
    url = server[0]
    body = {
        "model": MODEL,
        "prompt": "Count from one to one thousand:",
        "max_tokens": 3000,
        "temperature": 0,
        "leapdecode": {"method": "ar"},
    }
    outcome: list[BaseException] = []

    def abandon() -> None:
        try:
            httpx.post(url + "/v1/completions", json=body, timeout=6.0)
        except httpx.TimeoutException as exc:
            outcome.append(exc)

    client = threading.Thread(target=abandon)
    client.start()
    admitted, deadline = 0, time.time() + 5
    while admitted != 1 and time.time() < deadline:  # /health answers while the request decodes
        admitted = httpx.get(url + "/health", timeout=30).json()["admitted"]
        time.sleep(0.1)
    assert admitted == 1
    client.join()
    assert outcome, "the long request should have outlasted the client's timeout"
    deadline = time.time() + 10
    while httpx.get(url + "/health").json()["admitted"] and time.time() < deadline:
        time.sleep(0.2)
    assert httpx.get(url + "/health").json()["admitted"] == 0
    still_serving(url)


def test_a_prompt_abandoned_early_leaves_its_cache_for_the_same_prompt_sent_again(server, real_lm) -> None:
    """A client that gives up on a long prompt soon after sending it (mid-prefill, or just after)
    leaves what the server computed of it in the prefix cache: the same prompt sent again starts
    from it and gets the library's own text; /health answers while the first is handled."""
    url = server[0]
    lines = [f"Entry {i}: the lighthouse keeper logged the wind as {i % 7} knots from the west." for i in range(30)]
    prompt = "Quartermaster's ledger.\n" + "\n".join(lines) + "\nSummary:"
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0, "leapdecode": {"method": "ar"}}
    abandoned: list[BaseException] = []

    def abandon() -> None:
        try:
            httpx.post(url + "/v1/completions", json={**body, "max_tokens": 2000}, timeout=1.5)
        except httpx.TimeoutException as exc:
            abandoned.append(exc)

    client = threading.Thread(target=abandon)
    client.start()
    time.sleep(0.1)
    assert httpx.get(url + "/health", timeout=30).status_code == 200  # while the request is handled
    client.join()
    assert abandoned, "the client should have given up before the answer"
    deadline = time.time() + 20
    while httpx.get(url + "/health").json()["admitted"]:
        assert time.time() < deadline, "the abandoned request still holds its slot"
        time.sleep(0.1)
    resp = httpx.post(url + "/v1/completions", json=body, timeout=60).json()
    expected = wrap(real_lm, "ar").generate(prompt, max_new_tokens=8)
    assert resp["choices"][0]["text"] == expected.text
    assert 100 <= resp["usage"]["prompt_tokens_details"]["cached_tokens"] < resp["usage"]["prompt_tokens"]


def test_api_key_and_allowed_hosts(real_lm) -> None:
    from fastapi.testclient import TestClient

    from leapdecode.server.app import ServerConfig, create_app

    config = ServerConfig(model_name=MODEL, default_method="ar", api_key="sekrit", allowed_hosts=("localhost",))
    with TestClient(create_app(real_lm, config), base_url="http://localhost") as client:
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
        assert client.post("/v1/completions", json=body).status_code == 401
        assert client.post("/v1/completions", json=body, headers={"Authorization": "Bearer wrong"}).status_code == 401
        ok = client.post("/v1/completions", json=body, headers={"Authorization": "Bearer sekrit"})
        assert ok.status_code == 200, ok.text
        assert client.get("/health").status_code == 200  # health needs no key
        rebound = client.get("/health", headers={"Host": "evil.example"})
        assert rebound.status_code == 400 and rebound.json()["error"]["code"] == "invalid_host"


def test_concurrent_requests_share_passes_and_each_gets_its_own_output(server, client, real_lm) -> None:
    prompts = ["def fibonacci(n):", "The three primary colours are", "import os\nimport sys\n", "Once upon a time"]
    expected = [wrap(real_lm, "anpd").generate(p, max_new_tokens=24).text for p in prompts]
    before = metric_values(server[0], "leapdecode_batch_sequences")
    start = threading.Barrier(len(prompts))

    def complete(prompt: str) -> str:
        start.wait()
        return client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0).choices[0].text

    with ThreadPoolExecutor(len(prompts)) as pool:
        got = list(pool.map(complete, prompts))
    assert got == expected
    after = metric_values(server[0], "leapdecode_batch_sequences")
    passes, sequences = after["count"] - before["count"], after["sum"] - before["sum"]
    assert passes > 0 and sequences > passes  # some passes held several requests


def test_n_choices_each_equal_their_own_request_streamed_or_not(client, real_lm) -> None:
    prompt = "def fibonacci(n):\n"
    expected = wrap(real_lm, "anpd").generate(prompt, max_new_tokens=16)
    resp = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0, n=3)
    assert [c.index for c in resp.choices] == [0, 1, 2] and all(c.text == expected.text for c in resp.choices)
    assert resp.usage.prompt_tokens == len(expected.prompt_ids) and resp.usage.completion_tokens == 3 * len(
        expected.token_ids
    )
    # sampled: choice i is the n=1 request with seed + i
    messages = [{"role": "user", "content": "Write a limerick about a cat."}]
    alone = [
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0.9, seed=seed)
        .choices[0]
        .message.content
        for seed in (7, 8)
    ]
    both = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0.9, seed=7, n=2)
    assert [c.message.content for c in both.choices] == alone and alone[0] != alone[1]
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=16,
            temperature=0.9,
            seed=7,
            n=2,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    texts, finished = ["", ""], [0, 0]
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            finished[choice.index] += choice.finish_reason is not None
    assert texts == alone and finished == [1, 1]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == both.usage.completion_tokens
    # a method that cannot share passes runs its choices one after another
    layerskip = client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=12,
        temperature=0,
        n=2,
        extra_body={"leapdecode": {"method": "layerskip:exit=12"}},
    )
    want = wrap(real_lm, "layerskip:exit=12").generate(prompt, max_new_tokens=12).text
    assert [c.text for c in layerskip.choices] == [want, want]


def metric_values(url: str, name: str) -> dict[str, float]:
    """A histogram's _sum and _count on /metrics."""
    values = {}
    for line in httpx.get(url + "/metrics").text.splitlines():
        for part in ("sum", "count"):
            if line.startswith(f"{name}_{part} "):
                values[part] = float(line.rsplit(" ", 1)[1])
    return values


def test_metrics_are_prometheus_text(server) -> None:
    text = httpx.get(server[0] + "/metrics").text
    for name in (
        "leapdecode_requests_total",
        "leapdecode_generated_tokens_total",
        "leapdecode_mean_accepted_tokens_per_pass",
        "leapdecode_draft_hit_ratio",
        "leapdecode_queue_depth",
        "leapdecode_request_latency_seconds_bucket",
        "leapdecode_batch_sequences_bucket",
        "leapdecode_pass_rows_bucket",
        "leapdecode_pass_seconds_bucket",
        "leapdecode_queue_time_seconds_bucket",
    ):
        assert name in text


def chat_counts(url: str) -> dict[str, float]:
    """/metrics' request counter for the chat endpoint, by status."""
    counts = {}
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith('leapdecode_requests_total{endpoint="/v1/chat/completions"'):
            status = line.split('status="')[1].split('"')[0]
            counts[status] = float(line.rsplit(" ", 1)[1])
    return counts


def test_bounded_load_with_disconnects(server) -> None:
    url, proc = server
    memory = []
    reports = []
    for _ in range(2):
        before = chat_counts(url)
        report = run_load(
            url, MODEL, clients=8, requests=5, disconnect_every=3, max_tokens=8, pid=proc.pid, settle_s=15
        )
        after = chat_counts(url)
        counted = {k: after.get(k, 0) - before.get(k, 0) for k in after}
        # /metrics counts each request once: every 429 the clients saw, and one 200 or 499 for each other request
        assert counted.get("429", 0) == report.rejected
        assert (
            counted.get("200", 0) + counted.get("499", 0) == report.completed + report.disconnected + report.abandoned
        ), counted
        reports.append(report)
        memory.append(report.rss_after_mb * 2**20)
        assert report.unexpected == [], report.unexpected
        assert set(report.statuses) <= {"200", "429", "abandoned"}, report.statuses
        assert report.rejected == report.statuses.get("429", 0)
        # a refused client retries, so every request ends its own way: 7 of the 20 streams leave after
        # their first event; 7 of the 20 non-streaming requests abandon a long answer (512 tokens
        # here; one the server finished within the client's wait would complete), the other 26 complete
        assert report.disconnected == 7 and report.abandoned >= 1, report.summary()
        assert report.abandoned + report.completed == 33, report.summary()
        # every slot is freed: a disconnected stream or an abandoned request stops at its next step
        assert report.admitted_after == 0
    print(json.dumps({"rounds": [r.summary() for r in reports]}, indent=2))
    assert memory[1] - memory[0] < 64 * 2**20  # no growth across rounds beyond noise
    still_serving(url)


def test_half_sent_bodies_time_out_and_open_connections_are_bounded(server) -> None:
    """Sixty connections each holding a half-sent body: those past --max-connections (48) are
    refused at once (503), the others get 408 once --body-timeout (3 s) passes, and every one is
    closed; the server serves on."""
    url = server[0]
    port = int(url.rsplit(":", 1)[1])
    deadline = time.time() + 30
    while httpx.get(url + "/health").json()["admitted"]:
        assert time.time() < deadline, "the server was not idle"
        time.sleep(0.2)
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
        'Content-Length: 100\r\n\r\n{"model"'
    ).encode()

    def connect() -> socket.socket:
        s = socket.create_connection(("127.0.0.1", port), timeout=15)
        s.sendall(head)
        return s

    # the limit is counted when a request's head is read, over the connections open then: forty
    # opened first, and read (a request on a connection opened after them is answered), are
    # within it whatever the event loop's timing; twenty more at once take it past 48
    sockets = [connect() for _ in range(40)]
    assert httpx.get(url + "/health").status_code == 200
    sockets += [connect() for _ in range(20)]
    start = time.monotonic()
    statuses = []
    for s in sockets:
        data = b""
        while True:
            chunk = s.recv(4096)
            if not chunk:
                break  # the server closed the connection
            data += chunk
        statuses.append(data.split(b" ", 2)[1].decode() if data.startswith(b"HTTP/1.1 ") else "none")
        s.close()
    assert statuses[:40] == ["408"] * 40 and set(statuses[40:]) <= {"408", "503"}, statuses
    assert 12 <= statuses.count("503") and statuses.count("408") <= 48 and time.monotonic() - start < 15
    still_serving(url)


def test_a_request_framed_two_ways_is_refused_and_nothing_after_it_is_served(server) -> None:
    """Content-Length and Transfer-Encoding together, with a second request hidden after the
    chunked body: one OpenAI-style 400, the connection closed, the hidden request never served."""
    host, port = server[0].removeprefix("http://").split(":")
    smuggled = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        "Content-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n"
        f"GET /metrics HTTP/1.1\r\nHost: {host}\r\n\r\n"
    ).encode()
    with socket.create_connection((host, int(port)), timeout=30) as conn:
        conn.sendall(smuggled)
        assert httpx.get(server[0] + "/health", timeout=2).status_code == 200  # others are answered meanwhile
        answer = b""
        while chunk := conn.recv(65536):  # until the server closes the connection
            answer += chunk
    text = answer.decode("latin-1")
    assert text.startswith("HTTP/1.1 400") and text.count("HTTP/1.1 ") == 1, text
    assert '"invalid_framing"' in text and "leapdecode_requests_total" not in text
    still_serving(server[0])


@pytest.fixture(scope="module")
def short_headers_server():
    url, proc = start_server("--header-timeout", "1", "--max-connections", "2")
    yield url
    proc.terminate()
    proc.wait(timeout=30)


def read_until_closed(conn: socket.socket) -> str:
    answer = b""
    while chunk := conn.recv(65536):
        answer += chunk
    return answer.decode("latin-1")


def test_headers_sent_slowly_past_the_limit_get_a_408_and_the_connection_closes(short_headers_server) -> None:
    host, port = short_headers_server.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as conn:
        conn.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\n".encode())
        # while it dribbles, the server answers others at once (the limit fits a short read, no timing)
        assert httpx.get(short_headers_server + "/health", timeout=2).status_code == 200
        for _ in range(4):  # a header line now and then, never the end of the headers
            time.sleep(0.5)
            try:
                conn.sendall(b"X-Slow: 1\r\n")
            except OSError:  # closed already
                break
        text = read_until_closed(conn)
    assert text.startswith("HTTP/1.1 408") and '"request_timeout"' in text, text
    still_serving(short_headers_server)


def test_headers_sent_in_parts_within_the_limit_are_served(short_headers_server) -> None:
    host, port = short_headers_server.removeprefix("http://").split(":")
    body = json.dumps({"model": MODEL, "prompt": "Hi", "max_tokens": 2, "temperature": 0}).encode()
    with socket.create_connection((host, int(port)), timeout=60) as conn:
        conn.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\n".encode())
        time.sleep(0.3)
        conn.sendall(
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
            + body
        )
        text = read_until_closed(conn)
    assert text.startswith("HTTP/1.1 200") and '"completion_tokens"' in text, text


def test_a_connection_past_the_limit_gets_an_openai_503_with_retry_after(short_headers_server) -> None:
    host, port = short_headers_server.removeprefix("http://").split(":")
    held = [socket.create_connection((host, int(port)), timeout=30) for _ in range(2)]  # the limit of 2
    try:
        for conn in held:
            conn.sendall(f"GET /health HTTP/1.1\r\nHost: {host}\r\n".encode())  # headers not finished
        with socket.create_connection((host, int(port)), timeout=30) as extra:
            extra.sendall(f"GET /health HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
            text = read_until_closed(extra)
    finally:
        for conn in held:
            conn.close()
    assert text.startswith("HTTP/1.1 503") and "retry-after: 1" in text.lower(), text
    assert '"too_many_connections"' in text
    still_serving(short_headers_server)


@pytest.mark.parametrize(
    "head",
    [
        "POST /v1/completions HTTP/1.1\r\nHost: h\r\nContent-Length: -1\r\n\r\n",
        "POST /v1/completions HTTP/1.1\r\nHost: h\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\n",
        "POST /v1/completions HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: gzip\r\n\r\n",
        "GET /health HTTP/1.1\r\n\r\n",  # no Host
    ],
)
def test_a_request_the_http_layer_cannot_parse_gets_an_openai_400(short_headers_server, head) -> None:
    host, port = short_headers_server.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as conn:
        conn.sendall(head.encode())
        text = read_until_closed(conn)
    assert text.startswith("HTTP/1.1 400") and "application/json" in text and '"invalid_request"' in text, text
