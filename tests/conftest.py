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

from tests.helpers import make_tiny_model

# A fixture that loads a real model or needs an optional backend marks every test that uses it
# (directly or through another fixture).
FIXTURE_MARKERS = {"real_lm": "real_model", "int4_lm": "real_model", "cpp_lm": "llamacpp", "vllm_python": "vllm"}

# `make test` runs two pytest-xdist workers, one per core: each computes on one thread, so the two
# never contend for a core (torch's default is a thread per core in each process).
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        for name in set(getattr(item, "fixturenames", ())) & FIXTURE_MARKERS.keys():
            item.add_marker(FIXTURE_MARKERS[name])


@pytest.fixture(scope="session", params=["llama", "qwen2"])
def tiny_model(request):
    return make_tiny_model(request.param)


@pytest.fixture(scope="session")
def real_lm():
    """The real `smollm2-135m` (pulled by `.ci/run` before the tests; pulled here if missing)."""
    from leapdecode.models import load_model

    return load_model("smollm2-135m", dtype="float32", log=lambda msg: None)
