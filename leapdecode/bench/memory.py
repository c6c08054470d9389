"""Peak memory of one generation, for the benchmark's memory column.

Peak memory of a method = the parameters of the models it uses (target, plus a draft model)
+ the peak growth of the process's resident memory while it generates (KV caches, activations).
The process-wide RSS alone would charge every method for every model loaded in the run.
"""

from __future__ import annotations

import threading
from types import TracebackType

import psutil
import torch

from leapdecode.models import LoadedModel

MB = 1024 * 1024


def parameter_mb(model: torch.nn.Module) -> float:
    """Bytes held by a model's parameters and buffers, in MiB."""
    tensors = [*model.parameters(), *model.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors) / MB


def weights_mb(lm: LoadedModel) -> float:
    """Memory of a model's parameters: float tensors for PyTorch, the GGUF file for llama.cpp."""
    if lm.backend == "llama.cpp":
        from leapdecode.models.llamacpp import parameter_mb as gguf_mb

        return gguf_mb(lm.model)
    return parameter_mb(lm.model)


class PeakRss:
    """Samples the process's resident memory in a background thread; `growth_mb` is the peak
    above the level at entry. On CUDA the allocator's own peak counter is used instead."""

    def __init__(self, device: torch.device, interval_s: float = 0.002) -> None:
        self.device = device
        self.interval_s = interval_s
        self.growth_mb = 0.0
        self._process = psutil.Process()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._start = 0
        self._peak = 0

    def _poll(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._peak = max(self._peak, self._process.memory_info().rss)

    def __enter__(self) -> PeakRss:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            self._start = torch.cuda.memory_allocated(self.device)
            return self
        self._start = self._peak = self._process.memory_info().rss
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if self.device.type == "cuda":
            self.growth_mb = (torch.cuda.max_memory_allocated(self.device) - self._start) / MB
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._peak = max(self._peak, self._process.memory_info().rss)
        self.growth_mb = (self._peak - self._start) / MB
