#!/usr/bin/env bash
# smollm2-135m before and after, back to back: 28 prompts (HumanEval and the six Spec-Bench
# categories, four each), 128 new tokens, greedy; both read the same stored cost curves.
set -uo pipefail
PY=/work/main/.venv/bin/python
METHODS="ar,anpd:n=5,k=7,anpd:cost_aware=false,pld:k=10,max_ngram=3,suffix,recycle,hybrid,jacobi,lookahead,anpd-tree"
for side in after before; do
  if [ $side = before ]; then tree=/work/before; export TORCH_EXTENSIONS_DIR=/work/ab/ext-before; else tree=/work/main; unset TORCH_EXTENSIONS_DIR; fi
  cd $tree
  PYTHONPATH=$tree $PY -m leapdecode bench -m smollm2-135m --methods "$METHODS" --limit 4 -n 128 --no-plots --out /work/ab/smol28r-$side > /work/ab/smol28r-$side.log 2>&1
  echo "smol28r $side rc=$? $(date)" >> /work/ab/progress
done
echo SMOLRDONE >> /work/ab/progress
