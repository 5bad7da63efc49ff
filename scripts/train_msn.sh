#!/usr/bin/env bash
# Fine-tunes SmolLM2-135M-Instruct with MSN ahead noise and plainly (its control; RUNS picks) and ships both adapters: see scripts/train_finetuned.sh.
# shellcheck disable=SC2086
exec bash "$(dirname "$0")/train_finetuned.sh" ${RUNS:-msn sft}
