#!/usr/bin/env bash
# Set up (idempotent) and run the whole test suite: real torchrun launches of gloo processes on CPU.
#   bash scripts/test.sh            the whole suite (what CI runs, .ci/run)
#   bash scripts/test.sh --quick    for daily work, minutes: style, import contracts, types (mypy), in-process tests
#   bash scripts/test.sh ARGS       pytest ARGS on the two workers
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# Two pytest workers (PYTEST_WORKERS to change), each taking whole files: a launch leaves a core idle about a third
# of its time (one process importing, rank 0 writing), and a module's fixtures (a reference run) stay computed once.
workers=(-n "${PYTEST_WORKERS:-2}" --dist loadfile)
if [ "${1:-}" = --quick ]; then
  shift
  status=0
  echo "quick: set-up $SECONDS s"
  part() {  # part NAME FIX COMMAND...: run it, say how long it took; a failure says the fix and fails the tier
    local name=$1 fix=$2 began=$SECONDS
    shift 2
    if ! "$@"; then
      echo "test: $name failed: $fix"; status=1
    fi
    echo "quick: $name $((SECONDS - began)) s"
  }
  part style "run ruff format . && ruff check --fix ." bash -c "ruff format --check . && ruff check ."
  part imports "see the broken contract above ([tool.importlinter] in pyproject.toml)" lint-imports --no-logo
  part types "see mypy's lines above ([tool.mypy] in pyproject.toml)" mypy
  # the tests that start no process (pyproject.toml's markers, set by tests/conftest.py); the import contracts
  # were checked just above
  part tests "see pytest's summary above" python -m pytest tests -q "${workers[@]}" -m "not launch and not multihost" \
    --deselect tests/unit/test_layers.py::test_import_contracts_are_kept \
    --deselect tests/unit/test_layers.py::test_the_type_checker_passes "$@"
  echo "quick: all $SECONDS s"
  exit $status
fi
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
