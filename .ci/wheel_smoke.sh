#!/usr/bin/env bash
# The package as users install it (issue 61): the sdist and the wheel built from this tree with
# `python -m build`, the wheel installed into a new virtual environment, and run from a directory
# with no clone on the path: the demo, then one method per shipped artefact (the EAGLE-2/HASS
# heads, the self-spec skip config and draft vocabulary, the SDSAT, SPACE and MSN adapters).
# Models come from the default cache (the real-model tier has pulled SmolLM2 there).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
# a clean copy of what a build reads (no build/ or *.egg-info of an editable install)
mkdir "$WORK/tree" && cp pyproject.toml README.md "$WORK/tree/" && cp -r src "$WORK/tree/src"
find "$WORK/tree" \( -name __pycache__ -o -name '*.egg-info' \) -prune -exec rm -rf {} +
.venv/bin/python -m build -q --outdir "$WORK/dist" "$WORK/tree" > "$WORK/build.log" 2>&1 \
  || { tail -20 "$WORK/build.log"; exit 1; }
ls "$WORK"/dist/selfspec-*.tar.gz "$WORK"/dist/selfspec-*.whl
python3 -m venv "$WORK/venv"
"$WORK/venv/bin/pip" install -q torch==2.13.0 "$WORK"/dist/selfspec-*.whl
cd "$WORK"  # nothing of the clone importable from here
S="$WORK/venv/bin/selfspec"
"$WORK/venv/bin/python" -c "import selfspec, sys; assert '$ROOT' not in selfspec.__file__, selfspec.__file__; print('selfspec', selfspec.__version__, 'from', selfspec.__file__)"
"$S" --version
"$S" demo --max-new-tokens 16
P="Write a Python function that reverses a string."
"$S" generate -q --kernels stock --max-new-tokens 16 --method eagle2 "$P"
"$S" generate -q --kernels stock --max-new-tokens 16 --method hass "$P"
"$S" generate -q --kernels stock --max-new-tokens 16 --method self-spec "$P"
"$S" generate -q --kernels stock --max-new-tokens 16 --model smollm2-135m-instruct-sdsat --method sdsat "$P"
"$S" generate -q --kernels stock --max-new-tokens 16 --model smollm2-135m-instruct-space --method space "$P"
"$S" generate -q --kernels stock --max-new-tokens 16 --model smollm2-135m-instruct-msn --method msn "$P"
echo "wheel smoke: passed"
