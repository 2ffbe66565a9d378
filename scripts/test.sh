#!/usr/bin/env bash
# Set up (idempotent) and run the whole test suite: real torchrun launches of gloo processes on CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# Two pytest workers (PYTEST_WORKERS to change), each taking whole files: a launch leaves a core idle about a third
# of its time (one process importing, rank 0 writing), and a module's fixtures (a reference run) stay computed once.
workers=(-n "${PYTEST_WORKERS:-2}" --dist loadfile)
if [ $# -gt 0 ]; then
  exec python -m pytest -q "${workers[@]}" "$@"
fi
status=0
# style first (seconds): pyproject.toml's format and lint rules, as the pre-commit hooks apply them
if ! { ruff format --check . && ruff check .; }; then
  echo "test: style: run ruff format . && ruff check --fix . (pre-commit install does it at each commit)"; status=1
fi
# The two-host tests (network namespaces, a SLURM cluster on them) run alone afterwards: each is two machines' worth
# of processes on this one, and beside another test's launches a SLURM job waited past the 10-minute test limit.
python -m pytest tests -q "${workers[@]}" --ignore=tests/multihost || status=$?
python -m pytest tests/multihost -q || status=$?
exit $status
