"""The engine: the backend interface, the one decode loop, stop criteria and statistics."""

from leapdecode.engine.backend import Backend, Scores, Sequence, TorchBackend, rollback_cache
from leapdecode.engine.loop import Step, Verifier, decode
from leapdecode.engine.stats import GenerationStats
from leapdecode.engine.stopping import StopCriteria, truncate_at_stop

__all__ = [
    "Backend", "GenerationStats", "Scores", "Sequence", "Step", "StopCriteria", "TorchBackend",
    "Verifier", "decode", "rollback_cache", "truncate_at_stop",
]
