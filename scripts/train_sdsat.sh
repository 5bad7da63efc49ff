#!/usr/bin/env bash
# Fine-tunes SmolLM2-135M-Instruct with SDSAT adaptive tokens and ships the adapter: see scripts/train_finetuned.sh.
exec bash "$(dirname "$0")/train_finetuned.sh" sdsat
