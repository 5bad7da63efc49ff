#!/usr/bin/env bash
# Figures of a self-drafting fine-tune (METHOD: sdsat or space) of SmolLM2-135M-Instruct: fine-tune it
# (scripts/train_finetuned.sh, resumes; SKIP_TRAIN=1 skips), build the bundled model from the shipped
# adapter, measure its quality cost against the base, then one benchmark run per prompt set on the
# fastest fp32 backend: all 80 MT-bench questions (10 per category) and HE_LIMIT (10) HumanEval
# problems with a k sweep, 64 tokens, greedy; a short T = 1 run (the lossless rule vs the paper's
# lossy one); the acceptance-by-position figures; and the README's Results.
#   usage: bash scripts/bench_finetuned.sh METHOD   (MSN and its control: scripts/bench_msn.sh)
set -euo pipefail
source "$(dirname "$0")/env.sh"   # $PY and $SELFSPEC
cd "$(dirname "$0")/.."
METHOD=${1:?usage: bash scripts/bench_finetuned.sh sdsat|space}
case $METHOD in   # k of the MT-bench run, the HumanEval k sweep, k of the T = 1 run
    sdsat) MT_K=6; HE_KS="1 2 3 4 6 8"; T1_K=5 ;;
    space) MT_K=5; HE_KS="1 2 3 5"; T1_K=3 ;;
    *) echo "$0: METHOD must be sdsat or space, not $METHOD" >&2; exit 2 ;;
esac
OUT=docs/results
M=smollm2-135m-instruct-$METHOD
[ -n "${SKIP_TRAIN:-}" ] || bash scripts/train_finetuned.sh "$METHOD"
"$SELFSPEC" models pull $M --force
"$PY" scripts/finetune_quality.py --base smollm2-135m-instruct --model $M --out $OUT/$METHOD-quality.json
COMMON=(--model $M --kernels onednn --threads 2 --max-new-tokens 64 --resume)
SWEEP=ar,$METHOD
for k in $HE_KS; do SWEEP=$SWEEP,$METHOD:k=$k; done
"$SELFSPEC" bench "${COMMON[@]}" --dataset mt-bench --methods ar,$METHOD,$METHOD:k=$MT_K --out $OUT/smollm2-$METHOD-mt-bench
"$SELFSPEC" bench "${COMMON[@]}" --dataset humaneval --limit ${HE_LIMIT:-10} --methods $SWEEP --out $OUT/smollm2-$METHOD-humaneval
"$SELFSPEC" bench "${COMMON[@]}" --dataset mt-bench --limit ${T1_LIMIT:-5} --temperature 1.0 \
   --methods ar,$METHOD:k=$T1_K,$METHOD-lossy:k=$T1_K --out $OUT/smollm2-$METHOD-mt-bench-t1
"$PY" experiments/selfdraft_figures.py --method $METHOD --bench $OUT/smollm2-$METHOD-mt-bench \
   $OUT/smollm2-$METHOD-humaneval $OUT/smollm2-$METHOD-mt-bench-t1 --out $OUT/$METHOD
bash scripts/readme_results.sh
