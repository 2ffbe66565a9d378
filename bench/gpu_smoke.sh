#!/usr/bin/env bash
# GPU smoke suite (one GPU, under 5 minutes): the CUDA code paths the CPU tests cannot reach, through the CLI as a
# user runs it. Each check prints PASS or FAIL; the exit status is the number of failures.
#   bf16 FSDP full fine-tune (packing: padding-free rows, varlen attention) | FSDP + LoRA
#   | QLoRA (bitsandbytes 4-bit CUDA kernels) | fast kernels + compile
#   | padding-free loss = padded loss through the FlashAttention varlen kernel | generation from the LoRA adapter
set -uo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
OUT="${OUT:-$(mktemp -d /tmp/shardtune-gpu-smoke.XXXX)}"
COMMON=(--model_name preset:demo --nproc_per_node 1 --max_train_step 20 --synthetic_dialogues.num_train 400
        --synthetic_dialogues.num_validation 40 --lr 1e-3 --overwrite_output_dir true)
failures=0

check() {  # name, timeout seconds, command...
  local name=$1 limit=$2; shift 2
  local start=$SECONDS
  if timeout "$limit" "$@" >"$OUT/$name.log" 2>&1; then
    echo "PASS $name ($((SECONDS - start)) s)"
  else
    echo "FAIL $name ($((SECONDS - start)) s): see $OUT/$name.log"; tail -5 "$OUT/$name.log"
    failures=$((failures + 1))
  fi
}

loss_fell() {  # metrics.jsonl of a run: last step loss below the first, and bf16 on a GPU
  python - "$1" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1] + "/metrics.jsonl") if '"loss"' in l]
assert rows[-1]["loss"] < rows[0]["loss"], (rows[0]["loss"], rows[-1]["loss"])
print(f"loss {rows[0]['loss']:.3f} -> {rows[-1]['loss']:.3f}, {rows[-1]['tokens_per_s']:.0f} tokens/s, "
      f"MFU {rows[-1]['mfu']:.1%}")
PY
}

check fsdp_bf16 120 shardtune sft "${COMMON[@]}" --enable_fsdp --mixed_precision true --output_dir "$OUT/fsdp"
check fsdp_bf16_learns 10 loss_fell "$OUT/fsdp"
check lora 120 shardtune sft "${COMMON[@]}" --enable_fsdp --use_peft --peft_method lora --output_dir "$OUT/lora"
check qlora_4bit 120 shardtune sft "${COMMON[@]}" --use_peft --peft_method lora --quantization 4bit \
  --output_dir "$OUT/qlora"
check fast_kernels_compile 150 shardtune sft "${COMMON[@]}" --use_fast_kernels --compile --output_dir "$OUT/fast"
check varlen_flash 60 python -m bench.varlen_check --device cuda --dtype bfloat16
check varlen_flash_autocast 60 python -m bench.varlen_check --device cuda --dtype float32 --autocast bfloat16
check varlen_flash_window 60 python -m bench.varlen_check --device cuda --dtype bfloat16 --sliding_window 32
check generate 60 shardtune generate --model_name "$OUT/lora" --max_new_tokens 32 \
  "Summarize this dialog:
Anna: lunch at 1?
Ben: sure, the usual place
---
Summary:
"
echo "outputs in $OUT; $failures failure(s)"
exit "$failures"
