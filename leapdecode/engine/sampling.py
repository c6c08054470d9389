"""How a request samples: temperature, top-k and top-p, and the distribution p they shape.

Shared by the verifiers (p at every scored position), the drafters that sample their own
drafts (q), and the slow sampling reference.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from leapdecode.errors import RequestError

# Below this a temperature is greedy decoding (vLLM's rule): logits divided by a tinier one
# overflow float32, and a distribution of NaNs would sample a token that does not exist.
MIN_TEMPERATURE = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 (or below `MIN_TEMPERATURE`) means greedy decoding (as in the OpenAI API);
    top_k 0 and top_p 1 mean off."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        if not (isinstance(self.temperature, (int, float)) and 0.0 <= self.temperature <= 100.0):
            raise RequestError(f"temperature must be between 0 and 100, got {self.temperature!r}", "temperature")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise RequestError(f"top_k must be a non-negative integer, got {self.top_k!r}", "top_k")
        if not (isinstance(self.top_p, (int, float)) and 0.0 < self.top_p <= 1.0):
            raise RequestError(f"top_p must be in (0, 1], got {self.top_p!r}", "top_p")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise RequestError(f"seed must be an integer, got {self.seed!r}", "seed")

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_TEMPERATURE


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
        drop_sorted[..., 0] = False  # even where top_p rounds to 0 in float32 (a denormal such as 5e-324)
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        scores = scores.masked_fill(drop, float("-inf"))
    return scores.softmax(dim=-1)
