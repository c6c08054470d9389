"""The greedy verifier on hand-made logits."""

from __future__ import annotations

import torch

from leapdecode.verifiers import verify_greedy


def logits_for(argmaxes: list[int], vocab: int = 10) -> torch.Tensor:
    logits = torch.zeros(len(argmaxes), vocab)
    logits[torch.arange(len(argmaxes)), torch.tensor(argmaxes)] = 5.0
    return logits


def test_all_accepted_gives_every_draft_plus_the_bonus() -> None:
    verdict = verify_greedy(torch.tensor([3, 4, 5]), logits_for([3, 4, 5, 6]))
    assert verdict.num_accepted == 3 and verdict.tokens == [3, 4, 5, 6]


def test_first_rejected_gives_only_the_targets_token() -> None:
    verdict = verify_greedy(torch.tensor([3, 4, 5]), logits_for([2, 4, 5, 6]))
    assert verdict.num_accepted == 0 and verdict.tokens == [2]


def test_partial_acceptance_stops_at_the_first_mismatch_even_if_later_ones_match() -> None:
    verdict = verify_greedy(torch.tensor([3, 9, 5]), logits_for([3, 4, 5, 6]))
    assert verdict.num_accepted == 1 and verdict.tokens == [3, 4]


def test_no_draft_is_plain_decoding() -> None:
    verdict = verify_greedy(torch.tensor([], dtype=torch.long), logits_for([7]))
    assert verdict.num_accepted == 0 and verdict.tokens == [7]
