"""Fixtures (tiny random models, the real small model) and the test markers.

Markers (`pyproject.toml`): `real_model` (loads a packaged real model), `llamacpp`, `vllm`,
`peers` (optional backends and peers `make test` installs), `browser` (headless Chromium).
A test that uses one of the fixtures below is marked here, so no such test can forget it; files
of one optional backend carry their marker at the top; `make test-fast` runs the rest.
"""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import settings

from tests.helpers import make_tiny_model

# A fixture that loads a real model or needs an optional backend marks every test that uses it
# (directly or through another fixture).
FIXTURE_MARKERS = {
    "real_lm": "real_model",
    "real_lm_float32": "real_model",
    "int4_lm": "real_model",
    "cpp_lm": "llamacpp",
    "vllm_python": "vllm",
}

# `make test` runs two pytest-xdist workers, one per core: each computes on one thread, and so does
# every process a test starts (servers, vLLM, llama.cpp's programs inherit OMP_NUM_THREADS), so the
# two never contend for a core. Torch's default is a thread per core in each process: two workers'
# spinning OpenMP threads on two cores run each test three to four times slower.
WORKER = bool(os.environ.get("PYTEST_XDIST_WORKER"))
if WORKER:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)

# No per-example time limit: on a loaded two-core machine one example can stall past Hypothesis's
# 200 ms default, and its fast replay is then reported as a flaky failure. Tests set examples only.
settings.register_profile("leapdecode", deadline=None)
settings.load_profile("leapdecode")


@pytest.fixture(autouse=True)
def one_thread_per_worker():
    """A command a test runs with `--threads N` sets torch's threads for the whole process: back to
    one after each test in a worker, so no later test runs two threads beside the other worker."""
    yield
    if WORKER and torch.get_num_threads() != 1:
        torch.set_num_threads(1)


# The slowest test files (real models, servers, training) run first: xdist hands out whole files in
# collection order, and a long file handed out last runs alone while the other worker idles.
SLOW_FIRST = (
    "test_server_soak.py",
    "test_bench_real.py",
    "test_head_training.py",
    "test_draft_model.py",
    "test_row_exact.py",
    "test_real_model.py",
    "test_vllm_integration.py",
    "test_early_exit.py",
    "test_eagle3.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        for name in set(getattr(item, "fixturenames", ())) & FIXTURE_MARKERS.keys():
            item.add_marker(FIXTURE_MARKERS[name])
    rank = {name: i for i, name in enumerate(SLOW_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(SLOW_FIRST)))  # stable: the rest keep their order


@pytest.fixture(autouse=True)
def own_cost_store(tmp_path_factory, monkeypatch):
    """Measured pass costs kept on disk (`engine.cost_store`) go to a folder of each test's own in
    this process: no test reads a curve another test or run measured (the processes a test starts,
    servers and commands, keep theirs where a user's go)."""
    from leapdecode.engine import cost_store

    folder = tmp_path_factory.mktemp("costs")
    monkeypatch.setattr(cost_store, "default_cost_folder", lambda: folder)
    return folder


@pytest.fixture(scope="session", params=["llama", "qwen2"])
def tiny_model(request):
    return make_tiny_model(request.param)


@pytest.fixture(scope="session")
def real_lm():
    """The real `smollm2-135m` as a user gets it with no options (on a CPU: int4, the GGUF's own
    blocks, row-exact), pulled by `.ci/run` before the tests (here if missing). Its float32 path,
    five times slower on one core, is tested where it is the point (`test_row_exact.py`)."""
    from leapdecode.models import load_model

    return load_model("smollm2-135m", log=lambda msg: None)


@pytest.fixture(scope="session")
def real_lm_float32():
    """The same model in float32 (its GGUF de-quantized, row-exact), where a test needs float weights."""
    from leapdecode.models import load_model

    return load_model("smollm2-135m", dtype="float32", log=lambda msg: None)
