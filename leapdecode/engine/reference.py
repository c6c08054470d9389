"""Slow references that every fast path is tested against.

`greedy_reference` recomputes the whole sequence without a KV cache at every step: quadratic,
obviously correct, and independent of the cache, drafter and verifier code.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


@torch.inference_mode()
def greedy_reference(model: Any, prompt_ids: Sequence[int], max_new_tokens: int, eos_token_ids: Sequence[int] = ()) -> list[int]:
    ids = torch.tensor([list(prompt_ids)], dtype=torch.long, device=model.device)  # [1, T]
    generated: list[int] = []
    for _ in range(max_new_tokens):
        logits = model(input_ids=ids, use_cache=False).logits[0, -1]  # [vocab]
        token = int(logits.argmax())
        generated.append(token)
        if token in eos_token_ids:
            break
        ids = torch.cat([ids, ids.new_tensor([[token]])], dim=1)
    return generated


@torch.inference_mode()
def sample_reference(
    model: Any, prompt_ids: Sequence[int], max_new_tokens: int, params: Any, generator: torch.Generator | None = None
) -> list[int]:
    """Plain sampling without a KV cache: each token drawn from the shaped target distribution."""
    from leapdecode.verifiers.sampling import logits_to_probs

    ids = torch.tensor([list(prompt_ids)], dtype=torch.long, device=model.device)  # [1, T]
    generated: list[int] = []
    for _ in range(max_new_tokens):
        probs = logits_to_probs(model(input_ids=ids, use_cache=False).logits[0, -1:], params)  # [1, vocab]
        token = int(torch.multinomial(probs[0], 1, generator=generator))
        generated.append(token)
        ids = torch.cat([ids, ids.new_tensor([[token]])], dim=1)
    return generated
