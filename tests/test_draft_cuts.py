"""A draft longer than the rows the backend verifies exactly is cut by the loop, and the drafter
hears that cut as it hears any other: every method that needs no files, with the loop's exact
limit forced below the drafts, decodes greedily as plain decoding does (in shared passes the
scheduler's cut goes through `Drafter.take`, which reports it the same way). Drafters that keep
state per drafted row (Token Recycling, `hybrid`, Jacobi, Lookahead, the cost-aware wrapper)
would otherwise read rows that were never scored."""

from __future__ import annotations

import pytest

from leapdecode import wrap
from leapdecode.drafters import Draft
from leapdecode.drafters.base import StreamDrafter
from leapdecode.drafters.cost_aware import CostAwareDrafter
from leapdecode.early_exit.backend import LayerBackend
from leapdecode.engine import StopCriteria, TorchBackend, decode
from leapdecode.engine.cost import ForwardCost
from leapdecode.engine.reference import greedy_reference
from leapdecode.methods import METHODS
from tests.helpers import GREEDY, draft_alone, hear_pass, prompts, start, tiny_lm

# Methods whose drafts are long (trees of 8+ nodes, chains of 5+), without cost-aware cutting so
# that the loop's cut is the only one; every other file-free lossless method runs as registered.
LONG = {
    "hybrid": "hybrid:cost_aware=false",
    "recycle": "recycle:cost_aware=false",
    "anpd": "anpd:cost_aware=false",
    "suffix": "suffix:cost_aware=false",
    "self-spec": "self-spec:skip=1,k=6",
    "layerskip": "layerskip:exit=1,k=6",
    "arctic-suffix": pytest.param("arctic-suffix", marks=pytest.mark.peers),
}  # the tiny models have two layers
FILE_FREE = [
    LONG.get(m.name, m.name) for m in METHODS if m.kind.lossless and not m.kind.peer and not m.kind.loads_files
]
EXTRA = ["hybrid", "jacobi:block=6", "lookahead:w=4,n=4"]  # cost-aware hybrid; longer Jacobi and Lookahead windows


@pytest.mark.parametrize("limit", [1, 2])
@pytest.mark.parametrize("spec", FILE_FREE + EXTRA)
def test_drafts_cut_to_the_exact_rows_keep_plain_greedy_output(tiny_model, spec, limit, monkeypatch) -> None:
    for backend in (TorchBackend, LayerBackend):
        monkeypatch.setattr(backend, "draft_limit", lambda self, seq: limit)
    decoder = wrap(tiny_lm(tiny_model), spec)
    for prompt in prompts(4, seed=7):
        expected = greedy_reference(tiny_model, prompt, 40)
        out = decoder.generate(prompt, max_new_tokens=40)
        assert out.token_ids == expected, f"{spec} prompt {prompt}"
        assert all(len(s.drafted) <= limit for s in out.steps)


class Recording(StreamDrafter):
    """A fixed wide tree (depth one: within any budget of at least one token); records the cuts it hears."""

    def __init__(self, length: int) -> None:
        self.length = length
        self.cuts: list[list[int]] = []

    def reset(self, prompt_ids) -> None:
        pass

    def propose(self, max_tokens: int) -> Draft:
        return Draft(list(range(5, 5 + self.length)), parents=(-1,) * self.length)

    def update(self, tokens, num_accepted: int) -> None:
        pass

    def hear(self, result) -> None:
        if result.kept is not None:
            self.cuts.append(list(result.kept))
        super().hear(result)


def test_the_loop_tells_the_drafter_of_its_cut(tiny_model) -> None:
    class Limited(TorchBackend):
        def draft_limit(self, seq):
            return 3

    drafter = Recording(8)
    steps = list(decode(Limited(tiny_model), prompts(1)[0], drafter, StopCriteria(frozenset(), 12), *GREEDY))
    assert all(len(s.drafted) <= 3 for s in steps)
    assert drafter.cuts and all(cut == [0, 1, 2] for cut in drafter.cuts)


def test_a_cost_aware_wrappers_cut_and_the_exact_rows_are_one_cut_that_the_inner_drafter_hears() -> None:
    inner = Recording(8)
    wrapper = CostAwareDrafter(inner, ForwardCost((1.0,) * 16))  # flat: every token pays, all eight kept
    start(wrapper, [1, 2])
    assert len(draft_alone(wrapper, 8)) == 8
    hear_pass(wrapper, [0], 0)
    assert len(draft_alone(wrapper, 8, exact=3)) == 3  # the backend verifies three rows exactly
    hear_pass(wrapper, [0], 0)
    assert inner.cuts == [list(range(8)), [0, 1, 2]] and wrapper.kept_lengths == [8, 3]
