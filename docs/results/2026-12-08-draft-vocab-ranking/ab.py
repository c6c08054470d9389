#!/usr/bin/env python
"""The default path of the 1.5B with the shipped ranking against the tokenizer's own order, on
Spec-Bench's six categories (the first `--per-category` prompts of each, none of them used to
count the ranking): plain decoding, then both drafting variants, alternating prompt by prompt in
one process; tok/s, α (accepted / drafted) and τ (tokens a pass), and whether each output equals
plain decoding. A variant's drafts come from a 32,768-token draft vocabulary either way.

    python docs/results/2026-12-08-draft-vocab-ranking/ab.py [--per-category 2] [--max-new-tokens 128]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from leapdecode import load_model, wrap
from leapdecode.bench.datasets import load_dataset
from leapdecode.bench.runner import encode_turns
from leapdecode.heads import vocabulary


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--per-category", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    args = parser.parse_args()
    lm = load_model("qwen2.5-coder-1.5b")
    plain = wrap(lm, "ar")
    decoders = {"shipped ranking": wrap(lm)}
    shipped = vocabulary.shipped_ranking_path
    vocabulary.shipped_ranking_path = lambda tokenizer, folder=None: Path("/nonexistent/ranking.json")
    try:
        decoders["tokenizer order"] = wrap(lm)
    finally:
        vocabulary.shipped_ranking_path = shipped
    prompts = load_dataset("spec-bench", limit=args.per_category)
    totals: dict[str, dict[str, float]] = {name: {} for name in ["plain", *decoders]}
    rows = []
    for prompt in prompts:
        ids = encode_turns(lm, prompt, lambda ids: list(plain.generate(ids, max_new_tokens=256).token_ids))
        reference = plain.generate(ids, max_new_tokens=args.max_new_tokens)
        row = {"id": prompt.id, "category": prompt.category, "plain_tok_s": round(reference.stats.tokens_per_s, 2)}
        for name, decoder in decoders.items():
            out = decoder.generate(ids, max_new_tokens=args.max_new_tokens)
            stats = out.stats
            row[name] = {
                "tok_s": round(stats.tokens_per_s, 2),
                "alpha": round(stats.alpha, 3),
                "tau": round(stats.tau, 3),
                "identical": out.token_ids == reference.token_ids,
            }
            for key, value in (("seconds", stats.wall_time_s), ("tokens", len(out.token_ids))):
                totals[name][key] = totals[name].get(key, 0.0) + value
            for key in ("drafted_tokens", "accepted_tokens", "forward_passes"):
                totals[name][key] = totals[name].get(key, 0.0) + getattr(stats, key)
        totals["plain"]["seconds"] = totals["plain"].get("seconds", 0.0) + reference.stats.wall_time_s
        totals["plain"]["tokens"] = totals["plain"].get("tokens", 0.0) + len(reference.token_ids)
        rows.append(row)
        print(json.dumps(row), flush=True)
    plain_rate = totals["plain"]["tokens"] / totals["plain"]["seconds"]
    for name in decoders:
        t = totals[name]
        rate = t["tokens"] / t["seconds"]
        speedups = [r[name]["tok_s"] / r["plain_tok_s"] for r in rows]
        summary = {
            "variant": name,
            "tok_s": round(rate, 2),
            "plain_tok_s": round(plain_rate, 2),
            "speedup": round(rate / plain_rate, 3),
            "geomean_speedup": round(statistics.geometric_mean(speedups), 3),
            "alpha": round(t["accepted_tokens"] / max(t["drafted_tokens"], 1), 3),
            "tau": round(t["tokens"] / max(t["forward_passes"], 1), 3),
            "identical": sum(r[name]["identical"] for r in rows),
            "prompts": len(rows),
        }
        print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
