#!/usr/bin/env bash
# Set up (idempotent) and run the whole test suite: real torchrun launches of gloo processes on CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# Two pytest workers (PYTEST_WORKERS to change), each taking whole files: a launch leaves a core idle about a third
# of its time (one process importing, rank 0 writing), and a module's fixtures (a reference run) stay computed once.
exec python -m pytest tests -q -n "${PYTEST_WORKERS:-2}" --dist loadfile "$@"
