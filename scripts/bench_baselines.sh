#!/usr/bin/env bash
# Benchmark of the baselines: greedy equality on the real 1.5B model (slow test), then
# `selfspec bench` on SmolLM2-135M and on Qwen2.5-Coder-1.5B (0.5B draft) with the transformers
# peers in the same run, then the README "Results" section regenerated from the reports.
# Resumable: re-running continues interrupted benchmarks (records are kept per prompt and method).
#   usage: bash scripts/bench_baselines.sh [OUT_DIR]   (default bench-out; ~40 min on 2 CPU cores)
set -euo pipefail
source "$(dirname "$0")/env.sh"   # $PY and $SELFSPEC
cd "$(dirname "$0")/.."
OUT=${1:-bench-out}
mkdir -p "$OUT"

echo "== greedy equality on Qwen2.5-Coder-1.5B (0.5B draft), 5 prompts =="
"$PY" -m pytest -q -m slow tests/decoding/test_real_models.py

echo "== SmolLM2-135M-Instruct =="
"$SELFSPEC" bench --model smollm2-135m-instruct --methods ar,pld --peers hf,hf-pld \
    --dataset builtin --limit 20 --max-new-tokens 128 --out "$OUT/smollm2" --resume

echo "== Qwen2.5-Coder-1.5B-Instruct, draft Qwen2.5-Coder-0.5B-Instruct =="
"$SELFSPEC" bench --model qwen2.5-coder-1.5b-instruct --draft-model qwen2.5-coder-0.5b-instruct \
    --methods ar,pld,draft-model --peers hf,hf-assisted,hf-pld \
    --dataset builtin --limit 10 --max-new-tokens 64 --out "$OUT/qwen1.5b" --resume

"$PY" scripts/results_to_readme.py README.md "$OUT/smollm2" "$OUT/qwen1.5b"
# after scripts/bench_datasets.sh and scripts/bench_kernels.sh: add "$OUT/smollm2-mtbench" "$OUT/qwen1.5b-humaneval" "$OUT/smollm2-kernels" "$OUT/qwen1.5b-kernels" "$OUT/qwen1.5b-humaneval-int8" to the line above
