"""The engine: the backend interface, the one decode loop, stop criteria and statistics."""

from leapdecode.engine.alone import decode
from leapdecode.engine.backend import Backend, CacheState, Scores, TorchBackend, keep_cache_entries, rollback_cache
from leapdecode.engine.loop import Step, TreeVerifier, Verifier
from leapdecode.engine.sampling import SamplingParams, logits_to_probs
from leapdecode.engine.stats import GenerationStats
from leapdecode.engine.stopping import StopCriteria, truncate_at_stop
from leapdecode.engine.tree import TreeLayout, TreeMaskBuffer, chain_parents, compile_tree

__all__ = [
    "Backend",
    "GenerationStats",
    "SamplingParams",
    "CacheState",
    "Scores",
    "Step",
    "StopCriteria",
    "TorchBackend",
    "TreeLayout",
    "TreeMaskBuffer",
    "TreeVerifier",
    "Verifier",
    "chain_parents",
    "compile_tree",
    "decode",
    "keep_cache_entries",
    "logits_to_probs",
    "rollback_cache",
    "truncate_at_stop",
]
