"""The engine: the backend interface, the one decode loop, stop criteria and statistics."""

from leapdecode.engine.backend import Backend, Scores, Sequence, TorchBackend, keep_cache_entries, rollback_cache
from leapdecode.engine.loop import Step, TreeVerifier, Verifier, decode
from leapdecode.engine.stats import GenerationStats
from leapdecode.engine.stopping import StopCriteria, truncate_at_stop
from leapdecode.engine.tree import TreeLayout, chain_parents, compile_tree

__all__ = [
    "Backend", "GenerationStats", "Scores", "Sequence", "Step", "StopCriteria", "TorchBackend", "TreeLayout",
    "TreeVerifier", "Verifier", "chain_parents", "compile_tree", "decode", "keep_cache_entries", "rollback_cache",
    "truncate_at_stop",
]
