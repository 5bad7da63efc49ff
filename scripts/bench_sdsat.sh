#!/usr/bin/env bash
# Issue 7 figures: fine-tune SmolLM2-135M-Instruct with SDSAT (scripts/train_sdsat.sh, resumes), build the
# bundled model from the shipped adapter, measure its quality cost against the base, then one benchmark run
# per prompt set on the fastest fp32 backend: all 80 MT-bench questions (10 per category) and 10 HumanEval
# problems with a k sweep, 64 tokens, greedy; a short T = 1 run (lossless tree vs the paper's lossy rule);
# and the acceptance-by-position figures.
set -euo pipefail
cd "$(dirname "$0")/.."
S=.venv/bin/selfspec
OUT=docs/results
M=smollm2-135m-instruct-sdsat
[ -n "${SKIP_TRAIN:-}" ] || bash scripts/train_sdsat.sh
$S models pull $M --force
.venv/bin/python scripts/finetune_quality.py --base smollm2-135m-instruct --model $M --out $OUT/sdsat-quality.json
COMMON=(--model $M --kernels onednn --threads 2 --max-new-tokens 64 --resume)
$S bench "${COMMON[@]}" --dataset mt-bench --methods ar,sdsat,sdsat:k=6 --out $OUT/smollm2-sdsat-mt-bench
$S bench "${COMMON[@]}" --dataset humaneval --limit ${HE_LIMIT:-10} \
   --methods ar,sdsat,sdsat:k=1,sdsat:k=2,sdsat:k=3,sdsat:k=4,sdsat:k=6,sdsat:k=8 --out $OUT/smollm2-sdsat-humaneval
$S bench "${COMMON[@]}" --dataset mt-bench --limit ${T1_LIMIT:-5} --temperature 1.0 \
   --methods ar,sdsat:k=5,sdsat-lossy:k=5 --out $OUT/smollm2-sdsat-mt-bench-t1
.venv/bin/python scripts/selfdraft_figures.py --method sdsat --bench $OUT/smollm2-sdsat-mt-bench $OUT/smollm2-sdsat-humaneval \
   $OUT/smollm2-sdsat-mt-bench-t1 --out $OUT/sdsat
# README Results: every run so far
R=$OUT
.venv/bin/python scripts/results_to_readme.py README.md $R/smollm2 $R/qwen1.5b $R/smollm2-mtbench $R/qwen1.5b-humaneval \
   $R/smollm2-kernels $R/qwen1.5b-kernels $R/qwen1.5b-humaneval-int8 $R/smollm2-self-spec $R/qwen1.5b-self-spec \
   $R/smollm2-hass-mt-bench $R/smollm2-hass-humaneval $R/smollm2-hass-mt-bench-t1 \
   $R/smollm2-sdsat-mt-bench $R/smollm2-sdsat-humaneval $R/smollm2-sdsat-mt-bench-t1
