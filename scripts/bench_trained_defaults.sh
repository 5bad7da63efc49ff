#!/usr/bin/env bash
# Issue 32's bar on this machine: each trained method at its defaults (no option; the kernels `auto`
# chooses for it) against `ar` on the same model (its own auto kernels), on 24 MT-bench (3 per category)
# and 24 HumanEval held-out prompts, 64 tokens, greedy, interleaved prompt by prompt in one process per
# model and prompt set. sdsat, space and msn run on their bundled fine-tunes (`selfspec models pull
# smollm2-135m-instruct-<method>`), hass on the base model with its shipped head.
#   bash scripts/bench_trained_defaults.sh          # resumable; OUT=dir METHODS="msn hass" to vary
set -euo pipefail
source "$(dirname "$0")/env.sh"   # $PY and $SELFSPEC
cd "$(dirname "$0")/.."
B=${MODEL:-smollm2-135m-instruct}
OUT=${OUT:-docs/results/trained-defaults}
for W in ${METHODS:-sdsat space msn hass}; do
  if [[ $W == hass || $W == eagle2 ]]; then M=$B; else M=$B-$W; fi
  for DS in mt-bench humaneval; do
    if [[ $DS == mt-bench ]]; then SUBSET=(--per-category 3); else SUBSET=(--limit 24); fi
    "$SELFSPEC" bench --model "$M" --methods "ar,$W" --peers "" --dataset "$DS" "${SUBSET[@]}" \
        --max-new-tokens 64 --out "$OUT/$W-$DS" --resume
  done
done
