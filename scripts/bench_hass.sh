#!/usr/bin/env bash
# HASS figures: train the EAGLE-2 and HASS heads of SmolLM2-135M-Instruct (scripts/train_hass.sh,
# resumes), then one benchmark run per prompt set (MT-bench, HumanEval; 8 prompts each, 64 tokens) on the
# fastest fp32 backend with both heads, the default cost-sized tree, a narrower frontier and the
# paper's tree (top-k 10, depth 5 = 6 draft levels, 60 tokens), and the ablation table/plots.
set -euo pipefail
cd "$(dirname "$0")/.."
S=.venv/bin/selfspec
OUT=docs/results
M=smollm2-135m-instruct
bash scripts/train_hass.sh
METHODS=ar,eagle2,hass,eagle2:top_k=10:depth=5:total_tokens=60:min_prob=0,hass:top_k=10:depth=5:total_tokens=60:min_prob=0
for DS in mt-bench humaneval; do
  $S bench --model $M --kernels onednn --threads 2 --dataset $DS --limit ${LIMIT:-8} --max-new-tokens 64 \
     --methods $METHODS --out $OUT/smollm2-hass-$DS --resume
done
# sampling (T = 1): tau of both heads with the same tree
$S bench --model $M --kernels onednn --threads 2 --dataset mt-bench --max-new-tokens 64 \
   --temperature 1.0 --methods ar,eagle2,hass --limit ${T1_LIMIT:-5} --out $OUT/smollm2-hass-mt-bench-t1 --resume
.venv/bin/python experiments/hass_ablation.py --heads "${SELFSPEC_HOME:-$HOME/.cache/selfspec}/heads" --model $M \
   --bench $OUT/smollm2-hass-mt-bench $OUT/smollm2-hass-humaneval $OUT/smollm2-hass-mt-bench-t1 \
   --out $OUT/hass-ablation
bash scripts/readme_results.sh
