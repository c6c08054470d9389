"""State belongs to the request: nothing per-request on shared objects, no progress on stdout,
per-model files keyed by the weights, and the hot path's per-step work proportional to the draft."""

from __future__ import annotations

import copy

import torch

from leapdecode.api import Decoder
from leapdecode.engine import TreeMaskBuffer, compile_tree
from leapdecode.models import LoadedModel
from tests.helpers import make_tiny_model, tiny_lm


def test_tree_mask_buffer_equals_the_whole_mask_pass_after_pass() -> None:
    """The buffer writes only the draft's block and clears the last one: every mask it returns
    equals the one built whole, as the context grows, trees change shape and the buffer grows."""
    buffer = TreeMaskBuffer()
    shapes = [(-1, -1, 0, 1), (-1, 0, 1), (-1, -1, -1, 0, 0, 1, 3), (), (-1,), (-1, 0, 0, 1, 1, 2, 2)]
    past = 5
    for round_ in range(40):
        tree = compile_tree(shapes[round_ % len(shapes)])
        got = buffer.mask(tree, past, torch.float32, torch.device("cpu"))
        want = tree.attention_mask(past, torch.float32, torch.device("cpu"))
        assert got.shape == want.shape and torch.equal(got, want), (round_, past)
        past += 1 + round_ % 4 + (200 if round_ == 30 else 0)  # accepted tokens; once a jump past the buffer


def test_decoder_writes_nothing_to_stdout(capsys) -> None:
    """Progress (here: measuring forward cost for cost-aware drafting) goes to the logger."""
    lm = tiny_lm(make_tiny_model())
    decoder = Decoder(lm, "pld:k=3,cost_aware=true")
    decoder.generate([5, 6, 7, 5, 6], max_new_tokens=8)
    assert capsys.readouterr().out == ""


def test_decoder_passes_progress_to_its_log() -> None:
    lines: list[str] = []
    Decoder(tiny_lm(make_tiny_model()), "anpd:k=3,cost_aware=true", log=lines.append)
    assert any("forward cost" in line for line in lines)


def test_fingerprint_follows_the_weights_not_the_name(tmp_path) -> None:
    a, b = make_tiny_model(seed=0), make_tiny_model(seed=1)
    same = copy.deepcopy(a)
    fa, fb, fsame = (tiny_lm(m).fingerprint for m in (a, b, same))
    assert fa == fsame and fa != fb
    a.save_pretrained(tmp_path / "saved")
    from transformers import AutoModelForCausalLM

    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "saved")
    assert LoadedModel(reloaded, None, "another name", frozenset(), 512).fingerprint == fa


def test_hf_assisted_peer_leaves_the_shared_draft_model_alone() -> None:
    from leapdecode.bench.peers import HfRunner
    from leapdecode.methods import parse_method

    target, draft = make_tiny_model(seed=0), make_tiny_model(seed=1)
    before = draft.generation_config.to_dict()

    lm, draft_lm = tiny_lm(target), tiny_lm(draft)
    runner = HfRunner(lm, parse_method("hf-assisted:model=d,tokens=7,threshold=0.2"), draft_lm)
    assert draft.generation_config.to_dict() == before
    view = runner.kwargs["assistant_model"]
    assert view.generation_config.num_assistant_tokens == 7 and view.model is draft.model
    out = runner.run([3, 4, 5, 3, 4], 6)
    assert len(out.token_ids) == 6 and draft.generation_config.to_dict() == before


class CountTransfers(torch.overrides.TorchFunctionMode):
    """Counts the calls that copy a tensor's values to the host."""

    HOST = {torch.Tensor.tolist, torch.Tensor.item, torch.Tensor.__bool__, torch.Tensor.__int__, torch.Tensor.__float__}

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        if func in self.HOST:
            self.count += 1
        return func(*args, **(kwargs or {}))


def test_every_verifier_makes_one_host_transfer() -> None:
    import functools

    from leapdecode.engine.noise import PositionNoise
    from leapdecode.engine.sampling import SamplingParams
    from leapdecode.verifiers import verify_greedy, verify_speculative, verify_tree_greedy, verify_tree_speculative

    g = PositionNoise(0)
    logits = torch.randn(5, 50)  # [D+1, vocab]
    tree = compile_tree((-1, -1, 0, 2))
    params = SamplingParams(temperature=0.8, top_p=0.9)
    calls = {
        "greedy": lambda: verify_greedy([3, 4, 5, 6], logits),
        "speculative": lambda: verify_speculative([3, 4, 5, 6], logits, None, params, g, position=3),
        "speculative with q": lambda: verify_speculative(
            [3, 4, 5, 6], logits, torch.softmax(torch.randn(4, 50), -1), params, g, position=3
        ),
        "speculative, logprobs": lambda: verify_speculative(
            [3, 4, 5, 6], logits, None, params, g, position=3, logprobs=2
        ),
        "tree greedy": lambda: verify_tree_greedy([3, 4, 5, 6], tree, logits),
        "greedy, candidates and logprobs": lambda: verify_greedy([3, 4, 5, 6], logits, logprobs=2, candidates=4),
        "tree greedy, candidates": lambda: verify_tree_greedy([3, 4, 5, 6], tree, logits, candidates=4),
        "tree speculative": functools.partial(
            verify_tree_speculative, [3, 4, 5, 6], tree, logits, params, g, position=3
        ),
        "tree speculative, logprobs": functools.partial(
            verify_tree_speculative, [3, 4, 5, 6], tree, logits, params, g, position=3, logprobs=2
        ),
    }
    for name, call in calls.items():
        with CountTransfers() as counter:
            verdict = call()
        assert counter.count == 1, f"{name}: {counter.count} transfers"
        assert len(verdict.predicted) == 5 and len(verdict.tokens) == len(verdict.path) + 1
