"""The verdict on one pass (`engine.verdict`, the engine's type) and the helpers every verifier shares.

Names used by every verifier in this package:
- p: the target model's distribution at each scored position (from `target_logits`);
- q: the drafter's distribution (None for a deterministic drafter: one-hot on its token);
- drafted tokens d_1..d_D follow the last accepted token; the target scores D+1 positions
  (the pending token, then each drafted token);
- accepted tokens: the drafted tokens the target keeps (a prefix of a chain; one root-to-node
  path of a tree);
- rejected tokens: every other drafted token, discarded with its KV-cache entries;
- bonus token: the target's own token after the last accepted one, always emitted, so that
  every forward pass yields at least one token.

Each verifier makes exactly one device-to-host transfer: everything the decode loop needs next
(the accepted path, the emitted tokens, the target's greedy token at every scored row for
drafters that learn from it, and on request the log-probabilities of the emitted tokens) comes
back in that one copy.

Log-probabilities are those of the model's own distribution (log-softmax of the raw logits, before
temperature, top-k or top-p), as vLLM reports them by default.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from leapdecode.engine.verdict import TokenLogprob

MAX_TOP_LOGPROBS = 20  # the OpenAI API's bound on top_logprobs


def host_tokens(draft_tokens: Sequence[int] | torch.Tensor) -> list[int]:
    """Drafted tokens as a host list (the loop passes lists; a tensor is accepted for convenience)."""
    return draft_tokens.tolist() if isinstance(draft_tokens, torch.Tensor) else list(draft_tokens)


def log_probs(target_logits: torch.Tensor) -> torch.Tensor:  # [D+1, vocab]
    """The model's own log-distribution at every scored row, in float32 whatever the model's dtype."""
    return torch.log_softmax(target_logits.float(), dim=-1)


def top_logprobs(logp: torch.Tensor, top: int) -> torch.Tensor:  # [(D+1) * 2 * top], float64
    """The `top` best (logprob, token) pairs of every row, flattened for the one host transfer
    (token ids are exact in float64)."""
    if top <= 0:
        return logp.new_empty(0, dtype=torch.float64)
    values, ids = logp.topk(top, dim=-1)  # [D+1, top] each
    return torch.cat([values.double(), ids.double()], dim=-1).flatten()


def greedy_transfer(
    target_logits: torch.Tensor,
    argmax: torch.Tensor,
    logprobs: int | None,
    candidates: int,
) -> tuple[list[int], list[float]]:
    """The greedy verifiers' one device-to-host copy: every row's argmax ([D+1]), then on request
    the argmax's log-probability per row and each row's top `logprobs` (`top_logprobs`), then each
    row's `candidates` best ids (`candidate_ids`). Returns (predicted, the whole copy)."""
    if logprobs is None and not candidates:
        return argmax.tolist(), []
    parts = [argmax.double()]
    if logprobs is not None:
        logp = log_probs(target_logits)  # [D+1, vocab]
        parts += [logp.gather(-1, argmax[:, None])[:, 0].double(), top_logprobs(logp, logprobs)]
    if candidates:
        parts.append(candidate_ids(target_logits, candidates))
    host = torch.cat(parts).tolist()
    return [int(t) for t in host[: len(argmax)]], host


def candidate_ids(target_logits: torch.Tensor, k: int) -> torch.Tensor:  # [(D+1) * k], float64
    """The `k` best token ids of every row, flattened for the one host transfer."""
    return target_logits.topk(k, dim=-1).indices.double().flatten()


def split_candidates(host_tail: Sequence[float], rows: int, k: int) -> list[list[int]]:
    """`candidate_ids`'s output, copied to the host, back to [rows][k] ints."""
    return [[int(t) for t in host_tail[r * k : (r + 1) * k]] for r in range(rows)]


def emitted_logprobs(
    tokens: Sequence[int],
    rows: Sequence[int],
    chosen: Sequence[float],
    top_flat: Sequence[float],
    top: int,
) -> list[TokenLogprob]:
    """Assemble the host-side record: emitted token j was scored at row `rows[j]` with log-probability
    `chosen[j]`; `top_flat` is `top_logprobs`'s output, copied to the host."""
    out = []
    for token, row, logprob in zip(tokens, rows, chosen, strict=True):
        pairs = top_flat[row * 2 * top : (row + 1) * 2 * top]
        out.append(
            TokenLogprob(
                int(token), float(logprob), tuple((int(t), float(v)) for v, t in zip(pairs[:top], pairs[top:]))
            )
        )
    return out
