#!/usr/bin/env bash
# GPU benchmark on one H200 (about 8 minutes; at most 9.5): 1B-shaped full fine-tune with FSDP at sequence 2048,
# 8B-shaped LoRA, then the long-sequence rows (8B-shaped LoRA on one sequence of 128k, 512k, 1M tokens with the
# memory levers; a row that cannot fit the memory or the time left is skipped, one that fails is reported, and the
# next row runs); prints tokens/s/GPU, MFU, peak memory and records each row in bench/results/gpu.md as it ends.
#   bash bench/gpu.sh               # on a GPU machine
#   bash bench/gpu.sh --cpu-smoke   # tiny shapes on CPU: what the tests run
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec timeout 570 python -m torch.distributed.run --standalone --nproc_per_node 1 -m bench.gpu "$@"
