#!/usr/bin/env python
"""Each method's worst prompts against plain decoding in a `bench` folder's samples: the speed-up
per prompt (plain's time / the method's, same prompt, same run), the three lowest, and how many
prompts fall below 0.98x.

    python docs/results/2026-12-08-cost-aware-floor/worst.py docs/results/2026-12-08-cost-aware-floor/bench
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path

folder = Path(sys.argv[1])
rows = [json.loads(line) for line in (folder / "samples.jsonl").read_text().splitlines()]
plain = {r["prompt_id"]: r["wall_time_s"] for r in rows if r["method"] == "ar"}
by_method: dict[str, list[tuple[float, str, float]]] = defaultdict(list)
for r in rows:
    if r["method"] != "ar":
        by_method[r["method"]].append((plain[r["prompt_id"]] / r["wall_time_s"], r["prompt_id"], r["alpha"] or 0.0))
print("| method | prompts | below 0.98x | worst three (speed-up, prompt, α) |")
print("|---|---:|---:|---|")
for method, speedups in by_method.items():
    speedups.sort()
    worst = ", ".join(f"{s:.2f}x {p} (α {a:.2f})" for s, p, a in speedups[:3])
    below = sum(s < 0.98 for s, _, _ in speedups)
    print(f"| `{method}` | {len(speedups)} | {below} | {worst} |")
