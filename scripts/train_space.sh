#!/usr/bin/env bash
# Fine-tunes SmolLM2-135M-Instruct with SPACE's semi-autoregressive objective ([MASK] groups) on this
# machine (CPU; ~45 min on 2 cores) and ships the result: the LoRA adapter (+ mask token row) is
# copied to src/selfspec/data/adapters/<model>-space, from which `selfspec models pull <model>-space`
# builds the bundled model. The merged model directory itself is $SELFSPEC_HOME/finetune/<model>-space.
# Data as for SDSAT (self-distilled ShareGPT answers, ShareGPT, Python stdlib). The small budget uses
# the multi-group variant (CUTS cut points per masked sequence; CUTS=1 is the official recipe; not GROUPS, a bash built-in).
# Resumes.
set -euo pipefail
SELFSPEC=${SELFSPEC:-.venv/bin/selfspec}
M=${MODEL:-smollm2-135m-instruct}
HOME_DIR=${SELFSPEC_HOME:-$HOME/.cache/selfspec}
OUT=$HOME_DIR/finetune/$M-space
mkdir -p "$OUT/data"
# reuse the data SDSAT was trained on (same sources and options: examples.pt is remade if they differ),
# or at least the self-distilled answers made for the HASS heads (same prompts)
for f in examples.pt answers.jsonl; do
    if [ -f "$HOME_DIR/finetune/$M-sdsat/data/$f" ] && [ ! -f "$OUT/data/$f" ]; then
        cp "$HOME_DIR/finetune/$M-sdsat/data/$f" "$OUT/data/$f"
    fi
done
if [ -f "$HOME_DIR/heads/$M-features/answers.jsonl" ] && [ ! -f "$OUT/data/answers.jsonl" ]; then
    cp "$HOME_DIR/heads/$M-features/answers.jsonl" "$OUT/data/answers.jsonl"
fi
"$SELFSPEC" train space --model "$M" --out "$OUT" \
    --data "${DATA:-sharegpt:224,sharegpt-answers:150,code:240}" --regenerate "${REGEN:-160}" \
    --max-len "${MAXLEN:-384}" --masks "${MASKS:-5}" --groups "${CUTS:-8}" --p-ar "${PAR:-0.5}" \
    --lora-rank "${RANK:-8}" --lr "${LR:-3e-4}" --epochs "${EPOCHS:-2}" --max-steps "${STEPS:-200}" \
    --batch-size 4 --checkpoint-every 25 --threads "${THREADS:-2}" --resume
DEST=src/selfspec/data/adapters/$M-space
mkdir -p "$DEST"
cp "$OUT"/adapter/{adapter_config.json,adapter_model.safetensors,new_tokens.safetensors,selfspec_finetune.json} "$DEST"/
echo "adapter shipped in $DEST; build the bundled model with: selfspec models pull $M-space --force"
