#!/usr/bin/env bash
# Trains the EAGLE-2 and HASS draft heads of SmolLM2-135M-Instruct on this machine (CPU) the way the
# shipped heads were trained, and puts them where `--method eagle2` / `--method hass` find them:
# $SELFSPEC_HOME/heads/<model>-<method> (a head there takes precedence over the shipped one).
# Data (one feature cache for both): 400 ShareGPT prompts answered by the target itself (<= 160
# tokens), 1,800 ShareGPT conversations with their own answers, 500 Python stdlib modules; evaluation
# prompts excluded; 822k tokens (5.4x the 153k of the previous heads). Both heads from scratch over
# the reduced draft vocabulary (N = 8192, d2t map stored): EAGLE objective 2 epochs, HASS objective
# (3 alignment passes, top-10 loss) 1 epoch, about the same compute (a HASS step costs ~3 EAGLE steps).
# About 50 min for the features and 1 h per head on one AVX-512 core; every stage resumes.
set -euo pipefail
cd "$(dirname "$0")/.."
SELFSPEC=${SELFSPEC:-.venv/bin/selfspec}
M=${MODEL:-smollm2-135m-instruct}
H=${SELFSPEC_HOME:-$HOME/.cache/selfspec}/heads
F=$H/$M-features
DATA=(--data "${DATA:-sharegpt:400,sharegpt-answers:1800,code:500}" --regenerate "${REGEN:-160}"
      --max-len "${MAXLEN:-384}" --features "$F")
THREADS=${THREADS:-2}
COMMON=(--model "$M" --batch-size 4 --checkpoint-every 25 --resume --lr 3e-4 --draft-vocab "${DRAFT_VOCAB:-8192}")
"$SELFSPEC" train hass "${COMMON[@]}" "${DATA[@]}" --threads "$THREADS" --objective eagle \
    --epochs "${EAGLE_EPOCHS:-2}" --out "$H/$M-eagle2"
"$SELFSPEC" train hass "${COMMON[@]}" "${DATA[@]}" --threads "$THREADS" --objective hass \
    --epochs "${HASS_EPOCHS:-1}" --out "$H/$M-hass"
