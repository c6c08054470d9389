#!/usr/bin/env bash
# Before/after the four-call contract, same machine, back to back: smollm2 (28 prompts) and the
# 1.5B's default draft path (Spec-Bench, one prompt per category).
set -uo pipefail
PY=/work/main/.venv/bin/python
SMOL_METHODS="ar,anpd:n=5,k=7,pld:k=10,max_ngram=3,hybrid,jacobi,lookahead"
for side in before after; do
  if [ $side = before ]; then tree=/work/before; export TORCH_EXTENSIONS_DIR=/work/ab/ext-before; else tree=/work/main; unset TORCH_EXTENSIONS_DIR; fi
  (cd $tree && PYTHONPATH=$tree $PY -c "from leapdecode.models import lean, quantize, row_exact; quantize.kernel(); row_exact.kernel(); lean.kernel()")
done
for round in smol big; do
  for side in before after; do
    if [ $side = before ]; then tree=/work/before; export TORCH_EXTENSIONS_DIR=/work/ab/ext-before; else tree=/work/main; unset TORCH_EXTENSIONS_DIR; fi
    cd $tree
    if [ $round = smol ]; then
      PYTHONPATH=$tree $PY -m leapdecode bench -m smollm2-135m --methods "$SMOL_METHODS" --limit 2 -n 128 --no-plots --out /work/ab/smol-$side > /work/ab/smol-$side.log 2>&1
    else
      PYTHONPATH=$tree $PY -m leapdecode bench -m qwen2.5-coder-1.5b --methods "ar,draft:model=qwen2.5-coder-0.5b" --dataset spec-bench --limit 1 -n 128 --no-plots --out /work/ab/big-$side > /work/ab/big-$side.log 2>&1
    fi
    echo "$round $side rc=$? $(date)" >> /work/ab/progress
  done
done
echo ALLDONE >> /work/ab/progress
