#!/usr/bin/env bash
# Fine-tunes SmolLM2-135M-Instruct twice on the same data, batches, seed and step budget: with MSN's
# ahead-noise span (`selfspec train msn`) and plainly (`selfspec train sft`, the paper's control), on this
# machine (CPU; ~40 min each on 2 cores), and ships both LoRA adapters to src/selfspec/data/adapters/,
# from which `selfspec models pull smollm2-135m-instruct-{msn,sft}` builds the bundled models. Data as for
# SDSAT and SPACE (self-distilled ShareGPT answers, ShareGPT, Python stdlib). Resumes (each run on its own).
set -euo pipefail
SELFSPEC=${SELFSPEC:-.venv/bin/selfspec}
M=${MODEL:-smollm2-135m-instruct}
HOME_DIR=${SELFSPEC_HOME:-$HOME/.cache/selfspec}
for WHAT in ${RUNS:-msn sft}; do
    OUT=$HOME_DIR/finetune/$M-$WHAT
    mkdir -p "$OUT/data"
    for SRC in sdsat space msn sft; do  # reuse prepared data (same sources and options; examples.pt is remade if not)
        for f in examples.pt answers.jsonl; do
            if [ -f "$HOME_DIR/finetune/$M-$SRC/data/$f" ] && [ ! -f "$OUT/data/$f" ]; then
                cp "$HOME_DIR/finetune/$M-$SRC/data/$f" "$OUT/data/$f"
            fi
        done
    done
    "$SELFSPEC" train "$WHAT" --model "$M" --out "$OUT" \
        --data "${DATA:-sharegpt:224,sharegpt-answers:150,code:240}" --regenerate "${REGEN:-160}" \
        --max-len "${MAXLEN:-384}" --span "${SPAN:-4}" \
        --lora-rank "${RANK:-8}" --lr "${LR:-3e-4}" --epochs "${EPOCHS:-2}" --max-steps "${STEPS:-200}" \
        --batch-size 4 --checkpoint-every 25 --threads "${THREADS:-2}" --resume
    DEST=src/selfspec/data/adapters/$M-$WHAT
    mkdir -p "$DEST"
    cp "$OUT"/adapter/{adapter_config.json,adapter_model.safetensors,new_tokens.safetensors,selfspec_finetune.json} "$DEST"/
    echo "adapter shipped in $DEST; build the bundled model with: selfspec models pull $M-$WHAT --force"
done
