#!/usr/bin/env bash
# GPU benchmark on one H200 (about 5 minutes; at most 8): 1B-shaped full fine-tune with FSDP at sequence 2048,
# 8B-shaped LoRA; prints tokens/s/GPU, MFU, peak memory and records them in bench/results/gpu.md.
#   bash bench/gpu.sh               # on a GPU machine
#   bash bench/gpu.sh --cpu-smoke   # tiny shapes on CPU: what the tests run
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec timeout 480 python -m torch.distributed.run --standalone --nproc_per_node 1 -m bench.gpu "$@"
