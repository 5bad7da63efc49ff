#!/usr/bin/env bash
# Trains the EAGLE-2 and HASS draft heads of SmolLM2-135M-Instruct on this machine (CPU) and puts
# them where `--method eagle2` / `--method hass` find them: $SELFSPEC_HOME/heads/<model>-<method>.
# Ablation protocol of the HASS paper (Table 4): one EAGLE stage from scratch, then both arms
# continue from it for the same epochs on the same cached features: EAGLE objective (n=1, w=0)
# vs HASS objectives (n=3 alignment passes, top-K loss K=10, w=1). Every step resumes.
set -euo pipefail
SELFSPEC=${SELFSPEC:-.venv/bin/selfspec}
M=${MODEL:-smollm2-135m-instruct}
H=${SELFSPEC_HOME:-$HOME/.cache/selfspec}/heads
F=$H/$M-features
DATA=(--data "${DATA:-sharegpt:224,sharegpt-answers:300,code:60}" --regenerate "${REGEN:-160}" --max-len "${MAXLEN:-384}" --features "$F")
COMMON=(--model "$M" --threads "${THREADS:-2}" --batch-size 4 --checkpoint-every 100 --resume)

"$SELFSPEC" train hass "${COMMON[@]}" "${DATA[@]}" --objective eagle --epochs "${STAGE1_EPOCHS:-2}" --lr 3e-4 \
    --out "$H/$M-stage1"
"$SELFSPEC" train hass "${COMMON[@]}" "${DATA[@]}" --objective eagle --epochs "${ARM_EPOCHS:-2}" --lr 3e-4 \
    --init "$H/$M-stage1" --out "$H/$M-eagle2"
"$SELFSPEC" train hass "${COMMON[@]}" "${DATA[@]}" --objective hass --epochs "${ARM_EPOCHS:-2}" --lr 3e-4 \
    --init "$H/$M-stage1" --out "$H/$M-hass"
