#!/usr/bin/env bash
# How often greedy ids of `ar` on oneDNN kernels differ from `transformers` `generate` on the stock
# fp32 model (the default `auto` kernels may pick onednn): MT-bench 80 and HumanEval 164, 128 tokens.
# Resumable (bench --resume); then experiments/onednn_vs_generate.py lists each difference with its
# position and the top-2 logit gap there, into docs/results/onednn-vs-generate/.
set -euo pipefail
SELFSPEC=${SELFSPEC:-.venv/bin/selfspec}
OUT=${OUT:-docs/results/onednn-vs-generate}
for ds in mt-bench humaneval; do
    "$SELFSPEC" bench --model smollm2-135m-instruct --methods ar --kernels onednn --peers hf --dataset "$ds" \
        --max-new-tokens 128 --threads "${THREADS:-2}" --out "$OUT/$ds" --resume
done
"${PYTHON:-.venv/bin/python}" experiments/onednn_vs_generate.py "$OUT"
