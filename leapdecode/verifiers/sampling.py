"""Speculative sampling: drafted tokens kept so that the output has exactly the target's distribution.

Names (p, q, accepted, rejected, bonus) as defined in `leapdecode.verifiers.verdict`. Randomness
is per output position (`leapdecode.engine.noise`): the target's token at position t is
`choose(p_t, u_t)`, with u_t from the request's seed and t alone.

Coupled verification (q is None: a deterministic drafter, whose q is one-hot, or a drafter that
chose its own tokens with the same u_t): a drafted token x_t is accepted iff it equals the
target's choice y_t = choose(p_t, u_t); the first y_t that differs is emitted instead. x_t is
accepted with probability p_t(x_t), and on rejection y_t ~ p_t restricted to tokens other than
x_t, which is norm(max(0, p_t - q_t)) for a one-hot q: the rule of Leviathan et al. and Chen et
al. (2211.17192, 2302.01318), realised so that the emitted tokens are those of plain sampling with
the same seed, whatever was drafted.

The min(1, p/q) rule (a drafter that returns its q, sampled from its own stream): x_t is accepted
with probability min(1, p_t(x_t) / q_t(x_t)), tested with the position's ACCEPT uniform; at the
first rejection the emitted token is drawn from norm(max(0, p_t - q_t)) with its RESIDUAL
uniform; when every drafted token is accepted, the bonus token is the target's choice at the next
position. Temperature, top-k and top-p shape p and q alike, in Hugging Face `generate`'s order
(`leapdecode.engine.sampling`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from leapdecode.engine.noise import PositionNoise, Stream, choose
from leapdecode.engine.sampling import SamplingParams, logits_to_probs
from leapdecode.engine.verdict import Verdict
from leapdecode.verifiers.verdict import emitted_logprobs, host_tokens, log_probs, top_logprobs

__all__ = ["SamplingParams", "logits_to_probs", "verify_speculative"]


def verify_speculative(
    draft_tokens: Sequence[int] | torch.Tensor,  # [D]
    target_logits: torch.Tensor,  # [D+1, vocab]
    draft_probs: torch.Tensor | None,  # [D, vocab] q, shaped by the same params; None: coupled
    params: SamplingParams,
    noise: PositionNoise,
    *,
    position: int,
    logprobs: int | None = None,
) -> Verdict:
    """Row i of `target_logits` decides output position `position + i`. The verdict's tokens are
    [d_1..d_A, last]: `last` is the target's choice at the first disagreement (coupled), the
    residual draw at the first rejection (min(1, p/q)), or the bonus token when all D drafts were
    accepted. Everything stays on the device until one final copy."""
    drafted = host_tokens(draft_tokens)
    num_drafted = len(drafted)
    p = logits_to_probs(target_logits, params)  # [D+1, vocab]
    predicted = target_logits.argmax(dim=-1)  # [D+1]
    rows = list(range(position, position + num_drafted + 1))
    chosen = choose(p, noise.uniforms(rows, Stream.TARGET, p.device))  # [D+1]: the target's token at each position
    draft = torch.tensor(drafted, dtype=torch.long, device=p.device)  # [D]
    if draft_probs is None:
        # [D+1]: the first position whose choice is not the drafted token (D when all agree)
        differs = torch.cat([chosen[:-1] != draft, torch.ones(1, dtype=torch.bool, device=p.device)])
        num_accepted = differs.int().argmax()
        last = chosen[num_accepted].view(1)  # [1]
    else:
        num_accepted, last = _min_ratio_rule(p, draft_probs, draft, chosen, noise, rows)
    parts = [num_accepted.view(1).double(), last.double(), predicted.double()]
    if logprobs is not None:
        logp = log_probs(target_logits)  # [D+1, vocab]
        drafted_logp = logp[torch.arange(num_drafted, device=p.device), draft]  # [D]
        parts += [drafted_logp.double(), logp[num_accepted, last].double(), top_logprobs(logp, logprobs)]
    host = torch.cat(parts).tolist()  # the one device-to-host transfer
    accepted = int(host[0])
    tokens = [*drafted[:accepted], int(host[1])]
    predicted_h = [int(t) for t in host[2 : num_drafted + 3]]
    if logprobs is None:
        return Verdict(list(range(accepted)), tokens, predicted_h)
    base = num_drafted + 3
    chosen_logp = [*host[base : base + accepted], host[base + num_drafted]]
    record = emitted_logprobs(tokens, range(accepted + 1), chosen_logp, host[base + num_drafted + 1 :], logprobs)
    return Verdict(list(range(accepted)), tokens, predicted_h, record)


def _min_ratio_rule(
    p: torch.Tensor,  # [D+1, vocab]
    q: torch.Tensor,  # [D, vocab]
    draft: torch.Tensor,  # [D]
    chosen: torch.Tensor,  # [D+1]: the target's own choice at each position (the bonus token's)
    noise: PositionNoise,
    rows: list[int],  # the D+1 output positions
) -> tuple[torch.Tensor, torch.Tensor]:
    """(number accepted [], emitted last token [1]) under min(1, p/q), on the device."""
    num_drafted = len(draft)
    index = torch.arange(num_drafted, device=p.device)
    p_x, q_x = p[index, draft], q[index, draft]  # [D]
    u = noise.uniforms(rows[:-1], Stream.ACCEPT, p.device)  # [D]
    # [D+1]: reject unless u < p(x)/q(x); a True after the last row makes "the first rejection" D when all pass
    rejected = torch.cat([u * q_x >= p_x, torch.ones(1, dtype=torch.bool, device=p.device)])
    num_accepted = rejected.int().argmax()
    residual = (p[:-1] - q).clamp_min(0.0)  # [D, vocab]
    total = residual.sum(-1, keepdim=True)  # [D, 1]
    residual = torch.where(total > 0, residual / total.clamp_min(1e-30), p[:-1])
    drawn = choose(residual, noise.uniforms(rows[:-1], Stream.RESIDUAL, p.device))  # [D]
    last = torch.cat([drawn, chosen[-1:]])[num_accepted].view(1)  # [1]
    return num_accepted, last
