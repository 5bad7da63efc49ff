#!/usr/bin/env bash
# How often greedy ids of `ar` on a kernels backend (KERNELS: onednn by default, or compiled, int8)
# differ from `transformers` `generate` on the stock fp32 model: MT-bench 80 and HumanEval 164,
# 128 tokens. Resumable (bench --resume); then experiments/kernels_vs_generate.py lists each
# difference with its position and the top-2 logit gap there, into $OUT.
#   bash experiments/bench_kernels_vs_generate.sh                      # docs/results/onednn-vs-generate
#   KERNELS=compiled OUT=docs/results/compiled-vs-generate-avx2 bash experiments/bench_kernels_vs_generate.sh
set -euo pipefail
SELFSPEC=${SELFSPEC:-.venv/bin/selfspec}
KERNELS=${KERNELS:-onednn}
OUT=${OUT:-docs/results/$KERNELS-vs-generate}
for ds in mt-bench humaneval; do
    "$SELFSPEC" bench --model smollm2-135m-instruct --methods ar --kernels "$KERNELS" --peers hf --dataset "$ds" \
        --max-new-tokens 128 --threads "${THREADS:-2}" --out "$OUT/$ds" --resume
done
"${PYTHON:-.venv/bin/python}" experiments/kernels_vs_generate.py "$OUT"
