#!/usr/bin/env bash
# GPU smoke suite (one GPU, about 6 minutes: 13 runs of `shardtune sft` / `dpo` and the varlen checks; 5.6 on an H200): every GPU-only path against its CPU-proven reference, each check a loss
# comparison; a table at the end, exit status = number of failed checks. What each check compares: bench/gpu_smoke.py.
#   bash bench/gpu_smoke.sh                        # on a GPU machine
#   bash bench/gpu_smoke.sh --cpu-smoke --only X   # the comparisons on CPU (tiny preset): what the tests run
set -uo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec timeout 400 python -m bench.gpu_smoke "$@"
