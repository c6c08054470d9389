"""The server's edges, each with the exact request that broke it: bounded /metrics labels, Host
checking by host and port, 413 for any oversized body, OpenAI's answer to `stream_options`
without `stream`, HEAD where GET is served, and what the queue-depth and running gauges count
with a full batch. In-process (`TestClient`) on the real small model."""

from __future__ import annotations

import threading
import time

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from leapdecode.server.middleware import HostPort, allowed_hosts, parse_host

MODEL = "smollm2-135m"
BODY = {"model": MODEL, "prompt": "hi", "max_tokens": 2, "temperature": 0}


@pytest.fixture(scope="module")
def app_client(real_lm):
    from leapdecode.server.app import ServerConfig, create_app

    config = ServerConfig(
        model_name=MODEL,
        default_method="ar",
        max_queue=6,
        max_batch=2,
        timeout_s=600,  # five 400-token answers on a batch of two finish long before, on a loaded machine too
        max_body_bytes=4096,
        allowed_hosts=("127.0.0.1:8000", "localhost", "[::1]:8000"),
    )
    with TestClient(create_app(real_lm, config), base_url="http://localhost") as client:
        yield client


def series(client: TestClient, name: str) -> dict[str, float]:
    """Every sample of metric `name` on /metrics, by its label text."""
    out = {}
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            key, value = line.rsplit(" ", 1)
            out[key[len(name) :]] = float(value)
    return out


def test_metrics_labels_are_route_templates_whatever_the_path(app_client) -> None:
    before = len(series(app_client, "leapdecode_requests_total"))
    for i in range(200):
        assert app_client.get(f"/unknown/{i}/" + "x" * 4000).status_code == 404
        assert app_client.get(f"/v1/models/other-{i}").status_code == 404
        assert app_client.get(f"/nowhere-{i}%00%FF", headers={"Host": "evil.example"}).status_code == 400
    labels = series(app_client, "leapdecode_requests_total")
    assert len(labels) - before <= 3  # other/404, the model card's template/404, other/400
    assert labels['{endpoint="other",status="404"}'] >= 200 and labels['{endpoint="other",status="400"}'] >= 200
    assert labels['{endpoint="/v1/models/{model_id}",status="404"}'] >= 200
    assert all("\\x00" not in key and "x" * 100 not in key for key in labels)


@pytest.mark.parametrize(
    "host, allowed",
    [
        ("127.0.0.1:8000", True),
        ("127.0.0.1:8001", False),
        ("127.0.0.1", False),  # a configured port must match
        ("localhost", True),
        ("LOCALHOST", True),
        ("localhost:1234", True),  # no configured port: any port; case-insensitive
        ("[::1]:8000", True),
        ("[::1]:8001", False),
        ("127.0.0.1:8000:9", False),
        ("[127.0.0.1:8000]", False),
        ("localhost:", False),
        ("localhost:99999", False),
        ("evil.example", False),
        ("", False),
        ("local host", False),
        ("localhost:8000@evil", False),
    ],
)
def test_host_checking_compares_host_and_port_as_configured(app_client, host, allowed) -> None:
    resp = app_client.get("/health", headers={"Host": host})
    assert (resp.status_code == 200) == allowed, (host, resp.text)
    if not allowed:
        assert resp.json()["error"]["code"] == "invalid_host"


def test_host_values_parse_as_rfc_9110_writes_them() -> None:
    assert parse_host("Example.COM:80") == HostPort("example.com", 80)
    assert parse_host("[::1]") == HostPort("::1", None)
    assert parse_host("[::1]:443") == HostPort("::1", 443)
    for bad in ("a:b:c", "[1.2.3.4]", "[::1", "::1", "host:", "host:-1", "host:٣", "ho st", ""):
        assert parse_host(bad) is None, bad
    assert HostPort("a", 80).allows(HostPort("a", None), default_port=80)
    with pytest.raises(Exception, match="allowed-host"):
        allowed_hosts(("127.0.0.1:8000:9",))


def test_any_oversized_body_gets_413_and_is_counted(app_client) -> None:
    before = series(app_client, "leapdecode_requests_total").get('{endpoint="/v1/completions",status="413"}', 0)
    sized = app_client.post("/v1/completions", json={**BODY, "prompt": "x" * 5000})
    assert sized.status_code == 413

    def chunked():
        for _ in range(10):
            yield b"x" * 1000

    unsized = app_client.post("/v1/completions", content=chunked(), headers={"Content-Type": "application/json"})
    assert unsized.status_code == 413 and unsized.json()["error"]["code"] == "body_too_large"
    after = series(app_client, "leapdecode_requests_total")['{endpoint="/v1/completions",status="413"}']
    assert after - before == 2
    assert app_client.post("/v1/completions", json=BODY).status_code == 200


def test_stream_options_without_stream_is_refused_as_openai_does(app_client) -> None:
    resp = app_client.post("/v1/completions", json={**BODY, "stream_options": {"include_usage": True}})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "stream_options"
    ok = app_client.post("/v1/completions", json={**BODY, "stream": True, "stream_options": {"include_usage": True}})
    assert ok.status_code == 200 and '"usage"' in ok.text


@pytest.mark.parametrize("path", ["/health", "/metrics", "/v1/models", f"/v1/models/{MODEL}"])
def test_head_is_served_wherever_get_is(app_client, path) -> None:
    resp = app_client.head(path)
    assert resp.status_code == 200 and resp.content == b""
    assert app_client.head("/v1/completions").status_code == 405


def gauge(client: TestClient, name: str) -> float:
    return series(client, name)[""]


def test_queue_depth_counts_what_waits_for_the_batch_not_what_runs(app_client) -> None:
    """Five long generations on a batch of two: two decode, three wait."""
    body = {"model": MODEL, "prompt": "Count from one to one thousand:", "max_tokens": 400, "temperature": 0}
    statuses: list[int] = []
    threads = [
        threading.Thread(target=lambda: statuses.append(app_client.post("/v1/completions", json=body).status_code))
        for _ in range(5)
    ]
    for t in threads:
        t.start()
    seen = set()
    deadline = time.time() + 60
    while time.time() < deadline and len(statuses) < 5:
        seen.add((gauge(app_client, "leapdecode_running_requests"), gauge(app_client, "leapdecode_queue_depth")))
        if (2.0, 3.0) in seen:
            break
        time.sleep(0.05)
    for t in threads:
        t.join()
    assert (2.0, 3.0) in seen, seen
    assert statuses == [200] * 5
    assert gauge(app_client, "leapdecode_running_requests") == 0 and gauge(app_client, "leapdecode_queue_depth") == 0


def test_a_vanishing_temperature_decodes_greedily_instead_of_sampling_nan(app_client) -> None:
    """Found by the fuzz test: logits divided by 1e-243 overflow to NaN, whose "sample" was a
    token id past the vocabulary (a 500). Below 1e-5 a temperature is greedy, as in vLLM."""
    body = {"model": MODEL, "messages": [{"role": "tool", "content": "0"}], "max_tokens": 4}
    tiny = app_client.post("/v1/chat/completions", json={**body, "temperature": 1.129452337650155e-243})
    greedy = app_client.post("/v1/chat/completions", json={**body, "temperature": 0})
    assert tiny.status_code == 200 and tiny.json()["choices"][0]["message"] == greedy.json()["choices"][0]["message"]


def test_a_trailing_slash_is_a_404_never_a_redirect_to_the_clients_host(app_client) -> None:
    resp = app_client.post("/v1/chat/completions/", json=BODY, headers={"host": "localhost"}, follow_redirects=False)
    assert resp.status_code == 404 and "location" not in resp.headers
    assert resp.json()["error"]["message"]


@pytest.mark.parametrize(
    "extra, param, fragment",
    [
        ({"prompt": [True, False]}, "prompt", ""),  # booleans are not token ids
        ({"stream": True, "stream_options": {"include_usage": "yes"}}, "stream_options", "boolean"),
        ({"temperature": float("nan")}, "temperature", "finite"),
        ({"top_p": float("inf")}, "top_p", "finite"),
    ],
)
def test_loose_types_are_refused_by_name(app_client, extra, param, fragment) -> None:
    import json

    body = json.dumps({**BODY, **extra})  # NaN and Infinity as a client's JSON writer sends them
    resp = app_client.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"].startswith(param) and fragment in error["message"], error


@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(
    ids=st.lists(st.one_of(st.booleans(), st.integers(-3, 60_000), st.floats(allow_nan=True)), min_size=1, max_size=4)
)
def test_fuzzed_token_ids_are_served_only_as_integers_in_the_vocabulary(app_client, ids) -> None:
    vocab = 49152  # smollm2-135m's
    valid = all(type(i) is int and 0 <= i < vocab for i in ids)
    resp = app_client.post("/v1/completions", json={**BODY, "prompt": ids})
    assert resp.status_code == (200 if valid else 400), (ids, resp.text)
    if not valid:
        assert resp.json()["error"]["message"]


@settings(max_examples=20, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(flag=st.one_of(st.booleans(), st.integers(), st.text(max_size=5), st.none()))
def test_fuzzed_include_usage_is_served_only_as_a_boolean(app_client, flag) -> None:
    body = {**BODY, "stream": True, "stream_options": {"include_usage": flag}}
    resp = app_client.post("/v1/completions", json=body)
    assert resp.status_code == (200 if isinstance(flag, bool) else 400), (flag, resp.text)


def test_one_at_a_time_a_short_request_and_health_are_answered_while_a_long_prompt_prefills(real_lm) -> None:
    """`--max-batch 1` with a 3,000-token prompt in flight: `/health` answers and a short request
    (the exact body below) ends before the long one (its prefill steps aside, keeping its chunks);
    both answers are each request's own."""
    from leapdecode.server.app import ServerConfig, create_app

    # no prefix cache: the long prompt, answered once alone first, is prefilled again in full
    config = ServerConfig(
        model_name=MODEL, default_method="ar", max_queue=4, max_batch=1, timeout_s=600, prefix_cache_tokens=0
    )
    long_body = {"model": MODEL, "prompt": "one two three four five " * 600, "max_tokens": 2, "temperature": 0}
    short_body = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}
    with TestClient(create_app(real_lm, config), base_url="http://localhost") as client:
        alone = {
            "long": client.post("/v1/completions", json=long_body).json()["choices"][0]["text"],
            "short": client.post("/v1/completions", json=short_body).json()["choices"][0]["text"],
        }
        ended: list[str] = []
        texts: dict[str, str] = {}

        def post(name: str, body: dict) -> None:
            texts[name] = client.post("/v1/completions", json=body).json()["choices"][0]["text"]
            ended.append(name)

        long = threading.Thread(target=post, args=("long", long_body))
        long.start()
        deadline = time.time() + 60
        while gauge(client, "leapdecode_running_requests") < 1 and time.time() < deadline:
            time.sleep(0.01)
        health = client.get("/health")
        assert health.status_code == 200 and long.is_alive()  # answered while the long prompt runs
        post("short", short_body)
        long.join()
    assert ended == ["short", "long"] and texts == alone
