#!/usr/bin/env bash
# Benchmark on the standard datasets: SmolLM2-135M on 10 MT-bench questions, and
# Qwen2.5-Coder-1.5B on 20 HumanEval problems with pass@1 per method. Resumable.
#   usage: bash scripts/bench_datasets.sh [OUT_DIR]   (default bench-out; ~35 min on 2 CPU cores)
set -euo pipefail
source "$(dirname "$0")/env.sh"   # $PY and $SELFSPEC
cd "$(dirname "$0")/.."
OUT=${1:-bench-out}

"$SELFSPEC" bench --model smollm2-135m-instruct --methods ar,pld --peers hf \
    --dataset mt-bench --limit 10 --max-new-tokens 128 --out "$OUT/smollm2-mtbench" --resume

"$SELFSPEC" bench --model qwen2.5-coder-1.5b-instruct --draft-model qwen2.5-coder-0.5b-instruct \
    --methods ar,pld,draft-model --dataset humaneval --limit 20 --max-new-tokens 96 \
    --out "$OUT/qwen1.5b-humaneval" --resume
