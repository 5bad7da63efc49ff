#!/usr/bin/env bash
# EAGLE-2 against EAGLE-3 heads, each with the EAGLE and the HASS objective, at an equal training
# budget on SmolLM2-135M-Instruct: the same data (one self-distilled + ShareGPT + stdlib mix, one
# feature cache), the same epochs, learning rate, batch and draft vocabulary (N = 8192), all four from
# scratch. Then one benchmark run per prompt set with the shipped heads and the four at default settings
# (cost-sized trees), and the four at a fixed 24-node tree (so that tau compares the heads, not the budget), and the table
# and plots (experiments/head_arch_comparison.py). Every step resumes; ARMS picks a subset.
set -euo pipefail
cd "$(dirname "$0")/.."
S=${SELFSPEC:-.venv/bin/selfspec}
M=${MODEL:-smollm2-135m-instruct}
H=${HEADS:-${SELFSPEC_HOME:-$HOME/.cache/selfspec}/heads/arch-comparison}
OUT=${OUT:-docs/results/head-arch-comparison}
DATA=(--data "${DATA:-sharegpt:100,sharegpt-answers:300,code:60}" --regenerate "${REGEN:-128}" --max-len "${MAXLEN:-384}"
      --features "$H/features")
COMMON=(--model "$M" --threads "${THREADS:-1}" --batch-size 4 --checkpoint-every 25 --resume --lr 3e-4
        --epochs "${EPOCHS:-3}" --draft-vocab "${DRAFT_VOCAB:-8192}" --no-progress)
for arm in ${ARMS:-eagle2-eagle eagle2-hass eagle3-eagle eagle3-hass}; do
    arch=${arm%-*}; objective=${arm#*-}
    extra=()
    [[ $arch == eagle3 ]] && extra=(--passes "${E3_PASSES:-3}")
    "$S" train hass "${COMMON[@]}" "${DATA[@]}" --arch "$arch" --objective "$objective" "${extra[@]}" --out "$H/$arm"
done
[[ ${TRAIN_ONLY:-0} == 1 ]] && exit 0
METHODS=ar,eagle2,hass   # the shipped heads (the current defaults) beside the four arms
for arm in eagle2-eagle eagle2-hass eagle3-eagle eagle3-hass; do METHODS+=",hass:head=$H/$arm"; done
for arm in eagle2-eagle eagle2-hass eagle3-eagle eagle3-hass; do METHODS+=",hass:head=$H/$arm:total_tokens=24:min_prob=0"; done
for DS in mt-bench humaneval; do
    "$S" bench --model "$M" --threads "${BENCH_THREADS:-2}" --dataset $DS --limit "${LIMIT:-5}" --max-new-tokens 64 \
        --methods "$METHODS" --out "$OUT/$DS" --resume
done
"${PYTHON:-.venv/bin/python}" experiments/head_arch_comparison.py --heads "$H" --bench "$OUT/mt-bench" "$OUT/humaneval" --out "$OUT"
