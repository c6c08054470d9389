"""What the machine computes natively: the device to load onto and the CPU's features, which
decide the dtype a model runs in (`precision.resolve_precision`) and the kernels' paths."""

from __future__ import annotations

import platform

import torch

from leapdecode.models.precision import Hardware


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def cpu_name() -> str:
    """The CPU's model name as Linux reports it (elsewhere what `platform` says)."""
    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            return next((line.split(":", 1)[1].strip() for line in fh if line.startswith("model name")), name)
    except OSError:
        return name


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as Linux reports them (empty elsewhere)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def hardware_of(device: torch.device) -> Hardware:
    """What `device` computes natively: bfloat16 products on a CUDA GPU that supports them or a
    CPU with AVX512-BF16 or AMX; float16 on CUDA or a CPU with AVX512-FP16 or AMX-FP16. Elsewhere
    those types are emulated and slower than float32."""
    if device.type == "cuda":
        return Hardware("cuda", native_bf16=bool(torch.cuda.is_bf16_supported()), native_fp16=True)
    if device.type == "cpu":
        flags = cpu_flags()
        return Hardware(
            "cpu",
            native_bf16=bool(flags & {"avx512_bf16", "amx_bf16"}),
            native_fp16=bool(flags & {"avx512_fp16", "amx_fp16"}),
        )
    return Hardware("mps" if device.type == "mps" else "other", native_bf16=False, native_fp16=device.type == "mps")
