#!/usr/bin/env bash
# Sampling: coupled (Gumbel-max, the default) against rejection sampling at T = 0.7 and T = 1
# (acceptance, tau, speed; every method's coupled ids should equal ar's), and greedy in bf16
# (how often each method's ids differ from ar's in half precision). SmolLM2-135M-Instruct, 10
# built-in chat prompts (one per category) x 64 tokens, default kernels, one process per run.
# Resumable: re-run to finish an interrupted run.
set -euo pipefail
source "$(dirname "$0")/env.sh"   # $PY and $SELFSPEC
OUT=${OUT:-docs/results}
METHODS=${METHODS:-ar,pld,jacobi,self-spec,eagle2}
for t in 0.7 1.0; do
  for s in coupled rejection; do
    "$SELFSPEC" bench --model smollm2-135m-instruct --methods "$METHODS" --dataset builtin --per-category 1 \
        --max-new-tokens 64 --temperature "$t" --seed 1 --sampling "$s" ${BENCH_ARGS:-} --out "$OUT/sampling-smollm2-t$t-$s" --resume
  done
done
"$SELFSPEC" bench --model smollm2-135m-instruct --methods "$METHODS" --dtype bfloat16 --dataset builtin \
    --per-category 1 --max-new-tokens 64 ${BENCH_ARGS:-} --out "$OUT/bf16-smollm2" --resume
