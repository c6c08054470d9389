"""Before and after, per method: tok/s (every prompt's tokens over its wall time), the ratio, and
whether every prompt's output is the same token for token.

    python compare.py BEFORE_DIR AFTER_DIR   (each a `leapdecode bench --out` folder)
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path


def samples(folder: Path) -> dict[str, dict[str, dict]]:
    """method -> prompt id -> its sample."""
    by: dict[str, dict[str, dict]] = defaultdict(dict)
    for line in (folder / "samples.jsonl").read_text().splitlines():
        sample = json.loads(line)
        by[sample["method"]][sample["prompt_id"]] = sample
    return by


def main(before_dir: str, after_dir: str) -> None:
    before, after = samples(Path(before_dir)), samples(Path(after_dir))
    print(f"{'method':<40} {'before tok/s':>12} {'after tok/s':>12} {'ratio':>6}  outputs")
    for method in before:
        old, new = before[method], after.get(method, {})
        tokens_old = sum(s["new_tokens"] for s in old.values())
        tokens_new = sum(s["new_tokens"] for s in new.values())
        rate_old = tokens_old / sum(s["wall_time_s"] for s in old.values())
        rate_new = tokens_new / sum(s["wall_time_s"] for s in new.values()) if new else float("nan")
        same = sum(old[p]["token_ids"] == new.get(p, {}).get("token_ids") for p in old)
        label = method if len(method) <= 40 else method[:37] + "..."
        print(
            f"{label:<40} {rate_old:>12.2f} {rate_new:>12.2f} {rate_new / rate_old:>6.3f}  {same}/{len(old)} identical"
        )


if __name__ == "__main__":
    main(*sys.argv[1:3])
