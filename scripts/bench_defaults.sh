#!/usr/bin/env bash
# What a user gets without flags: the default model with the default kernels (auto) and
# the default method (auto) against ar and transformers generate, beside every method that runs out
# of the box; then ar on the int8 backend of Qwen2.5-Coder-1.5B against generate in fp32.
# 10 built-in chat prompts (one per category) x 64 tokens, greedy, one process per model. Resumable.
set -euo pipefail
SELFSPEC=${SELFSPEC:-.venv/bin/selfspec}
OUT=${OUT:-docs/results}
"$SELFSPEC" bench --model smollm2-135m-instruct --methods ar,auto,pld,jacobi,msn,self-spec,eagle2,hass \
    --peers hf,hf-pld --dataset builtin --per-category 1 --max-new-tokens 64 --out "$OUT/defaults-smollm2" --resume
"$SELFSPEC" bench --model qwen2.5-coder-1.5b-instruct --methods ar,pld --kernels int8 --peers hf \
    --dataset builtin --per-category 1 --max-new-tokens 64 --out "$OUT/defaults-qwen1.5b-int8" --resume
