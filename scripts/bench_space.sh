#!/usr/bin/env bash
# SPACE figures: see scripts/bench_finetuned.sh.
exec bash "$(dirname "$0")/bench_finetuned.sh" space "$@"
