#!/usr/bin/env bash
# Set up (idempotent) and run the main job: fine-tune the embedded small Llama on the embedded dialogue
# summaries, on all local devices (one process per GPU; one CPU process without GPUs).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
export TOKENIZERS_PARALLELISM=false
shardtune sft --config recipes/demo.yaml --overwrite_output_dir true "$@"
