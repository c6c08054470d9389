"""Verifiers: pure functions over tensors that decide which drafted tokens are kept.

`leapdecode.verifiers.verdict` defines p, q, accepted, rejected and bonus tokens once for all.
"""

from leapdecode.engine.sampling import SamplingParams, logits_to_probs
from leapdecode.engine.verdict import TokenLogprob, Verdict
from leapdecode.verifiers.greedy import verify_greedy
from leapdecode.verifiers.sampling import verify_speculative
from leapdecode.verifiers.tree import verify_tree_greedy, verify_tree_speculative

__all__ = [
    "SamplingParams",
    "TokenLogprob",
    "Verdict",
    "logits_to_probs",
    "verify_greedy",
    "verify_speculative",
    "verify_tree_greedy",
    "verify_tree_speculative",
]
