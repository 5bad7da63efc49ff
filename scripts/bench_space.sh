#!/usr/bin/env bash
# Issue 8 figures: fine-tune SmolLM2-135M-Instruct with SPACE (scripts/train_space.sh, resumes), build the
# bundled model from the shipped adapter, measure its quality cost against the base, then one benchmark run
# per prompt set on the fastest fp32 backend: all 80 MT-bench questions (10 per category) and 10 HumanEval
# problems with a k sweep, 64 tokens, greedy; a short T = 1 run (lossless residual rule vs the paper's);
# and the acceptance-by-position figures.
set -euo pipefail
cd "$(dirname "$0")/.."
S=.venv/bin/selfspec
OUT=docs/results
M=smollm2-135m-instruct-space
[ -n "${SKIP_TRAIN:-}" ] || bash scripts/train_space.sh
$S models pull $M --force
.venv/bin/python scripts/finetune_quality.py --base smollm2-135m-instruct --model $M --out $OUT/space-quality.json
COMMON=(--model $M --kernels onednn --threads 2 --max-new-tokens 64 --resume)
$S bench "${COMMON[@]}" --dataset mt-bench --methods ar,space,space:k=5 --out $OUT/smollm2-space-mt-bench
$S bench "${COMMON[@]}" --dataset humaneval --limit ${HE_LIMIT:-10} \
   --methods ar,space,space:k=1,space:k=2,space:k=3,space:k=5 --out $OUT/smollm2-space-humaneval
$S bench "${COMMON[@]}" --dataset mt-bench --limit ${T1_LIMIT:-5} --temperature 1.0 \
   --methods ar,space:k=3,space-lossy:k=3 --out $OUT/smollm2-space-mt-bench-t1
.venv/bin/python scripts/selfdraft_figures.py --method space --bench $OUT/smollm2-space-mt-bench \
   $OUT/smollm2-space-humaneval $OUT/smollm2-space-mt-bench-t1 --out $OUT/space
# README Results: every run so far
R=$OUT
.venv/bin/python scripts/results_to_readme.py README.md $R/smollm2 $R/qwen1.5b $R/smollm2-mtbench $R/qwen1.5b-humaneval \
   $R/smollm2-kernels $R/qwen1.5b-kernels $R/qwen1.5b-humaneval-int8 $R/smollm2-self-spec $R/qwen1.5b-self-spec \
   $R/smollm2-hass-mt-bench $R/smollm2-hass-humaneval $R/smollm2-hass-mt-bench-t1 \
   $R/smollm2-sdsat-mt-bench $R/smollm2-sdsat-humaneval $R/smollm2-sdsat-mt-bench-t1 \
   $R/smollm2-space-mt-bench $R/smollm2-space-humaneval $R/smollm2-space-mt-bench-t1
