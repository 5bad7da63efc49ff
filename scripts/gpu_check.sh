#!/usr/bin/env bash
# The GPU check (issue 31), one call of the device tool, under 8 minutes on an H100/H200:
#   bash scripts/gpu_check.sh                 # on the GPU machine: report and log in $OUT
#   bash scripts/gpu_check.sh --device cpu    # the CPU dry run (tiny shapes, same code paths; default test tier)
# selfspec runs from the tree (PYTHONPATH=src). Wheels missing there travel in .whl/ (docs/gpu.md).
# Writes OUT/gpu_report.json and OUT/gpu_check.log (OUT: $OUT, else ./gpu-check-out; --out DIR wins).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT_DIR=${OUT:-gpu-check-out}
args=("$@")
for ((i = 0; i < ${#args[@]}; i++)); do
  if [[ ${args[i]} == --out ]]; then OUT_DIR=${args[i+1]}; fi
done
mkdir -p "$OUT_DIR"
if [[ -d .whl ]] && compgen -G ".whl/*.whl" > /dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD/src:${PYTHONPATH:-} PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
"$PY" scripts/gpu_check.py --out "$OUT_DIR" "$@" 2>&1 | tee "$OUT_DIR/gpu_check.log"
exit "${PIPESTATUS[0]}"
