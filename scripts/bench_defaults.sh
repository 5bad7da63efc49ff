#!/usr/bin/env bash
# What a user gets without flags, on this CPU: the default model with the default kernels (auto) and
# the default method (auto), against ar, the best fixed configurations, transformers generate and the
# engines a CPU user would run instead on the same weights: llama.cpp (own GGUF, lossy; F32, exact;
# Q8_0, lossy; when llama-cpp-python is installed: CMAKE_ARGS="-DGGML_AMX_INT8=OFF" pip install
# 'selfspec[llamacpp]') and OpenVINO GenAI (F32 at f32 precision; its default precision, lossy; its
# prompt lookup; when installed: pip install 'selfspec[openvino]'), 3 repeats for 95% intervals.
# Two rows per CPU family:
#   1. a fresh machine: README command 1's configuration before `selfspec compile` (a selfspec home of
#      its own that shares the pulled models and GGUFs, and holds no compiled steps, no cost profiles
#      and no cached auto choice), in docs/results/defaults-smollm2-FAMILY-fresh;
#   2. after `selfspec compile` (SKIP_COMPILE=1: not), in docs/results/defaults-smollm2-FAMILY.
# Then Qwen2.5-Coder-1.5B at defaults (no flags) against generate and llama.cpp, and, under the README's
# quantised heading, its int8 backend against generate in fp32.
# 10 built-in chat prompts (one per category) x 64 tokens, greedy, one process per run. Resumable.
# The README's tables take the latest run of each family (scripts/readme_results.sh).
set -euo pipefail
source "$(dirname "$0")/env.sh"   # $PY and $SELFSPEC
OUT=${OUT:-docs/results}
# one directory pair per CPU family (selfspec.core.machine.cpu_family): an Intel Xeon whose AMX the VM
# hides is a family of its own (xeon), apart from the AMD EPYCs' avx512 and avx2
if grep -qw amx_int8 /proc/cpuinfo; then FAMILY=amx
elif grep -qw avx512f /proc/cpuinfo && grep -q GenuineIntel /proc/cpuinfo; then FAMILY=xeon
elif grep -qw avx512_vnni /proc/cpuinfo; then FAMILY=avx512
else FAMILY=avx2; fi
PEERS=hf
if "$PY" -c "import llama_cpp" 2>/dev/null; then PEERS=$PEERS,llama.cpp; fi
if "$PY" -c "import openvino_genai" 2>/dev/null && [[ $PEERS == *llama.cpp* ]]; then PEERS=$PEERS,openvino; fi
COMMON=(--dataset builtin --per-category 1 --max-new-tokens 64 --repeats "${REPEATS:-3}" --resume)
"$SELFSPEC" models pull smollm2-135m-instruct
if [[ ${FRESH:-1} == 1 ]]; then
  HOME_REAL=$("$PY" -c "from selfspec.paths import selfspec_home; print(selfspec_home())")
  FRESH_HOME=$(mktemp -d)
  trap 'rm -rf "$FRESH_HOME"' EXIT
  for d in models gguf data; do mkdir -p "$HOME_REAL/$d" && ln -s "$HOME_REAL/$d" "$FRESH_HOME/$d"; done
  SELFSPEC_HOME=$FRESH_HOME "$SELFSPEC" bench --model smollm2-135m-instruct --methods ar,auto --peers "$PEERS" \
      "${COMMON[@]}" --out "$OUT/defaults-smollm2-$FAMILY-fresh"
fi
# the compiled backend's steps, compiled once per machine (minutes the first time, nothing after): auto
# times that backend only where they are saved
if [[ ${SKIP_COMPILE:-0} != 1 ]]; then "$SELFSPEC" compile --model smollm2-135m-instruct; fi
"$SELFSPEC" bench --model smollm2-135m-instruct --methods ar,auto,pld,self-spec,eagle2 \
    --peers "$PEERS" "${COMMON[@]}" --out "$OUT/defaults-smollm2-$FAMILY"
if [[ ${QWEN:-1} == 1 ]]; then
  "$SELFSPEC" bench --model qwen2.5-coder-1.5b-instruct --methods ar,auto --peers "${PEERS/,openvino/}" \
      "${COMMON[@]}" --repeats 2 --out "$OUT/defaults-qwen1.5b-$FAMILY"
  "$SELFSPEC" bench --model qwen2.5-coder-1.5b-instruct --methods ar,pld --kernels int8 --peers hf \
      --dataset builtin --per-category 1 --max-new-tokens 64 --out "$OUT/defaults-qwen1.5b-int8" --resume
fi
