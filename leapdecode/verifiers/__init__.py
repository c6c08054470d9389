"""Verifiers: pure functions over tensors that decide which drafted tokens are kept."""

from leapdecode.verifiers.greedy import verify_greedy
from leapdecode.verifiers.sampling import SamplingParams, logits_to_probs, verify_speculative
from leapdecode.verifiers.tree import verify_tree_greedy, verify_tree_speculative

__all__ = [
    "SamplingParams", "logits_to_probs", "verify_greedy", "verify_speculative", "verify_tree_greedy", "verify_tree_speculative",
]
