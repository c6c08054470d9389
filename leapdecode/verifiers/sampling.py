"""Speculative sampling: drafted tokens kept so that the output has exactly the target's distribution.

Names as in `leapdecode.verifiers.greedy`: p is the target distribution, q the drafter's
(one-hot on the drafted token for a deterministic drafter such as ANPD or prompt lookup);
accepted, rejected and bonus tokens as defined there.

The rule (Leviathan et al. 2211.17192; Chen et al. 2302.01318): drafted token x at position i is
accepted with probability min(1, p_i(x) / q_i(x)); at the first rejection, the emitted token is
drawn from norm(max(0, p_i - q_i)) and the rest of the draft is discarded; when every drafted
token is accepted, the bonus token is drawn from p at the next position. Temperature, top-k and
top-p shape p and q alike, in Hugging Face `generate`'s order (temperature, then top-k, then top-p).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from leapdecode.errors import InputError


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 means greedy decoding (as in the OpenAI API); top_k 0 and top_p 1 mean off."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        if not (isinstance(self.temperature, (int, float)) and 0.0 <= self.temperature <= 100.0):
            raise InputError(f"temperature must be between 0 and 100, got {self.temperature!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise InputError(f"top_k must be a non-negative integer, got {self.top_k!r}")
        if not (isinstance(self.top_p, (int, float)) and 0.0 < self.top_p <= 1.0):
            raise InputError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise InputError(f"seed must be an integer, got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[n, vocab] logits -> [n, vocab] probabilities after temperature, top-k and top-p."""
    scores = logits.float() / params.temperature
    if params.top_k and params.top_k < scores.shape[-1]:
        kth = torch.topk(scores, params.top_k, dim=-1).values[..., -1:]  # [n, 1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, dim=-1, descending=True)  # [n, vocab]
        cumulative = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
        # drop a token when the tokens before it already reach top_p (the first one always stays)
        drop_sorted = (cumulative - sorted_scores.softmax(dim=-1)) >= params.top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        scores = scores.masked_fill(drop, float("-inf"))
    return scores.softmax(dim=-1)


def verify_speculative(
    draft_tokens: torch.Tensor,  # [D] long
    target_logits: torch.Tensor,  # [D+1, vocab]
    draft_probs: torch.Tensor | None,  # [D, vocab] q, already shaped by the same params; None = one-hot
    params: SamplingParams,
    generator: torch.Generator | None = None,
) -> tuple[int, torch.Tensor]:
    """Returns (A, tokens) with tokens = [d_1..d_A, last] where `last` is the residual sample at
    the first rejection, or the bonus token drawn from p when all D drafts were accepted."""
    p = logits_to_probs(target_logits, params)  # [D+1, vocab]
    num_drafted = draft_tokens.shape[0]
    if num_drafted:
        positions = torch.arange(num_drafted, device=p.device)
        p_x = p[positions, draft_tokens]  # [D]
        q_x = draft_probs[positions, draft_tokens] if draft_probs is not None else torch.ones_like(p_x)
        u = torch.rand(num_drafted, device=p.device, generator=generator)  # [D]
        rejected = u * q_x >= p_x  # reject unless u < p(x) / q(x)
        num_accepted = int(rejected.int().argmax()) if bool(rejected.any()) else num_drafted
    else:
        num_accepted = 0
    if num_accepted < num_drafted:
        q_row = (
            draft_probs[num_accepted]
            if draft_probs is not None
            else torch.nn.functional.one_hot(draft_tokens[num_accepted], p.shape[-1]).to(p.dtype)
        )
        residual = (p[num_accepted] - q_row).clamp_min(0.0)  # [vocab]
        total = residual.sum()
        dist = residual / total if float(total) > 0 else p[num_accepted]
    else:
        dist = p[num_drafted]  # the bonus position
    last = torch.multinomial(dist, 1, generator=generator)  # [1]
    return num_accepted, torch.cat([draft_tokens[:num_accepted], last])
