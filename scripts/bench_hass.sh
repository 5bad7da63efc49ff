#!/usr/bin/env bash
# HASS figures (the 2026-11-25 heads): train the EAGLE-2 and HASS heads of SmolLM2-135M-Instruct with
# that day's recipe (the EAGLE stage is scripts/train_eagle2.sh; the 822k-token HASS stage, below, goes
# into a directory of its own, not heads/, where it would replace the shipped HASS head), then one benchmark run per prompt set (MT-bench, HumanEval; 8 prompts each, 64 tokens) on the
# fastest fp32 backend with both heads, the default cost-sized tree, a narrower frontier and the
# paper's tree (top-k 10, depth 5 = 6 draft levels, 60 tokens), and the ablation table/plots.
set -euo pipefail
source "$(dirname "$0")/env.sh"   # $PY and $SELFSPEC
cd "$(dirname "$0")/.."
OUT=docs/results
M=smollm2-135m-instruct
A=${SELFSPEC_HOME:-$HOME/.cache/selfspec}/ablation
COMMON=(--model $M --batch-size 4 --checkpoint-every 25 --resume --lr 3e-4 --draft-vocab 8192 --threads 2
        --data sharegpt:400,sharegpt-answers:1800,code:500 --regenerate 160 --max-len 384 --features $A/$M-features)
"$SELFSPEC" train hass "${COMMON[@]}" --objective eagle --epochs 2 --out $A/$M-eagle2
"$SELFSPEC" train hass "${COMMON[@]}" --objective hass --epochs 1 --out $A/$M-hass
E=eagle2:head=$A/$M-eagle2
H=hass:head=$A/$M-hass
PAPER=top_k=10:depth=5:total_tokens=60:min_prob=0
METHODS=ar,$E,$H,$E:$PAPER,$H:$PAPER
for DS in mt-bench humaneval; do
  "$SELFSPEC" bench --model $M --kernels onednn --threads 2 --dataset $DS --limit ${LIMIT:-8} --max-new-tokens 64 \
     --methods $METHODS --out $OUT/smollm2-hass-$DS --resume
done
# sampling (T = 1): tau of both heads with the same tree
"$SELFSPEC" bench --model $M --kernels onednn --threads 2 --dataset mt-bench --max-new-tokens 64 \
   --temperature 1.0 --methods ar,$E,$H --limit ${T1_LIMIT:-5} --out $OUT/smollm2-hass-mt-bench-t1 --resume
"$PY" experiments/hass_ablation.py --heads $A --model $M \
   --bench $OUT/smollm2-hass-mt-bench $OUT/smollm2-hass-humaneval $OUT/smollm2-hass-mt-bench-t1 \
   --out $OUT/hass-ablation
bash scripts/readme_results.sh
