#!/usr/bin/env bash
# Set up (idempotent) and run the main job: fine-tune the embedded small Llama on the embedded dialogue
# summaries, on all local devices (one process per GPU; one CPU process without GPUs).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
export TOKENIZERS_PARALLELISM=false
# ROUGE of the model before and after fine-tuning, on the same 50 validation dialogues (greedy summaries)
out=runs/demo
shardtune eval --config recipes/demo.yaml --max_examples 50 --max_new_tokens 48 --num_print 0 \
    --report_path "$out/rouge-before.json"
shardtune sft --config recipes/demo.yaml --overwrite_output_dir true --output_dir "$out" "$@"
shardtune eval --config recipes/demo.yaml --model_name "$out" --max_examples 50 --max_new_tokens 48 --num_print 2 \
    --report_path "$out/rouge-after.json"
python - "$out" <<'PY'
import datetime, json, os, platform, sys

import torch, transformers

# what the figures depend on, printed with them: a different torch / transformers builds a different preset
print(f"demo of {datetime.date.today()}: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
      f"torch {torch.__version__} ({torch.get_num_threads()} threads), transformers {transformers.__version__}")
for when in ("before", "after"):
    r = json.load(open(f"{sys.argv[1]}/rouge-{when}.json"))
    print(f"ROUGE {when:>6} fine-tuning: R-1 {100 * r['rouge1']:5.2f}  R-2 {100 * r['rouge2']:5.2f}  "
          f"R-L {100 * r['rougeL']:5.2f}  (eval loss {r['eval_loss']:.3f}, {r['num_examples']} dialogues)")
PY
