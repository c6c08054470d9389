"""The small-batch linear swap: same outputs as `nn.Linear` for every row count, same
parameters and state dict, and the engine stays lossless on a swapped model."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from leapdecode.drafters import AnpdDrafter
from leapdecode.engine import StopCriteria, TorchBackend, decode
from leapdecode.engine.reference import greedy_reference
from leapdecode.models import SmallBatchLinear, use_small_batch_linear
from tests.helpers import GREEDY, make_tiny_model, prompts


@pytest.mark.parametrize("bias", [True, False])
def test_small_batch_linear_equals_linear_for_every_row_count(bias) -> None:
    torch.manual_seed(0)
    plain = nn.Linear(48, 80, bias=bias)
    holder = nn.Sequential(copy.deepcopy(plain))
    assert use_small_batch_linear(holder) == 1
    fast = holder[0]
    assert isinstance(fast, SmallBatchLinear)
    for rows in (1, 2, 3, 7, 16, 17, 40):
        x = torch.randn(1, rows, 48)
        torch.testing.assert_close(fast(x), plain(x), rtol=1e-5, atol=1e-5)
    x = torch.randn(2, 3, 48)  # batch > 1 flattens to 6 rows
    torch.testing.assert_close(fast(x), plain(x), rtol=1e-5, atol=1e-5)


def test_swap_keeps_parameters_and_state_dict() -> None:
    model = make_tiny_model("qwen2", seed=4)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    params = {id(p) for p in model.parameters()}
    swapped = use_small_batch_linear(model)
    assert swapped == 2 * 7 + 1  # q, k, v, o, gate, up, down per layer, and the LM head
    assert {id(p) for p in model.parameters()} == params
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
    assert use_small_batch_linear(model) == 0  # already swapped


def test_engine_on_a_swapped_model_is_lossless() -> None:
    original = make_tiny_model("llama", seed=5)
    swapped = copy.deepcopy(original)
    use_small_batch_linear(swapped)
    for prompt in prompts(6, seed=9):
        expected = greedy_reference(original, prompt, 30)
        steps = list(
            decode(TorchBackend(swapped), prompt, AnpdDrafter(n=3, k=6), StopCriteria(frozenset(), 30), *GREEDY)
        )
        assert [t for s in steps for t in s.tokens] == expected
