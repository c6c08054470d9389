"""Speculative sampling: drafted tokens kept so that the output has exactly the target's distribution.

Names (p, q, accepted, rejected, bonus) as defined in `leapdecode.verifiers.verdict`; q is one-hot
on the drafted token for a deterministic drafter such as ANPD or prompt lookup.

The rule (Leviathan et al. 2211.17192; Chen et al. 2302.01318): drafted token x at position i is
accepted with probability min(1, p_i(x) / q_i(x)); at the first rejection, the emitted token is
drawn from norm(max(0, p_i - q_i)) and the rest of the draft is discarded; when every drafted
token is accepted, the bonus token is drawn from p at the next position. Temperature, top-k and
top-p shape p and q alike, in Hugging Face `generate`'s order (temperature, then top-k, then top-p;
`leapdecode.engine.sampling`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from leapdecode.engine.sampling import SamplingParams, logits_to_probs
from leapdecode.verifiers.verdict import Verdict, emitted_logprobs, host_tokens, log_probs, top_logprobs

__all__ = ["SamplingParams", "logits_to_probs", "verify_speculative"]


def verify_speculative(
    draft_tokens: Sequence[int] | torch.Tensor,  # [D]
    target_logits: torch.Tensor,  # [D+1, vocab]
    draft_probs: torch.Tensor | None,  # [D, vocab] q, already shaped by the same params; None = one-hot
    params: SamplingParams,
    generator: torch.Generator | None = None,
    *,
    logprobs: int | None = None,
) -> Verdict:
    """The verdict's tokens are [d_1..d_A, last], where `last` is the residual sample at the
    first rejection, or the bonus token drawn from p when all D drafts were accepted.

    Everything stays on the device until one final copy: the acceptance test for every drafted
    token, the residual distribution of every row (only the first rejected row's is used), and
    one sample from the chosen row; the random draws are the same as a step-by-step version's
    (D uniforms, then one multinomial)."""
    drafted = host_tokens(draft_tokens)
    num_drafted = len(drafted)
    p = logits_to_probs(target_logits, params)  # [D+1, vocab]
    predicted = target_logits.argmax(dim=-1)  # [D+1]
    if num_drafted:
        draft = torch.tensor(drafted, dtype=torch.long, device=p.device)  # [D]
        rows = torch.arange(num_drafted, device=p.device)
        q = draft_probs if draft_probs is not None else torch.nn.functional.one_hot(draft, p.shape[-1]).to(p.dtype)  # [D, vocab]
        p_x, q_x = p[rows, draft], q[rows, draft]  # [D]
        u = torch.rand(num_drafted, device=p.device, generator=generator)  # [D]
        # [D+1]: reject unless u < p(x)/q(x); a True after the last row makes "the first rejection" D when all pass
        rejected = torch.cat([u * q_x >= p_x, torch.ones(1, dtype=torch.bool, device=p.device)])
        num_accepted = rejected.int().argmax()  # first rejection, or D when all were accepted
        residual = (p[:-1] - q).clamp_min(0.0)  # [D, vocab]
        total = residual.sum(-1, keepdim=True)  # [D, 1]
        residual = torch.where(total > 0, residual / total.clamp_min(1e-30), p[:-1])
        dist = torch.cat([residual, p[-1:]])[num_accepted]  # [vocab]
    else:
        num_accepted = torch.zeros((), dtype=torch.long, device=p.device)
        dist = p[0]
    last = torch.multinomial(dist, 1, generator=generator)  # [1]
    parts = [num_accepted.view(1).double(), last.double(), predicted.double()]
    if logprobs is not None:
        logp = log_probs(target_logits)  # [D+1, vocab]
        drafted_logp = logp[rows, draft] if num_drafted else logp.new_empty(0)  # [D]
        parts += [drafted_logp.double(), logp[num_accepted, last].double(), top_logprobs(logp, logprobs)]
    host = torch.cat(parts).tolist()  # the one device-to-host transfer
    accepted = int(host[0])
    tokens = [*drafted[:accepted], int(host[1])]
    predicted_h = [int(t) for t in host[2 : num_drafted + 3]]
    if logprobs is None:
        return Verdict(list(range(accepted)), tokens, predicted_h)
    base = num_drafted + 3
    chosen = [*host[base : base + accepted], host[base + num_drafted]]
    record = emitted_logprobs(tokens, range(accepted + 1), chosen, host[base + num_drafted + 1 :], logprobs)
    return Verdict(list(range(accepted)), tokens, predicted_h, record)

