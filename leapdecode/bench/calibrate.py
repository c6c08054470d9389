"""The timed stage of layer-skip calibration: which skip count makes `self-spec` fastest here.

Stage 1 (rank layers by block influence) is `leapdecode.early_exit.calibrate`; this stage times
self-speculative decoding through the API for a few skip counts and keeps the fastest, so it
sits with the other timed searches.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

from leapdecode.api import Decoder
from leapdecode.early_exit.backend import LayerBackend
from leapdecode.early_exit.calibrate import block_influence, skip_order
from leapdecode.early_exit.layer_sets import LayerSkipCalibration, format_layer_set
from leapdecode.errors import InputError
from leapdecode.methods import SelfSpec
from leapdecode.models import LoadedModel

logger = logging.getLogger("leapdecode")


def calibrate_layer_skip(
    lm: LoadedModel,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int = 48,
    fractions: Sequence[float] = (0.1, 0.2, 0.3, 0.4, 0.5),
    k: int = 4,
    threshold: float = 0.5,
    log: Callable[[str], None] = logger.info,
) -> LayerSkipCalibration:
    """Rank layers, then time self-speculative decoding for each skip fraction; keep the fastest."""
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
        model=lm.name,
        fingerprint=lm.fingerprint,
        num_layers=backend.runner.num_layers,
        skip=str(best["skip"]),
        k=k,
        threshold=threshold,
        influence=[float(v) for v in influence],
        trials=trials,
        plain_ms_per_token=plain_ms,
    )
