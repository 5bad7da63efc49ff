#!/usr/bin/env bash
# SDSAT figures: see scripts/bench_finetuned.sh.
exec bash "$(dirname "$0")/bench_finetuned.sh" sdsat "$@"
