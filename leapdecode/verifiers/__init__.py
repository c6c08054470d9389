"""Verifiers: pure functions over tensors that decide which drafted tokens are kept."""

from leapdecode.verifiers.greedy import verify_greedy

__all__ = ["verify_greedy"]
