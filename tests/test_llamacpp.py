"""The llama.cpp backend on the real `smollm2-135m` GGUF: lossless against its own plain decoding.

`make test` installs the `llamacpp` extra (llama-cpp-python, compiled from source), so these run
in CI; they are not skipped.
"""

from __future__ import annotations

import pytest
import torch

from leapdecode.api import wrap
from leapdecode.drafters import NoDrafter
from leapdecode.drafters.base import StreamDrafter
from leapdecode.engine import StopCriteria, decode
from leapdecode.engine.cost_measure import measure_forward_cost
from leapdecode.engine.llamacpp_backend import LlamaCppBackend
from leapdecode.engine.sampling import SamplingParams
from leapdecode.errors import MethodError, ModelLoadError
from leapdecode.models import load_model
from tests.helpers import GREEDY, ScriptedDrafter

pytestmark = [pytest.mark.llamacpp, pytest.mark.real_model]

PROMPTS = [
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "Summarize: The city council met on Tuesday to discuss the new park. Residents asked for more trees.",
    "for i in range(10):\n    print(i)\nfor j in range(10):\n   ",
    "Translate to French: the cat sleeps on the warm windowsill.",
]


@pytest.fixture(scope="module")
def cpp_lm():
    return load_model("smollm2-135m", backend="llama.cpp", log=lambda m: None)


def own_greedy(lm, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """llama-cpp-python's own greedy generation on the same GGUF: the backend's reference."""
    from llama_cpp import Llama

    llm = Llama(model_path=str(lm.model.path), n_ctx=1024, n_threads=lm.model.n_threads, verbose=False)
    out = []
    for token in llm.generate(prompt_ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0):
        out.append(int(token))
        if len(out) >= max_new_tokens:
            break
    return out


def encode(lm, text: str) -> list[int]:
    return lm.tokenizer(text, add_special_tokens=False)["input_ids"]


def run(lm, prompt_ids, drafter, max_new_tokens=24, eos=frozenset()):
    steps = list(decode(LlamaCppBackend(lm.model), prompt_ids, drafter, StopCriteria(eos, max_new_tokens), *GREEDY))
    return [t for s in steps for t in s.tokens], steps


@pytest.fixture(scope="module")
def references(cpp_lm):
    return {p: run(cpp_lm, encode(cpp_lm, p), NoDrafter())[0] for p in PROMPTS}


def test_plain_decoding_equals_llama_cpp_pythons_own(cpp_lm, references) -> None:
    for prompt in PROMPTS[:2]:
        assert references[prompt] == own_greedy(cpp_lm, encode(cpp_lm, prompt), 24)


@pytest.mark.parametrize(
    "method",
    [
        "anpd:n=5,k=7",
        "anpd:n=3,k=3,cost_aware=true",
        "pld",
        "pld:k=4,cost_aware=true",
        "jacobi",
        "anpd-tree",
        "trie",
        "lookahead",
    ],
)
def test_every_drafter_equals_plain_greedy_on_llama_cpp(cpp_lm, references, method) -> None:
    decoder = wrap(cpp_lm, method)
    for prompt in PROMPTS:
        got = decoder.generate(encode(cpp_lm, prompt), max_new_tokens=24)
        assert got.token_ids == references[prompt], (method, prompt)


@pytest.mark.parametrize("wrong_every", [0, 1, 2, 3])
def test_scripted_drafts_cut_the_cache_back_after_partial_acceptance(cpp_lm, references, wrong_every) -> None:
    for prompt in PROMPTS:
        reference = references[prompt]
        got, steps = run(cpp_lm, encode(cpp_lm, prompt), ScriptedDrafter(reference, 5, cpp_lm.vocab_size, wrong_every))
        assert got == reference
        if wrong_every == 0:
            assert len(steps) < len(reference)  # right drafts are accepted


def test_rollback_then_new_tokens_score_as_a_fresh_run(cpp_lm) -> None:
    backend = LlamaCppBackend(cpp_lm.model)
    ids = encode(cpp_lm, PROMPTS[0])
    seq, _ = backend.prefill(ids)
    backend.forward(seq, [11, 12, 13, 14])
    backend.rollback(seq, len(ids) + 1)  # keep one of the four
    again = backend.forward(seq, [20, 21]).logits
    fresh_seq, _ = backend.prefill(ids + [11])
    fresh = backend.forward(fresh_seq, [20, 21]).logits
    assert torch.equal(again.argmax(-1), fresh.argmax(-1))
    torch.testing.assert_close(again, fresh, atol=1e-2, rtol=1e-3)
    with pytest.raises(RuntimeError, match="newer prefill"):
        backend.forward(seq, [1])  # the first sequence's cache is gone


def test_eos_inside_a_draft_stops_exactly_there(cpp_lm, references) -> None:
    prompt = PROMPTS[2]
    reference = references[prompt]
    eos = reference[5]
    stop_at = reference.index(eos)
    got, _ = run(cpp_lm, encode(cpp_lm, prompt), ScriptedDrafter(reference, 8, cpp_lm.vocab_size), eos=frozenset({eos}))
    assert got == reference[: stop_at + 1]


def test_tree_branches_share_one_pass(cpp_lm, references) -> None:
    """A hand-made tree: the right path next to wrong siblings; the right one is kept."""
    from leapdecode.drafters import Draft

    prompt = PROMPTS[0]
    reference = references[prompt]

    class TwoBranches(StreamDrafter):
        def __init__(self) -> None:
            self.emitted = 0

        def reset(self, prompt_ids) -> None:
            self.emitted = 0

        def update(self, tokens, num_accepted) -> None:
            self.emitted += len(tokens)

        def propose(self, max_tokens):
            right = reference[self.emitted : self.emitted + 3]
            if len(right) < 3 or max_tokens < 3:
                return Draft()
            wrong = [(t + 1) % cpp_lm.vocab_size for t in right]
            # wrong[0] -> wrong[1]; right[0] -> right[1] -> right[2]; right[0] -> wrong[2]
            return Draft([wrong[0], right[0], wrong[1], right[1], right[2], wrong[2]], parents=(-1, -1, 0, 1, 3, 1))

    got, steps = run(cpp_lm, encode(cpp_lm, prompt), TwoBranches())
    assert got == reference
    assert max(s.num_accepted for s in steps) == 3


def test_cost_curve_is_measured_on_the_backend(cpp_lm) -> None:
    cost = measure_forward_cost(LlamaCppBackend(cpp_lm.model), 4, context=16, repeats=1)
    assert len(cost.seconds) == 4 and all(b >= a for a, b in zip(cost.seconds, cost.seconds[1:]))


def test_layer_methods_and_hidden_states_are_refused_clearly(cpp_lm) -> None:
    for method in ("layerskip:exit=4", "calm", "self-spec:skip=3"):
        with pytest.raises(MethodError, match="torch backend"):
            wrap(cpp_lm, method)
    with pytest.raises(ModelLoadError, match="GGUF"):
        load_model("HuggingFaceTB/SmolLM2-135M-Instruct", backend="llama.cpp", log=lambda m: None)
    with pytest.raises(ModelLoadError, match="unknown backend"):
        load_model("smollm2-135m", backend="onnx", log=lambda m: None)


def test_chat_prompts_encode_the_same_on_both_backends(cpp_lm, real_lm) -> None:
    from leapdecode.api import encode_prompt

    messages = [{"role": "user", "content": "Write a haiku about tea."}]
    assert encode_prompt(cpp_lm, messages) == encode_prompt(real_lm, messages)
    assert cpp_lm.eos_token_ids == real_lm.eos_token_ids


def test_server_on_the_llama_cpp_backend(cpp_lm, references) -> None:
    from fastapi.testclient import TestClient

    from leapdecode.server.app import ServerConfig, create_app

    app = create_app(
        cpp_lm, ServerConfig(model_name="smollm2-cpp", default_method="anpd:cost_aware=true", max_queue=2, timeout_s=60)
    )
    with TestClient(app) as client:
        body = {"model": "smollm2-cpp", "prompt": PROMPTS[0], "max_tokens": 24, "temperature": 0}
        resp = client.post("/v1/completions", json=body)
        assert resp.status_code == 200, resp.text
        assert resp.json()["usage"]["completion_tokens"] == len(references[PROMPTS[0]])
        assert resp.json()["choices"][0]["text"] == cpp_lm.tokenizer.decode(
            references[PROMPTS[0]], skip_special_tokens=True
        )


def test_a_long_draft_scores_bit_for_bit_as_single_tokens(cpp_lm) -> None:
    """Chunks of the probed exact batch: 9 tokens in one forward equal 9 one-token passes."""
    backend = LlamaCppBackend(cpp_lm.model)
    ids = encode(cpp_lm, PROMPTS[1])
    assert backend.exact_batch(len(ids) + 9) >= 1
    tokens = encode(cpp_lm, " The council also voted on a new budget for the library")[:9]
    seq, _ = backend.prefill(ids)
    batched = backend.forward(seq, tokens).logits
    seq, _ = backend.prefill(ids)
    singles = torch.stack([backend.forward(seq, [t]).logits[0] for t in tokens])
    assert torch.equal(batched, singles)


def test_logprobs_on_llama_cpp_agree_with_pytorch(cpp_lm, real_lm) -> None:
    """The same quantity from both backends: the Q8 GGUF's log-probabilities are close to float32's."""
    prompt = "def fibonacci(n):\n"
    cpp = wrap(cpp_lm, "anpd").generate(prompt, max_new_tokens=12, logprobs=2)
    ref = wrap(real_lm, "anpd").generate(prompt, max_new_tokens=12, logprobs=2)
    assert len(cpp.logprobs) == len(cpp.token_ids) and [r.token for r in cpp.logprobs] == cpp.token_ids
    shared = next((i for i, (a, b) in enumerate(zip(cpp.token_ids, ref.token_ids)) if a != b), len(cpp.token_ids))
    assert shared >= 4
    for a, b in zip(cpp.logprobs[:shared], ref.logprobs[:shared]):
        assert a.logprob == pytest.approx(b.logprob, abs=0.25)
        assert a.top[0][0] == a.token


def test_long_contexts_score_exactly_or_draft_nothing(cpp_lm) -> None:
    """llama.cpp's batched attention differs from one-token decoding past 256 cached cells (up to
    ~1 logit): at every length the backend scores a draft in chunks it probed exact, and where
    none is exact the loop drafts nothing; so a long repetitive prompt decodes as plain decoding."""
    backend = LlamaCppBackend(cpp_lm.model)
    ladder = cpp_lm.model.exact_batches
    assert ladder and all(1 <= batch <= 8 for _, batch in ladder)
    batches = [backend.exact_batch(cells) for cells in range(1, 1100, 7)]
    assert batches == sorted(batches, reverse=True)  # never grows with the context
    text = "The quick brown fox jumps over the lazy dog. " * 100
    ids = encode(cpp_lm, text)[:700]
    for length in (100, 300, 650):
        seq, _ = backend.prefill(ids[:length])
        tokens = ids[length : length + 6]
        batched = backend.forward(seq, tokens).logits
        seq, _ = backend.prefill(ids[:length])
        singles = torch.stack([backend.forward(seq, [t]).logits[0] for t in tokens])
        assert torch.equal(batched, singles), length
    plain = run(cpp_lm, ids, NoDrafter(), 24)[0]
    got = wrap(cpp_lm, "anpd").generate(ids, max_new_tokens=24)
    assert got.token_ids == plain
    assert all(s.drafted == () for s in got.steps) == (backend.exact_batch(len(ids) + 8) == 1)


def test_llama_cpps_own_speculative_decoding_runs_as_a_peer(cpp_lm, references) -> None:
    """`llama-cpp-spec` (llama-speculative-simple, `make llamacpp-tools`) with the model as its own
    draft: every drafted token accepted, the text plain greedy decoding's, llama.cpp's counts."""
    from leapdecode.bench.llamacpp_tools import LlamaCppSpeculativeRunner
    from leapdecode.methods import parse_method

    runner = LlamaCppSpeculativeRunner(cpp_lm, parse_method("llama-cpp-spec:model=smollm2-135m,k=3"), cpp_lm)
    for prompt in PROMPTS[:2]:
        out = runner.run(encode(cpp_lm, prompt), 24)
        assert out.stats.new_tokens == 24 and out.stats.wall_time_s > 0
        assert out.stats.drafted_tokens > 0 and out.stats.accepted_tokens == out.stats.drafted_tokens
        assert out.token_ids[:16] == references[prompt][:16]  # its text re-encoded: the first tokens are exact
    with pytest.raises(MethodError, match="greedy only"):
        LlamaCppSpeculativeRunner(cpp_lm, parse_method("llama-cpp-spec:model=m"), cpp_lm, sampling=SamplingParams(0.7))


def test_llama_server_serves_the_same_load_as_a_throughput_peer(cpp_lm, references) -> None:
    """`llama-server` (`make llamacpp-tools`) with a slot per client, closed-loop clients: every
    prompt answered once, greedy, its tokens counted and checked against plain decoding's."""
    from pathlib import Path

    from leapdecode.bench.llamacpp_server import gguf_of, run_llama_server

    prompts = [encode(cpp_lm, p) for p in PROMPTS]
    want = [references[p][:16] for p in PROMPTS]
    for concurrency, solo in ((1, True), (2, False)):
        result = run_llama_server(Path(cpp_lm.model.path), prompts, 16, concurrency, want, 1, solo=solo)
        assert result.concurrency == ("solo" if solo else "2") and result.requests == len(PROMPTS)
        assert len(result.latencies_s) == len(PROMPTS) and result.wall_s > 0
        assert all(1 <= len(t) <= 16 for t in result.outputs)  # it stops at the model's end of text
        assert [t[:1] for t in result.outputs] == [w[:1] for w in want]  # greedy: its first token is the model's
        assert result.identical == sum(a == b for a, b in zip(result.outputs, want))
        assert result.cached_tokens == 0 and result.prompt_tokens == sum(map(len, prompts))  # no cache_prompt
    # with cache_prompt, a prompt that begins with the last one's takes it from the slot (`timings.cache_n`);
    # the first takes the first 8 tokens of the server's warm-up request, its own first 8
    longer = [prompts[1], prompts[1] + prompts[3]]
    cached = run_llama_server(Path(cpp_lm.model.path), longer, 4, 1, [[], []], 1, cache_prompt=True)
    assert len(prompts[1]) <= cached.cached_tokens <= len(prompts[1]) + 8
    assert cached.prompt_tokens == sum(map(len, longer))
    assert gguf_of(str(cpp_lm.model.path), Path("/nonexistent")) == Path(cpp_lm.model.path)
    with pytest.raises(MethodError, match="GGUF"):
        gguf_of("some/hub-model", Path("/nonexistent"))


def test_a_build_known_to_crash_on_this_cpu_is_refused_before_any_pass() -> None:
    from leapdecode.errors import ModelLoadError
    from leapdecode.models.llamacpp import refuse_known_crash

    amx_build = "CPU : SSE3 = 1 | AVX512 = 1 | AMX_INT8 = 1 | OPENMP = 1 |"
    with pytest.raises(ModelLoadError, match="make llamacpp"):
        refuse_known_crash(amx_build, frozenset({"avx512f", "amx_tile", "amx_int8"}))
    refuse_known_crash(amx_build, frozenset({"avx512f"}))  # no AMX on the CPU: the build's AMX never runs
    refuse_known_crash("CPU : AVX512 = 1 | OPENMP = 1 |", frozenset({"amx_tile"}))  # built without AMX
