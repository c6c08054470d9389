"""Where a head is: a folder, a hub id, or the head trained here for a target (cached under
`$LEAPDECODE_HOME/heads/<target>-<method>/head`, where `leapdecode train-drafter` writes it)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from leapdecode.errors import MethodError, ModelLoadError

if TYPE_CHECKING:
    from leapdecode.models.loading import LoadedModel


def run_folder(target_name: str, method: str) -> Path:
    """Where `train-drafter` trains a head for `target_name` unless told (checkpoints, cache, head)."""
    from leapdecode.models.loading import default_cache_dir

    return default_cache_dir() / "heads" / f"{target_name.replace('/', '--')}-{method}"


def head_folder(spec: str, target: LoadedModel, method: str) -> Path:
    """The folder of the head `spec` names for `target` ("" : the one trained here)."""
    text = spec.strip()
    if not text:
        folder = run_folder(target.name, method) / "head"
        if not (folder / "config.json").is_file():
            raise MethodError(
                f"{method}: no {method} head trained for {target.name!r}; train one with "
                f"`leapdecode train-drafter --model {target.name} --method {method}`, or pass head=FOLDER or a hub id"
            )
        return folder
    path = Path(text).expanduser()
    if path.exists():
        if not path.is_dir():
            raise ModelLoadError(f"{method}: head {path} is not a folder")
        return path
    if text.count("/") == 1 and not text.startswith((".", "/", "~")):
        try:
            from huggingface_hub import snapshot_download

            return Path(snapshot_download(text))
        except Exception as exc:  # noqa: BLE001 - the hub's errors vary (offline, missing, gated); all say the same to a user
            raise ModelLoadError(
                f"{method}: could not fetch head {text!r} from the hub: {str(exc).splitlines()[0]}"
            ) from exc
    raise ModelLoadError(f"{method}: head {text!r} is neither a folder nor a hub id (owner/name)")


def describe_head(head: str, method: str, target: LoadedModel) -> str:
    """Which head `method` (its name) ran with, for a benchmark's report: its folder (`head` as
    the method names it) and, for a head trained here, its card's training and held-out lines."""
    try:
        folder = head_folder(head, target, method)
    except (MethodError, ModelLoadError) as exc:
        return f"none ({exc})"
    card = folder / "README.md"
    facts = (
        [
            line.removeprefix("- ").strip()
            for line in card.read_text().splitlines()
            if line.startswith(("- steps", "- held-out"))
        ]
        if card.is_file()
        else []
    )
    return ", ".join([str(folder), *facts])
