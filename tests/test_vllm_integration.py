"""leapdecode's drafters inside vLLM.

Without vLLM: each batch row finds its own request's drafter whatever vLLM does with slots
(reordering, reuse by a new request, partial prefills), against a reference keyed by the true
request; memory stays bounded; set-up errors are clear. With vLLM (its CPU build, in the venv
`make vllm` builds: vLLM pins other versions of our dependencies): greedy output through vLLM
with our proposers equals vLLM's own output without speculation, on a tiny random model and on
smollm2-135m, with drafts accepted.
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from leapdecode.drafters.ngram import AnpdDrafter
from leapdecode.errors import MethodError
from leapdecode.integrations.slots import SlotDrafters
from leapdecode.integrations.step_cost import StepCost
from leapdecode.integrations.vllm_setup import PROPOSER, serve_command, vllm_engine_args, vllm_method
from tests.helpers import CheckedDrafter

MAX_LEN = 256


def batch(rows: list[list[int]], emitted: list[int] | None = None) -> tuple[list[list[int]], np.ndarray, np.ndarray]:
    """vLLM's arrays for slots holding `rows` (emitted: tokens sampled this step per row; 0 = a partial prefill)."""
    token_ids = np.zeros((len(rows), MAX_LEN), dtype=np.int32)  # [slots, max_model_len]
    for i, row in enumerate(rows):
        token_ids[i, : len(row)] = row
    sampled = [
        row[-(emitted[i] if emitted else 1) :] if (emitted is None or emitted[i]) else [] for i, row in enumerate(rows)
    ]
    return sampled, np.array([len(r) for r in rows], dtype=np.int32), token_ids


def reference_draft(tokens: list[int], k: int) -> list[int]:
    """What a fresh ANPD drafter fed exactly `tokens` drafts."""
    drafter = AnpdDrafter(n=3, k=k)
    drafter.reset(tokens)
    return drafter.propose(k).tokens


def slots(k: int = 4, **kwargs: int) -> SlotDrafters:
    return SlotDrafters(lambda: AnpdDrafter(n=3, k=k), max_tokens=k, max_len=MAX_LEN, **kwargs)


def test_a_new_request_in_a_finished_requests_slot_drafts_from_its_own_text() -> None:
    a = [5, 1, 2, 3, 4, 6, 7, 8, 9, 1, 2]  # "1 2" was followed by "3 4"
    b = [6, 9, 9, 8, 1, 2]  # ends with "1 2" too, never followed by anything here
    s = slots()
    assert s.propose(*batch([a]))[0] == [3, 4, 6, 7]
    # keyed by slot, B would inherit A's table and draft 3 4 6 7
    assert s.propose(*batch([b]))[0] == reference_draft(b, 4) == []
    assert s.built == 2


def test_reordered_slots_keep_each_requests_drafter() -> None:
    a, b = [1, 2, 3, 1, 2], [7, 8, 9, 7, 8]
    s = slots()
    assert s.propose(*batch([a, b])) == [[3, 1, 2, 3], [9, 7, 8, 9]]
    a2, b2 = a + [3, 1], b + [9, 7]
    assert s.propose(*batch([b2, a2])) == [reference_draft(b2, 4), reference_draft(a2, 4)]
    assert s.built == 2  # found again, not rebuilt


def test_partial_prefill_and_full_context_get_no_draft() -> None:
    s = slots()
    rows = [[1, 2, 1, 2], list(range(MAX_LEN - 4)) + [0, 1], [3, 4] * (MAX_LEN // 2)]
    sampled, num, ids = batch(rows, emitted=[0, 1, 1])
    drafts = s.propose(sampled, num, ids)
    assert drafts[0] == []  # a partial prefill: nothing sampled yet
    assert drafts[1] == [2, 3]  # never past the engine's longest sequence (2 more tokens)
    assert drafts[2] == []  # already at it
    assert s.built == 1


def test_memory_is_bounded_and_finished_requests_are_dropped() -> None:
    s = slots(capacity=3, idle_steps=2)
    for r in range(10):
        s.propose(*batch([[100 + r, 1, 2, 1]]))
        assert len(s.tracked) <= 3
    for _ in range(3):
        s.propose(*batch([[7, 7, 7]]))
    assert len(s.tracked) == 1  # only the live request's drafter is left


def test_an_evicted_requests_output_reaches_a_shared_index() -> None:
    from leapdecode.drafters.suffix import SuffixDrafter, SuffixIndex

    index = SuffixIndex(4096)
    s = SlotDrafters(lambda: SuffixDrafter(8, 1.0, 0.0, 1, index), max_tokens=8, max_len=MAX_LEN, idle_steps=1)
    s.propose(*batch([[1, 2, 3, 4, 5, 6]]))
    s.propose(*batch([[1, 2, 3, 4, 5, 6, 7, 8]]))
    before = index.version
    s.propose(*batch([[9, 9]]))  # the first request is gone: its drafter is finished
    assert index.version > before


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_every_row_drafts_as_its_own_request_would(data: st.DataObject) -> None:
    """Random schedules: requests start, grow by 1-3 tokens per step, move between slots, stop
    (their slot goes to a new request), some rows are partial prefills; each row's draft equals
    what a drafter fed exactly that request's tokens would draft, and every drafter hears the
    contract's calls in their legal order."""
    rng = random.Random(data.draw(st.integers(0, 10**6)))
    vocab = data.draw(st.integers(2, 6))  # a small vocabulary: many repeats, many drafts
    # every drafter checked for the contract's call order (start, then offer and hear, finish)
    s = SlotDrafters(
        lambda: CheckedDrafter(AnpdDrafter(n=3, k=3)), max_tokens=3, max_len=MAX_LEN, capacity=64, idle_steps=4
    )
    live: list[list[int]] = []
    for _ in range(data.draw(st.integers(1, 12))):
        live = [r for r in live if rng.random() > 0.15 and len(r) < MAX_LEN - 8]  # some finish
        while len(live) < 4 and rng.random() < 0.7:
            live.append([rng.randrange(vocab) for _ in range(rng.randint(1, 12))])
        if not live:
            continue
        rng.shuffle(live)  # vLLM reorders slots
        emitted = [rng.choice([0, 1, 1, 1]) for _ in live]
        drafts = s.propose(*batch(live, emitted))
        for row, n, draft in zip(live, emitted, drafts, strict=True):
            assert draft == (reference_draft(row, 3) if n else [])
        for row in live:
            row.extend(rng.randrange(vocab) for _ in range(rng.randint(1, 3)))


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@given(a=st.floats(0.01, 1.0), ratio=st.floats(0.0, 3.0))
def test_step_cost_recovers_a_linear_step_time(a: float, ratio: float) -> None:
    b = ratio * a  # a scored token costs 0 (a GPU) to 3 steps
    cost = StepCost(clock=FakeClock())
    for i in range(200):
        cost.observe(1 + i % 8, a + b * (1 + i % 8))
    assert cost.a == pytest.approx(a, rel=0.02) and cost.b == pytest.approx(b, rel=0.02, abs=0.001 * a)
    cost.rows = 4  # a row's share: the fixed part split over the batch, its own tokens in full
    assert cost.of(3) == pytest.approx(cost.a / 4 + 3 * cost.b)


def test_step_cost_keeps_its_prior_ratio_while_every_step_scores_the_same() -> None:
    cost = StepCost(clock=FakeClock(), prior_slope=0.2)
    for _ in range(50):
        cost.observe(1, 0.12)
    assert cost.a + cost.b == pytest.approx(0.12, rel=0.05) and cost.b == pytest.approx(0.2 * cost.a, rel=0.05)


def test_slots_fit_decode_steps_only_and_cut_drafts_that_do_not_pay() -> None:
    """The time between calls is the engine's step: with each scored token as dear as the step
    itself, a cost-aware ANPD keeps only drafts nearly sure to be accepted; with tokens free, all."""
    from leapdecode.drafters.cost_aware import AcceptanceEstimate, CostAwareDrafter

    def run(per_token: float) -> tuple[StepCost, list[int]]:
        clock = FakeClock()
        cost = StepCost(clock=clock)
        s = SlotDrafters(
            lambda: CostAwareDrafter(AnpdDrafter(n=3, k=6), cost, AcceptanceEstimate()),
            max_tokens=6,
            max_len=MAX_LEN,
            cost=cost,
        )
        rng = random.Random(0)
        row = [rng.randrange(50) for _ in range(40)]  # nothing repeats: every draft is wrong
        lengths = []
        for step in range(120):
            scored = 1 + len(s.tracked[0].last_draft) if s.tracked else 0
            clock.now += 0.1 + per_token * scored if step else 5.0  # the first step is a prefill
            lengths.append(len(s.propose(*batch([row]))[0]))
            row = row + [rng.randrange(50)] if step % 3 else row + row[-4:-2]  # some bigrams repeat
        return cost, lengths

    dear, dear_lengths = run(per_token=0.1)
    assert dear.steps == 119  # the prefill was not fitted
    assert dear.b == pytest.approx(0.1, rel=0.05) and dear.a == pytest.approx(0.1, rel=0.05)
    cheap, cheap_lengths = run(per_token=0.0)
    assert cheap.b == pytest.approx(0.0, abs=1e-3)
    assert sum(dear_lengths[60:]) < sum(cheap_lengths[60:]) / 3


def test_setup_names_the_proposer_and_method() -> None:
    args = vllm_engine_args("anpd:n=4,k=6")
    assert args["speculative_config"] == {"method": "custom_class", "model": PROPOSER, "num_speculative_tokens": 6}
    assert args["additional_config"] == {"leapdecode_method": "anpd:n=4,k=6,cost_aware=True"}  # cut by vLLM's step cost
    argv = serve_command("/models/m", "pld:k=5", ["--port", "9000"])
    assert argv[1:5] == ["-m", "vllm.entrypoints.openai.api_server", "--model", "/models/m"] and argv[-2:] == [
        "--port",
        "9000",
    ]
    assert json.loads(argv[argv.index("--speculative-config") + 1])["num_speculative_tokens"] == 5
    suffix = vllm_method("suffix:k=12")  # vLLM verifies chains: the suffix tree's most probable path
    assert suffix.drafts == "chain" and suffix.draft_length == 12
    assert vllm_engine_args("suffix:k=12")["speculative_config"]["num_speculative_tokens"] == 12


def test_vllm_bench_names_what_a_vllm_suffix_run_needs_before_running(monkeypatch: pytest.MonkeyPatch) -> None:
    from leapdecode.bench import vllm_bench

    entries = vllm_bench.parse_vllm_entries("vllm-ngram:k=5,n=2,suffix:k=9")
    assert entries[0].label == "none" and entries[1].speculative_config["num_speculative_tokens"] == 5
    assert entries[2].method == "suffix:k=9"
    monkeypatch.setattr(vllm_bench.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(MethodError, match="arctic-inference"):
        vllm_bench.parse_vllm_entries("none,vllm-suffix:k=16")


@pytest.mark.parametrize("spec", ["anpd-tree", "jacobi", "draft:model=x", "nope"])
def test_methods_that_cannot_run_in_vllm_are_refused(spec: str) -> None:
    with pytest.raises(MethodError):
        vllm_method(spec)


def test_importing_the_proposers_without_vllm_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` fails here, installed or not
    monkeypatch.delitem(sys.modules, "leapdecode.integrations.vllm", raising=False)
    with pytest.raises(ImportError, match=r"leapdecode\[vllm\]"):
        import leapdecode.integrations.vllm  # noqa: F401


def test_vllm_serve_builds_the_server_command_or_names_the_extra(real_lm) -> None:
    from typer.testing import CliRunner

    from leapdecode.cli import app

    runner = CliRunner()
    dry = runner.invoke(app, ["vllm-serve", "-m", "smollm2-135m", "--method", "pld:k=5", "--dry-run", "--port", "9001"])
    assert dry.exit_code == 0, dry.output
    assert (
        "vllm.entrypoints.openai.api_server" in dry.output and "--port 9001" in dry.output and "pld:k=5" in dry.output
    )
    refused = runner.invoke(app, ["vllm-serve", "--method", "anpd-tree", "--dry-run"])
    assert refused.exit_code == 2 and "cannot draft inside vLLM" in refused.output
    if importlib.util.find_spec("vllm") is None:
        missing = runner.invoke(app, ["vllm-serve", "-m", "smollm2-135m"])
        assert missing.exit_code == 2 and "leapdecode[vllm]" in missing.output


def test_dequantized_folders_store_a_tied_output_layer_once(real_lm_float32) -> None:
    """vLLM reads a saved copy of a tied output layer as the layer and leaves the embeddings unset
    (every logit equal): the folder holds the embeddings only, as `save_pretrained` writes it."""
    from safetensors import safe_open

    from leapdecode.models.loading import huggingface_source

    with safe_open(str(Path(huggingface_source("smollm2-135m")) / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert "model.embed_tokens.weight" in keys and "lm_head.weight" not in keys
    model = real_lm_float32.model
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


# --- through vLLM itself -------------------------------------------------------------------------

VLLM_PYTHON = Path(
    os.environ.get("LEAPDECODE_VLLM_PYTHON", Path(__file__).resolve().parents[1] / ".venv-vllm" / "bin" / "python")
)


@pytest.fixture(scope="module")
def vllm_python() -> Path:
    """vLLM's environment. Missing, the tests fail, not skip: `make test` builds it (`make vllm`)."""
    if not VLLM_PYTHON.is_file():
        pytest.fail(f"no vLLM environment at {VLLM_PYTHON}: run `make vllm` (part of `make test`)")
    return VLLM_PYTHON


def run_vllm(python: Path, model: str, prompts: list[list[int]], max_tokens: list[int], method: str | None):
    """One engine run in vLLM's environment, four requests at a time."""
    from leapdecode.integrations.vllm_run import VllmRun, run_in_subprocess

    return run_in_subprocess(
        VllmRun(model=model, prompts=prompts, max_tokens=max_tokens, method=method, concurrency=4, max_model_len=1024),
        python=str(python),
    )


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory: pytest.TempPathFactory, real_lm) -> str:
    """A tiny random Llama (head size 32, as vLLM's CPU attention needs) with the real tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(real_lm.tokenizer),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
    )
    folder = tmp_path_factory.mktemp("tiny-vllm")
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    real_lm.tokenizer.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def tiny_plain(tiny_folder: str, vllm_python: Path):
    """Ten prompts of different lengths, some repetitive, and vLLM's output without speculation;
    four slots, so requests finish and new ones take their slots."""
    rng = random.Random(1)
    prompts = [[rng.randrange(100, 4000) for _ in range(rng.randint(3, 40))] * rng.randint(1, 3) for _ in range(10)]
    max_tokens = [rng.randint(8, 48) for _ in prompts]
    return prompts, max_tokens, run_vllm(vllm_python, tiny_folder, prompts, max_tokens, None)


@pytest.mark.parametrize("method", ["anpd:n=3,k=5", "suffix:k=6"])
def test_vllm_greedy_with_our_proposer_equals_no_speculation_tiny(
    tiny_folder: str, tiny_plain, method: str, vllm_python: Path
) -> None:
    prompts, max_tokens, plain = tiny_plain
    ours = run_vllm(vllm_python, tiny_folder, prompts, max_tokens, method)
    assert ours.outputs == plain.outputs
    assert ours.counters["vllm:spec_decode_num_accepted_tokens"] > 0


def test_vllm_greedy_with_anpd_equals_no_speculation_smollm2(real_lm, vllm_python: Path) -> None:
    from leapdecode.models.loading import huggingface_source

    texts = [
        "def fibonacci(n):",
        "Summarise: the cat sat on the mat. The cat sat on the mat again.",
        "List the planets of the solar system.",
        "class Stack:\n    def push(self, x):\n        self.items.append(x)\n",
        "Q: What is 2+2?\nA:",
        "Translate to French: good morning",
        "import numpy as np\n\ndef mean(xs):",
        "Write a haiku about the sea.",
        'def is_prime(n):\n    """Return True if n is prime."""\n',
    ]
    prompts = [real_lm.tokenizer(t)["input_ids"] for t in texts]
    max_tokens = [24 + 4 * i for i in range(len(prompts))]
    source = huggingface_source("smollm2-135m")
    plain = run_vllm(vllm_python, source, prompts, max_tokens, None)
    ours = run_vllm(vllm_python, source, prompts, max_tokens, "anpd")
    assert ours.outputs == plain.outputs
    assert ours.counters["vllm:spec_decode_num_accepted_tokens"] > 0
    assert ours.mean_acceptance_length > 1.0


def test_vllm_serve_answers_with_our_drafts(tmp_path: Path, real_lm, vllm_python: Path) -> None:
    """`leapdecode vllm-serve` starts vLLM's OpenAI server with our proposer: a completion comes
    back, and vLLM's /metrics counts accepted drafted tokens."""
    import socket
    import subprocess
    import time

    import httpx

    from leapdecode.integrations.vllm_run import VLLM_CPU_ENV

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    from leapdecode.models.loading import huggingface_source

    folder = huggingface_source("smollm2-135m")  # the preset is resolved here: vLLM's venv need not install it
    # every draft goes to vLLM: the cost-aware cut follows vLLM's step time fitted as it runs, and
    # on a busy machine it may rightly keep no draft in 48 tokens (the cut has its own tests)
    command = [
        str(vllm_python),
        "-m",
        "leapdecode",
        "vllm-serve",
        "-m",
        folder,
        "--method",
        "anpd:k=5,cost_aware=false",
        "--port",
        str(port),
        "--max-model-len",
        "1024",
        "--enforce-eager",
        "--served-model-name",
        "smol",
    ]
    log = tmp_path / "serve.log"  # a file, not a pipe: vLLM logs enough to fill a pipe and block
    server = subprocess.Popen(
        command,
        env={**VLLM_CPU_ENV, **os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "1"},
        stdout=subprocess.DEVNULL,
        stderr=log.open("w"),
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            assert server.poll() is None, f"vllm-serve exited: {log.read_text()[-2000:]}"
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(2)
        else:
            pytest.fail("vllm-serve did not become healthy in 300 s")
        body = {
            "model": "smol",
            "prompt": "def fibonacci(n):\n    if n < 2:\n        return n\n",
            "max_tokens": 48,
            "temperature": 0,
        }
        reply = httpx.post(f"{base}/v1/completions", json=body, timeout=120)
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 48
        for bad in (
            {"model": "smol", "prompt": "x", "max_tokens": -1},
            {"model": "nope", "prompt": "x", "max_tokens": 4},
            {"model": "smol", "prompt": "hello " * 2000, "max_tokens": 4},
        ):
            assert 400 <= httpx.post(f"{base}/v1/completions", json=bad, timeout=60).status_code < 500, bad
        assert httpx.get(f"{base}/health", timeout=5).status_code == 200  # bad requests leave it serving
        accepted: list[float] = []
        for _ in range(10):  # the engine's statistics may reach the front end's /metrics after its reply
            metrics = httpx.get(f"{base}/metrics", timeout=10).text
            accepted = [
                float(line.split()[-1])
                for line in metrics.splitlines()
                if line.startswith("vllm:spec_decode_num_accepted_tokens_total")
            ]
            if accepted and accepted[0] > 0:
                break
            time.sleep(1)
        assert accepted and accepted[0] > 0
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
