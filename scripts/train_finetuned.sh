#!/usr/bin/env bash
# Fine-tunes SmolLM2-135M-Instruct ($MODEL) for each self-drafting METHOD named, one LoRA run each,
# on this machine (CPU, 2 cores: sdsat ~1 h, space ~45 min, msn and sft ~40 min each), and ships
# each result: the LoRA adapter (+ the method's new token rows) is copied to
# src/selfspec/data/adapters/<model>-<method>, from which `selfspec models pull <model>-<method>`
# builds the bundled model. The merged model directory itself is $SELFSPEC_HOME/finetune/<model>-<method>.
# Data: ShareGPT prompts answered by the model itself (self-distillation; answers shared with the
# HASS heads' cache and with the other fine-tunes when present), other ShareGPT conversations, and
# Python standard-library modules. msn and sft (MSN's control) get the same data, batches, seed and
# step budget. Every run resumes on its own.
#   usage: bash scripts/train_finetuned.sh METHOD...   (sdsat, space, msn, sft)
# Knobs (environment): sdsat WINDOW (5); space MASKS (5), CUTS (8 cut points per masked sequence, the
# multi-group variant for a small budget; 1 = the official recipe; not GROUPS, a bash built-in) and
# PAR (0.5); msn and sft SPAN (4; sft is validated with this noise span). All: DATA, REGEN (160),
# MAXLEN (384), RANK (8), LR (3e-4), EPOCHS (2), STEPS (200; sdsat 0 = EPOCHS decide), THREADS (2).
set -euo pipefail
source "$(dirname "$0")/env.sh"   # $PY and $SELFSPEC
[ $# -ge 1 ] || { echo "usage: $0 METHOD...   (sdsat, space, msn, sft)" >&2; exit 2; }
M=${MODEL:-smollm2-135m-instruct}
HOME_DIR=${SELFSPEC_HOME:-$HOME/.cache/selfspec}
for WHAT in "$@"; do
    case $WHAT in
        sdsat) ARGS=(--window "${WINDOW:-5}" --max-steps "${STEPS:-0}") ;;
        space) ARGS=(--masks "${MASKS:-5}" --groups "${CUTS:-8}" --p-ar "${PAR:-0.5}" --max-steps "${STEPS:-200}") ;;
        msn|sft) ARGS=(--span "${SPAN:-4}" --max-steps "${STEPS:-200}") ;;
        *) echo "$0: unknown method $WHAT (sdsat, space, msn, sft)" >&2; exit 2 ;;
    esac
    OUT=$HOME_DIR/finetune/$M-$WHAT
    mkdir -p "$OUT/data"
    # reuse prepared data: another fine-tune's (same sources and options; examples.pt is remade if they
    # differ), or at least the self-distilled answers made for the HASS heads (same prompts)
    for SRC in "$HOME_DIR"/finetune/$M-{sdsat,space,msn,sft}/data/{examples.pt,answers.jsonl} \
               "$HOME_DIR/heads/$M-features/answers.jsonl"; do
        if [ -f "$SRC" ] && [ ! -f "$OUT/data/${SRC##*/}" ]; then
            cp "$SRC" "$OUT/data/"
        fi
    done
    "$SELFSPEC" train "$WHAT" --model "$M" --out "$OUT" \
        --data "${DATA:-sharegpt:224,sharegpt-answers:150,code:240}" --regenerate "${REGEN:-160}" \
        --max-len "${MAXLEN:-384}" "${ARGS[@]}" --lora-rank "${RANK:-8}" --lr "${LR:-3e-4}" \
        --epochs "${EPOCHS:-2}" --batch-size 4 --checkpoint-every 25 --threads "${THREADS:-2}" --resume
    DEST=src/selfspec/data/adapters/$M-$WHAT
    mkdir -p "$DEST"
    cp "$OUT"/adapter/{adapter_config.json,adapter_model.safetensors,new_tokens.safetensors,selfspec_finetune.json} "$DEST"/
    echo "adapter shipped in $DEST; build the bundled model with: selfspec models pull $M-$WHAT --force"
done
