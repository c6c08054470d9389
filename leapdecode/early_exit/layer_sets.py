"""Layer sets (`4-9/12`) and the saved layer-skip calibration: plain data, no torch.

`self-spec:skip=...` names a set of layers; with no `skip`, self-spec reads the set that
`leapdecode calibrate layer-skip` saved for the model, keyed by the model's weights
(`LoadedModel.fingerprint`), so a calibration never applies to another model of the same name.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from leapdecode.errors import InputError, MethodError


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


@dataclass(frozen=True)
class LayerSkipCalibration:
    model: str  # the model's display name, for people reading the file
    fingerprint: str  # the model's weights (`LoadedModel.fingerprint`): what the file is keyed by
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


def calibration_path(cache_dir: Path, fingerprint: str) -> Path:
    """Where the calibration of the model with these weights is saved."""
    safe = re.sub(r"[^A-Za-z0-9]+", "", fingerprint) or "model"
    return cache_dir / "layer-skip" / f"{safe}.json"
