#!/usr/bin/env bash
# The 1.5B's default draft path before and after, back to back: 12 Spec-Bench prompts (three each
# of multi-turn, translation, qa, math_reasoning), 96 new tokens, greedy.
set -uo pipefail
PY=/work/main/.venv/bin/python
DATA="spec-bench:multi-turn+spec-bench:translation+spec-bench:qa+spec-bench:math_reasoning"
for side in after before; do
  if [ $side = before ]; then tree=/work/before; export TORCH_EXTENSIONS_DIR=/work/ab/ext-before; else tree=/work/main; unset TORCH_EXTENSIONS_DIR; fi
  cd $tree
  PYTHONPATH=$tree $PY -m leapdecode bench -m qwen2.5-coder-1.5b --methods "ar,draft:model=qwen2.5-coder-0.5b" --dataset "$DATA" --limit 3 -n 96 --no-plots --out /work/ab/big2-$side > /work/ab/big2-$side.log 2>&1
  echo "big2 $side rc=$? $(date)" >> /work/ab/progress
done
echo BIG2DONE >> /work/ab/progress
