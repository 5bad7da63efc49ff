#!/usr/bin/env bash
# Fine-tunes SmolLM2-135M-Instruct with SDSAT adaptive tokens on this machine (CPU; ~1 h on 2 cores)
# and ships the result: the LoRA adapter (+ adaptive token row) is copied to
# src/selfspec/data/adapters/<model>-sdsat, from which `selfspec models pull <model>-sdsat` builds
# the bundled model. The merged model directory itself is $SELFSPEC_HOME/finetune/<model>-sdsat.
# Data: ShareGPT prompts answered by the model itself (self-distillation, shared with the HASS heads'
# cache when present), other ShareGPT conversations, and Python standard-library modules. Resumes.
set -euo pipefail
SELFSPEC=${SELFSPEC:-.venv/bin/selfspec}
M=${MODEL:-smollm2-135m-instruct}
HOME_DIR=${SELFSPEC_HOME:-$HOME/.cache/selfspec}
OUT=$HOME_DIR/finetune/$M-sdsat
mkdir -p "$OUT/data"
# reuse the self-distilled answers made for the HASS heads (same prompts), if they exist
if [ -f "$HOME_DIR/heads/$M-features/answers.jsonl" ] && [ ! -f "$OUT/data/answers.jsonl" ]; then
    cp "$HOME_DIR/heads/$M-features/answers.jsonl" "$OUT/data/answers.jsonl"
fi
"$SELFSPEC" train sdsat --model "$M" --out "$OUT" \
    --data "${DATA:-sharegpt:224,sharegpt-answers:150,code:240}" --regenerate "${REGEN:-160}" \
    --max-len "${MAXLEN:-384}" --window "${WINDOW:-5}" --lora-rank "${RANK:-8}" --lr "${LR:-3e-4}" \
    --epochs "${EPOCHS:-2}" --batch-size 4 --checkpoint-every 25 --threads "${THREADS:-2}" --resume
DEST=src/selfspec/data/adapters/$M-sdsat
mkdir -p "$DEST"
cp "$OUT"/adapter/{adapter_config.json,adapter_model.safetensors,new_tokens.safetensors,selfspec_finetune.json} "$DEST"/
echo "adapter shipped in $DEST; build the bundled model with: selfspec models pull $M-sdsat --force"
