"""Slow references that every fast path is tested against.

`greedy_reference` recomputes the whole sequence without a KV cache at every step: quadratic,
obviously correct, and independent of the cache, drafter and verifier code.
`full_model_predictions` is the reference a lossy method is measured against: the full model's
greedy token after each prefix of a generated sequence (`agreement`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


@torch.inference_mode()
def greedy_reference(
    model: Any, prompt_ids: Sequence[int], max_new_tokens: int, eos_token_ids: Sequence[int] = ()
) -> list[int]:
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
def sample_reference(model: Any, prompt_ids: Sequence[int], max_new_tokens: int, params: Any, noise: Any) -> list[int]:
    """Plain sampling without a KV cache: the token at output position t is chosen from the
    shaped target distribution with the request's uniform u_t (`leapdecode.engine.noise`)."""
    from leapdecode.engine.noise import choose
    from leapdecode.engine.sampling import logits_to_probs

    ids = torch.tensor([list(prompt_ids)], dtype=torch.long, device=model.device)  # [1, T]
    generated: list[int] = []
    for position in range(max_new_tokens):
        probs = logits_to_probs(model(input_ids=ids, use_cache=False).logits[0, -1:], params)  # [1, vocab]
        token = int(choose(probs, noise.uniforms([position], device=probs.device))[0])
        generated.append(token)
        ids = torch.cat([ids, ids.new_tensor([[token]])], dim=1)
    return generated


def agreement(full_predictions: torch.Tensor, generated: torch.Tensor) -> float:
    """Fraction of generated tokens [T] equal to the full model's greedy predictions [T] for
    the same prefixes."""
    if generated.numel() == 0:
        return 1.0
    return float((full_predictions == generated).float().mean())


@torch.inference_mode()
def full_model_predictions(model: Any, prompt_ids: Sequence[int], generated: Sequence[int]) -> torch.Tensor:
    """The full model's greedy token at each generated position [T], teacher-forced on
    prompt + generated in one pass."""
    ids = torch.tensor([[*prompt_ids, *generated[:-1]]], dtype=torch.long, device=model.device)  # [1, P+T-1]
    logits = model(input_ids=ids, logits_to_keep=len(generated)).logits[0]  # [T, vocab]
    predictions: torch.Tensor = logits.argmax(-1)
    return predictions
