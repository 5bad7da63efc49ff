#!/usr/bin/env bash
# Kernels backends: verify cost profiles per backend, the benchmark of ar and the methods
# on stock / onednn / int8 against transformers generate (fp32) in one run, and int8's quality cost.
# Resumable (bench records are kept per prompt and method; profiles are cached).
#   usage: bash scripts/bench_kernels.sh [OUT_DIR]   (default bench-out; ~50 min on 2 CPU cores)
set -euo pipefail
source "$(dirname "$0")/env.sh"   # $PY and $SELFSPEC
cd "$(dirname "$0")/.."
OUT=${1:-bench-out}
mkdir -p "$OUT"

for k in stock onednn int8; do
  "$SELFSPEC" profile --model qwen2.5-coder-1.5b-instruct --kernels "$k" --max-q 16 | tee "$OUT/profile-qwen1.5b-$k.txt"
  "$SELFSPEC" profile --model smollm2-135m-instruct --kernels "$k" --max-q 16 | tee "$OUT/profile-smollm2-$k.txt"
done

"$SELFSPEC" bench --model qwen2.5-coder-1.5b-instruct --draft-model qwen2.5-coder-0.5b-instruct \
    --methods ar,pld,draft-model --kernels stock,onednn,int8 --peers hf \
    --dataset humaneval --limit 10 --max-new-tokens 96 --out "$OUT/qwen1.5b-kernels" --resume

"$SELFSPEC" bench --model smollm2-135m-instruct --methods ar,pld --kernels stock,onednn,int8 --peers hf \
    --dataset builtin --limit 20 --max-new-tokens 128 --out "$OUT/smollm2-kernels" --resume

"$SELFSPEC" bench --model qwen2.5-coder-1.5b-instruct --methods ar,pld --kernels onednn,int8 \
    --dataset humaneval --limit 30 --max-new-tokens 96 --out "$OUT/qwen1.5b-humaneval-int8" --resume

"$PY" experiments/kernels_quality.py --model qwen2.5-coder-1.5b-instruct --limit 40 \
    --out "$OUT/qwen1.5b-kernels-quality.json"
"$PY" experiments/step_breakdown.py --model smollm2-135m-instruct --kernels stock,onednn,int8 \
    --json "$OUT/smollm2-step-breakdown.json"
