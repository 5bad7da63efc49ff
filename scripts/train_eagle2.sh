#!/usr/bin/env bash
# Trains the EAGLE-2 draft head of SmolLM2-135M-Instruct on this machine (CPU) the way the shipped
# head was trained, and puts it where `--method eagle2` finds it: $SELFSPEC_HOME/heads/<model>-eagle2
# (a head there takes precedence over the shipped one).
# Data (a feature cache of its own): 400 ShareGPT prompts answered by the target itself (<= 160
# tokens), 1,800 ShareGPT conversations with their own answers, 500 Python stdlib modules; evaluation
# prompts excluded; 822k tokens. From scratch over the reduced draft vocabulary (N = 8192, d2t map
# stored), EAGLE objective, 2 epochs. About 50 min for the features and 1 h for the head on one
# AVX-512 core; every stage resumes.
# The shipped HASS head has its own, longer recipe: scripts/train_hass_long.sh (4.26M tokens).
set -euo pipefail
source "$(dirname "$0")/env.sh"   # $PY and $SELFSPEC
cd "$(dirname "$0")/.."
M=${MODEL:-smollm2-135m-instruct}
H=${SELFSPEC_HOME:-$HOME/.cache/selfspec}/heads
"$SELFSPEC" train hass --model "$M" --batch-size 4 --checkpoint-every 25 --resume --lr 3e-4 \
    --draft-vocab "${DRAFT_VOCAB:-8192}" --data "${DATA:-sharegpt:400,sharegpt-answers:1800,code:500}" \
    --regenerate "${REGEN:-160}" --max-len "${MAXLEN:-384}" --features "$H/$M-features" \
    --threads "${THREADS:-2}" --objective eagle --epochs "${EAGLE_EPOCHS:-2}" --out "$H/$M-eagle2"
