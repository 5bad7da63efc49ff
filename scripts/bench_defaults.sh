#!/usr/bin/env bash
# What a user gets without flags, on this CPU: the default model with the default kernels (auto) and
# the default method (auto), against ar, the best fixed configurations, transformers generate and
# llama.cpp on the same weights (own GGUF and F32; when llama-cpp-python is installed:
# CMAKE_ARGS="-DGGML_AMX_INT8=OFF" pip install 'selfspec[llamacpp]'), 3 repeats for 95% intervals;
# then ar on the int8 backend of Qwen2.5-Coder-1.5B against generate in fp32.
# 10 built-in chat prompts (one per category) x 64 tokens, greedy, one process per model. Resumable.
# `selfspec compile` runs first, so auto may choose the compiled backend (SKIP_COMPILE=1: not).
# The run directory names the CPU family (avx2, avx512, amx); the README's first table takes the
# latest run of each family (scripts/readme_results.sh).
set -euo pipefail
source "$(dirname "$0")/env.sh"   # $PY and $SELFSPEC
OUT=${OUT:-docs/results}
FAMILY=$(grep -qw amx_int8 /proc/cpuinfo && echo amx || (grep -qw avx512_vnni /proc/cpuinfo && echo avx512 || echo avx2))
PEERS=hf
# the compiled backend's steps, compiled once per machine (minutes the first time, nothing after): auto
# times that backend only where they are saved (SKIP_COMPILE=1 measures what a machine without them gets)
if [[ ${SKIP_COMPILE:-0} != 1 ]]; then "$SELFSPEC" compile --model smollm2-135m-instruct; fi
if "$PY" -c "import llama_cpp" 2>/dev/null; then PEERS=hf,llama.cpp; fi
"$SELFSPEC" bench --model smollm2-135m-instruct --methods ar,auto,pld,self-spec,eagle2 \
    --peers "$PEERS" --dataset builtin --per-category 1 --max-new-tokens 64 --repeats "${REPEATS:-3}" \
    --out "$OUT/defaults-smollm2-$FAMILY" --resume
if [[ ${QWEN:-1} == 1 ]]; then
  "$SELFSPEC" bench --model qwen2.5-coder-1.5b-instruct --methods ar,pld --kernels int8 --peers hf \
      --dataset builtin --per-category 1 --max-new-tokens 64 --out "$OUT/defaults-qwen1.5b-int8" --resume
fi
