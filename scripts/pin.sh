#!/usr/bin/env bash
# Renew constraints.txt, then measure the README's figures on it:
# 1. a fresh resolution of pyproject.toml's dependencies (shardtune[dev] and deepspeed, the newest versions its
#    ranges allow today) in a temporary venv, with the CPU torch that scripts/setup.sh installs (torch stays out of
#    the file: a GPU machine keeps its own build);
# 2. its `pip freeze` (less torch and shardtune) written to constraints.txt, under the file's own header;
# 3. the demo (scripts/demo.sh, whose set-up moves .venv to the new pins), ~4 minutes on 2 cores;
# 4. the figures the README carries, and the pins that changed.
# Run it on the machine the README's figures are measured on (a CPU one); then update the README and commit the two
# files together. The floors in pyproject.toml follow constraints.txt's major.minor: raise them where a pin moved.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$PYTHON" -m venv "$tmp/venv"
install=("$tmp/venv/bin/python" -m pip install --quiet --disable-pip-version-check)
echo "pin: resolving pyproject.toml's dependencies in a fresh venv (minutes)"
"${install[@]}" "torch==${SHARDTUNE_TORCH_VERSION:-2.13.0}"
"${install[@]}" --no-build-isolation "deepspeed==0.19.8"  # its build imports torch, as in setup.sh
"${install[@]}" ".[dev]"
{
  grep '^#' constraints.txt
  "$tmp/venv/bin/python" -m pip freeze --exclude-editable | grep -v -i -E '^(torch|shardtune)( @|==)'
} >"$tmp/constraints.txt"
mv "$tmp/constraints.txt" constraints.txt
echo "pin: constraints.txt renewed; the pins that changed:"
git --no-pager diff -U0 constraints.txt | grep -E '^[-+][^-+]' || echo "  none"

began=$SECONDS
bash scripts/demo.sh 2>&1 | tee "$tmp/demo.log"
.venv/bin/python - "$((SECONDS - began))" <<'PY'
import json, sys
from importlib.metadata import version

before, after = (json.load(open(f"runs/demo/rouge-{when}.json")) for when in ("before", "after"))
print(
    f"\npin: the README's figures (README.md, 'The two commands'), transformers {version('transformers')}, "
    f"torch {version('torch')}, the demo took {int(sys.argv[1]) / 60:.1f} minutes with its set-up:\n"
    f"  ROUGE-1 {100 * before['rouge1']:.1f} -> {100 * after['rouge1']:.1f} and eval loss "
    f"{before['eval_loss']:.2f} -> {after['eval_loss']:.2f}\n"
    "pin: to update the README: put these figures, today's date and the transformers version in that paragraph "
    "(keep the older figures' sentence if they differ: it says what moved them), then commit constraints.txt, "
    "README.md (and pyproject.toml's floors, where a pin's major.minor moved) together."
)
PY
