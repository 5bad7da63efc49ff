#!/usr/bin/env bash
# Regenerates the README's Results section (and docs/results/README.md, summary.png) from every
# benchmark run in docs/results. The bench_*.sh scripts call it last; run it alone after adding a run.
set -euo pipefail
source "$(dirname "$0")/env.sh"   # $PY and $SELFSPEC
cd "$(dirname "$0")/.."
"$PY" scripts/results_to_readme.py   # every run under docs/results (a directory with report.json)
