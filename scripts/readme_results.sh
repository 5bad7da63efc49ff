#!/usr/bin/env bash
# Regenerates the README's Results section (and docs/results/README.md, summary.png) from every
# benchmark run in docs/results that it summarises. The bench_*.sh scripts call it last; run it
# alone after adding a run (and add the run here).
set -euo pipefail
cd "$(dirname "$0")/.."
R=docs/results
.venv/bin/python scripts/results_to_readme.py README.md $R/smollm2 $R/qwen1.5b $R/smollm2-mtbench $R/qwen1.5b-humaneval \
   $R/smollm2-kernels $R/qwen1.5b-kernels $R/qwen1.5b-humaneval-int8 $R/smollm2-self-spec $R/qwen1.5b-self-spec \
   $R/smollm2-hass-mt-bench $R/smollm2-hass-humaneval $R/smollm2-hass-mt-bench-t1 \
   $R/smollm2-sdsat-mt-bench $R/smollm2-sdsat-humaneval $R/smollm2-sdsat-mt-bench-t1 \
   $R/smollm2-space-mt-bench $R/smollm2-space-humaneval $R/smollm2-space-mt-bench-t1 \
   $R/smollm2-jacobi-mt-bench $R/smollm2-sft-jacobi-mt-bench $R/smollm2-msn-jacobi-mt-bench \
   $R/smollm2-jacobi-humaneval $R/smollm2-sft-jacobi-humaneval $R/smollm2-msn-jacobi-humaneval
