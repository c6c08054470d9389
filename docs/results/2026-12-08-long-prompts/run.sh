#!/bin/sh
# Every figure of this folder, one after another, nothing else running.
set -e
cd "$(dirname "$0")/../../.."
out=docs/results/2026-12-08-long-prompts
.venv/bin/python $out/prefill.py --lengths 512,2048,4096,8192 --repeats 2 > $out/prefill.jsonl
.venv/llama.cpp/bin/llama-bench -m "$(ls ~/.cache/leapdecode/gguf/qwen2.5-coder-1.5b-*.gguf)" -t 2 -p 512,2048,4096,8192 -n 0 -r 1 -o md > $out/llama-bench.md
.venv/bin/python $out/first_token.py --batches 1,4,8 > $out/first_token.jsonl
.venv/bin/python docs/results/2026-12-08-http-edge/probe.py > docs/results/2026-12-08-http-edge/probe.jsonl
