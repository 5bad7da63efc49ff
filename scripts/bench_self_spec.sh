#!/usr/bin/env bash
# Self-spec figures: tune self-spec skip sets for both bundled models (proxy search + measured
# re-rank), then one benchmark run per model on the fastest fp32 backend (onednn) with both exit
# rules, and the limits plots. Every step resumes: re-run the script after an interrupt.
set -euo pipefail
source "$(dirname "$0")/env.sh"   # $PY and $SELFSPEC
cd "$(dirname "$0")/.."
STATE=${STATE:-$HOME/.cache/selfspec/tune}
OUT=docs/results
CFG=src/selfspec/data/skip_configs

# 1. tune: the teacher-forced proxy search (PHASE=search stops after it, so timing-insensitive work
#    can overlap other jobs), then the 3 best proxy sets decoded for real; the fastest wins
RERANK=3
[ "${PHASE:-all}" = search ] && RERANK=0
"$SELFSPEC" tune qwen2.5-coder-1.5b-instruct --objective proxy --trials ${QWEN_TRIALS:-60} --rerank $RERANK \
   --calib-category code --calib-prompts 6 --calib-tokens 48 --kernels onednn --threads 2 \
   --state "$STATE/qwen-proxy" --out $CFG/qwen2.5-coder-1.5b-instruct.json
"$SELFSPEC" tune smollm2-135m-instruct --objective proxy --trials ${SMOL_TRIALS:-120} --rerank $RERANK \
   --calib-prompts 8 --calib-tokens 48 --kernels onednn --threads 2 \
   --state "$STATE/smol-proxy" --out $CFG/smollm2-135m-instruct.json

[ "${PHASE:-all}" = search ] && exit 0

# 2. benchmark: ar and self-spec with both exit rules, one run per model, tuned configs
"$SELFSPEC" bench --model smollm2-135m-instruct --kernels onednn --threads 2 --dataset builtin --max-new-tokens 96 \
   --methods ar,self-spec,self-spec:draft_exit=gamma --out $OUT/smollm2-self-spec --resume
"$SELFSPEC" bench --model qwen2.5-coder-1.5b-instruct --kernels onednn --threads 2 --dataset humaneval --limit 10 \
   --max-new-tokens 64 --methods ar,self-spec,self-spec:draft_exit=gamma --out $OUT/qwen1.5b-self-spec --resume

# 3. limits: agreement against skip ratio, draft cost share, cost-model predictions
"$PY" experiments/self_spec_limits.py "$STATE/qwen-proxy" $CFG/qwen2.5-coder-1.5b-instruct.json \
   --out $OUT/self-spec-limits/qwen1.5b > /dev/null
"$PY" experiments/self_spec_limits.py "$STATE/smol-proxy" $CFG/smollm2-135m-instruct.json \
   --out $OUT/self-spec-limits/smollm2 > /dev/null

# 4. the same skip set forced to draft every step (no back-off): what the back-off saves
"$SELFSPEC" bench --model smollm2-135m-instruct --kernels onednn --threads 2 --dataset builtin --limit 10 \
   --max-new-tokens 96 --methods ar,self-spec,self-spec:auto_k=false:k=2,self-spec:auto_k=false:draft_exit=gamma \
   --out $OUT/smollm2-self-spec-forced --resume

# 5. README Results
bash scripts/readme_results.sh
