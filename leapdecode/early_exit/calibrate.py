"""Calibration for layer skipping: which layers self-speculative drafting should skip.

Draft & Verify searches the skip set with Bayesian optimisation over many generations. This is
a documented cheaper search in two stages:

1. Rank the layers by block influence (ShortGPT, 2403.03853): 1 - cos(input, output) of each
   layer over the calibration prompts' tokens, from one full pass per prompt. Layers that
   barely change the hidden state are the cheapest to skip. The first and last layers are
   never skipped (they change it most, on every model tried).
2. Try skipping the s least influential layers for a few s, generating on the calibration
   prompts with `self-spec`, and keep the s with the least time per token (measured, so that
   it is this machine's trade-off between a cheaper draft and a lower acceptance).

The result is saved per model under the cache folder and reused by `self-spec` with no `skip`.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from leapdecode.early_exit.backend import LayerBackend
from leapdecode.errors import InputError, MethodError
from leapdecode.models import LoadedModel


def parse_layer_set(text: str) -> tuple[int, ...]:
    """`4-9/12/14` -> (4, 5, 6, 7, 8, 9, 12, 14): slash-separated layers and inclusive ranges."""
    layers: set[int] = set()
    for part in filter(None, (p.strip() for p in text.split("/"))):
        match = re.fullmatch(r"(\d+)(?:-(\d+))?", part)
        if match is None:
            raise MethodError(f"a layer set looks like 4-9/12/14 (0-based layers, ranges inclusive), got {text!r}")
        low, high = int(match[1]), int(match[2] or match[1])
        if high < low:
            raise MethodError(f"layer range {part!r} runs backwards")
        layers.update(range(low, high + 1))
    if not layers:
        raise MethodError(f"empty layer set {text!r}")
    return tuple(sorted(layers))


def format_layer_set(layers: Sequence[int]) -> str:
    """The inverse of `parse_layer_set`, with runs written as ranges."""
    parts: list[str] = []
    ordered = sorted(set(layers))
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        parts.append(str(ordered[i]) if i == j else f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    return "/".join(parts)


@torch.inference_mode()
def block_influence(backend: LayerBackend, prompts: Sequence[Sequence[int]]) -> torch.Tensor:
    """Per layer [L]: mean over all prompt tokens of 1 - cos(layer input, layer output)."""
    runner = backend.runner
    totals = torch.zeros(runner.num_layers, dtype=torch.float64)
    count = 0
    for ids in prompts:
        for i, previous, state in runner.states_by_layer(ids):
            cos = torch.nn.functional.cosine_similarity(state[0].float(), previous[0].float(), dim=-1)  # [n]
            totals[i] += float((1 - cos).sum())
        count += len(ids)
    return totals / max(count, 1)


def skip_order(influence: torch.Tensor) -> list[int]:
    """Layers from cheapest to dearest to skip, first and last layers excluded."""
    inner = list(range(1, len(influence) - 1))
    return sorted(inner, key=lambda i: float(influence[i]))


@dataclass(frozen=True)
class LayerSkipCalibration:
    model: str
    num_layers: int
    skip: str  # the chosen layer set, as `self-spec:skip=` takes it
    k: int
    threshold: float
    influence: list[float]  # per layer
    trials: list[dict[str, float | str]]  # per tried skip set: skip, ms_per_token, tau
    plain_ms_per_token: float

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(asdict(self), indent=1))

    @classmethod
    def load(cls, path: Path) -> LayerSkipCalibration:
        try:
            return cls(**json.loads(path.read_text()))
        except (OSError, ValueError, TypeError) as exc:
            raise InputError(f"cannot read layer-skip calibration {path}: {exc}") from exc


def calibration_path(cache_dir: Path, model_name: str) -> Path:
    safe = re.sub(r"[^A-Za-z0-9._-]+", "_", model_name).strip("_") or "model"
    return cache_dir / "layer-skip" / f"{safe}.json"


def calibrate_layer_skip(
    lm: LoadedModel,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int = 48,
    fractions: Sequence[float] = (0.1, 0.2, 0.3, 0.4, 0.5),
    k: int = 4,
    threshold: float = 0.5,
    log: Callable[[str], None] = print,
) -> LayerSkipCalibration:
    """Rank layers, then time self-speculative decoding for each skip fraction; keep the fastest."""
    from leapdecode.api import Decoder
    from leapdecode.methods import SelfSpec

    if not prompts:
        raise InputError("calibration needs at least one prompt")
    decoder_plain = Decoder(lm, "ar", log=log)
    backend = LayerBackend(lm.model)
    influence = block_influence(backend, prompts)
    order = skip_order(influence)
    log("block influence per layer: " + " ".join(f"{i}:{float(v):.3f}" for i, v in enumerate(influence)))

    def ms_per_token(decoder: Decoder) -> tuple[float, float]:
        decoder.generate(list(prompts[0]), max_new_tokens=4)  # warm-up
        tokens, elapsed, passes = 0, 0.0, 0
        for ids in prompts:
            start = time.perf_counter()
            out = decoder.generate(list(ids), max_new_tokens=max_new_tokens)
            elapsed += time.perf_counter() - start
            tokens += len(out.token_ids)
            passes += out.stats.forward_passes
        return 1000 * elapsed / max(tokens, 1), tokens / max(passes, 1)

    plain_ms, _ = ms_per_token(decoder_plain)
    log(f"plain decoding: {plain_ms:.1f} ms/token")
    trials: list[dict[str, float | str]] = []
    for fraction in fractions:
        count = max(1, min(len(order), round(fraction * backend.runner.num_layers)))
        skip = format_layer_set(order[:count])
        ms, tau = ms_per_token(Decoder(lm, SelfSpec(skip=skip, k=k, threshold=threshold), log=log))
        log(f"skip {count} layers ({skip}): {ms:.1f} ms/token, tau {tau:.2f}")
        trials.append({"skip": skip, "layers_skipped": count, "ms_per_token": ms, "tau": tau})
    best = min(trials, key=lambda t: float(t["ms_per_token"]))
    return LayerSkipCalibration(
        model=lm.name, num_layers=backend.runner.num_layers, skip=str(best["skip"]), k=k,
        threshold=threshold, influence=[float(v) for v in influence], trials=trials, plain_ms_per_token=plain_ms,
    )
