#!/usr/bin/env bash
# Issue 32, item 4: the long-run HASS head (scripts/train_hass_long.sh) against the shipped one, on
# held-out prompts: one benchmark run per prompt set (MT-bench: 3 questions of each of its 8
# categories = 24; HumanEval: its first 24 problems), 64 tokens, greedy, every head interleaved
# prompt by prompt with `ar` in the same process. Each head twice: at defaults (cost-sized trees,
# back-off on: what a user gets) and drafting on every step (back-off off, the same cost-sized
# trees: acceptance by depth on every step, the head's quality without the policy's verdict, and
# whether the back-off declines drafts that would pay: issue 32, item 1).
# The shipped head is replaced only where the new one beats it here (then: copy it to
# $SELFSPEC_HOME/heads/<model>-hass and run scripts/ship_heads.py <model> hass).
#   bash scripts/compare_hass_long.sh            # resumable; OUT=dir KERNELS=onednn to vary
set -euo pipefail
source "$(dirname "$0")/env.sh"   # $PY and $SELFSPEC
cd "$(dirname "$0")/.."
M=${MODEL:-smollm2-135m-instruct}
NEW=${HEAD:-${SELFSPEC_HOME:-$HOME/.cache/selfspec}/long/$M-hass}
OUT=${OUT:-docs/results/hass-long-vs-shipped}
if [[ ! -f $NEW/selfspec_head.json ]]; then
  echo "compare_hass_long: no finished head in $NEW (selfspec_head.json); run scripts/train_hass_long.sh to the end" >&2
  exit 2
fi
FORCED=backoff=false
METHODS="hass,hass:head=$NEW,hass:$FORCED,hass:head=$NEW:$FORCED"
for DS in mt-bench humaneval; do
  if [[ $DS == mt-bench ]]; then SUBSET=(--per-category 3); else SUBSET=(--limit 24); fi
  "$SELFSPEC" bench --model "$M" --methods "$METHODS" --kernels "${KERNELS:-compiled}" --peers "" \
      --dataset "$DS" "${SUBSET[@]}" --max-new-tokens 64 --out "$OUT/$DS" --resume
done
