#!/usr/bin/env bash
# Issue 32, item 2: a HASS head for SmolLM2-135M-Instruct on about 7x the shipped head's 822k tokens
# (the acceptance-vs-tokens fit in docs/results/acceptance-curves-avx2 puts 1.2x over `ar` at >= 5.7M
# tokens on AVX2). Data: 1,200 ShareGPT prompts answered by the target itself (<= 160 tokens),
# 12,000 ShareGPT conversations with their own answers, 1,500 Python stdlib modules; evaluation
# prompts excluded. Same objective and vocabulary as the shipped head (HASS, 3 alignment passes,
# top-10 loss, N = 8192 draft vocabulary), 1 epoch. Hours to days on a CPU: every stage (answers,
# features, training) checkpoints and resumes, so run it again to continue; in the background, at
# the lowest priority (with the kernel's autogroups, `nice` alone does not yield to other sessions:
# the session's autogroup gets the nice value):
#   setsid nohup bash scripts/train_hass_long.sh > train_hass_long.log 2>&1 < /dev/null &
#   echo 19 > /proc/$!/autogroup
# The head lands in $SELFSPEC_HOME/long/<model>-hass (not in heads/, where it would replace the
# shipped head before it is compared: `selfspec bench --methods hass,hass:head=DIR` does that).
set -euo pipefail
source "$(dirname "$0")/env.sh"   # $PY and $SELFSPEC
cd "$(dirname "$0")/.."
M=${MODEL:-smollm2-135m-instruct}
L=${SELFSPEC_HOME:-$HOME/.cache/selfspec}/long
"$SELFSPEC" train hass --model "$M" --out "$L/$M-hass" --features "$L/$M-features" \
    --data "${DATA:-sharegpt:1200,sharegpt-answers:12000,code:1500}" --regenerate "${REGEN:-160}" \
    --max-len "${MAXLEN:-384}" --objective hass --epochs "${EPOCHS:-1}" --batch-size 4 --checkpoint-every 50 \
    --resume --lr 3e-4 --draft-vocab "${DRAFT_VOCAB:-8192}" --threads "${THREADS:-1}" --no-progress
