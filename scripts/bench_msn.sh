#!/usr/bin/env bash
# MSN figures: fine-tune SmolLM2-135M-Instruct with MSN and with plain SFT at equal budget
# (scripts/train_finetuned.sh msn sft, resumes), build both bundled models, measure each one's quality cost against the
# base, then one benchmark run per model on the same prompts (MT-bench, 3 per category, and 10 HumanEval
# problems; 64 tokens, greedy, the fastest fp32 backend): ar, jacobi (m = 4, the paper's) and msn
# (TR-Jacobi; the paper's 68-node tree and the cost-sized one). Mean accepted tokens per forward
# (tokens / forward) is the paper's MAT.
set -euo pipefail
source "$(dirname "$0")/env.sh"   # $PY and $SELFSPEC
cd "$(dirname "$0")/.."
OUT=docs/results
B=smollm2-135m-instruct
[ -n "${SKIP_TRAIN:-}" ] || bash scripts/train_finetuned.sh msn sft
for W in msn sft; do
    "$SELFSPEC" models pull $B-$W --force
    "$PY" scripts/finetune_quality.py --base $B --model $B-$W --out $OUT/$W-quality.json
done
METHODS=ar,jacobi:m=4:auto_m=false,jacobi,msn:tree_size=68,msn
for M in $B-msn $B-sft $B; do
    COMMON=(--model $M --kernels onednn --threads 2 --max-new-tokens 64 --resume --methods $METHODS)
    "$SELFSPEC" bench "${COMMON[@]}" --dataset mt-bench --per-category ${MT_PER_CAT:-3} --out $OUT/${M/smollm2-135m-instruct/smollm2}-jacobi-mt-bench
    "$SELFSPEC" bench "${COMMON[@]}" --dataset humaneval --limit ${HE_LIMIT:-10} --out $OUT/${M/smollm2-135m-instruct/smollm2}-jacobi-humaneval
done
"$PY" experiments/msn_figures.py --bench $OUT/smollm2-jacobi-mt-bench $OUT/smollm2-sft-jacobi-mt-bench \
   $OUT/smollm2-msn-jacobi-mt-bench $OUT/smollm2-jacobi-humaneval $OUT/smollm2-sft-jacobi-humaneval \
   $OUT/smollm2-msn-jacobi-humaneval --training ${SELFSPEC_HOME:-$HOME/.cache/selfspec}/finetune/$B-{msn,sft} \
   --quality $OUT/msn-quality.json $OUT/sft-quality.json --out $OUT/msn
bash scripts/readme_results.sh
