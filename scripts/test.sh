#!/usr/bin/env bash
# Set up (idempotent) and run the whole test suite: real torchrun launches of gloo processes on CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec python -m pytest tests -q "$@"
