#!/usr/bin/env bash
# GPU benchmark on one H200 (about 10 minutes; at most 12): first shardtune beside transformers.Trainer and TRL's
# SFTTrainer on the GPU (python -m bench's trainer section: the demo model, 400 dialogues, one epoch each, the peers
# in bf16 as shardtune; bench/results/gpu_peers.md), then the 1B-shaped full fine-tune with FSDP at sequence 2048,
# 8B-shaped LoRA, then the long-sequence rows (8B-shaped LoRA on one sequence of 128k, 512k, 1M tokens with the
# memory levers; a row that cannot fit the memory or the time left is skipped, one that fails is reported, and the
# next row runs), last a GRPO row (shardtune grpo, demo preset, bf16: step time with sampling, reward and kl
# finite), then (GPU_SH_OBJECTIVES_S, 150 s) GRPO, DPO, KTO, RLOO and reward beside TRL's trainers
# (bench/objectives.py --device cuda); prints tokens/s/GPU, MFU against the GPU's data-sheet peak, peak memory and records each row in
# bench/results/gpu.md as it ends.
#   bash bench/gpu.sh                            # on a GPU machine
#   bash bench/gpu.sh --cpu-smoke                # tiny shapes on CPU, without the peers: what the tests run
#   bash bench/gpu.sh --peers-only [--cpu-smoke] # the peers alone (--cpu-smoke: tiny model, 16 dialogues, CPU)
#   GPU_SH_LIMIT_S=400 bash bench/gpu.sh         # all of it in 400 s (a session's device time is short): the peers
#                                                # get at most 170 s, the GRPO row 60-90 s (GPU_SH_GRPO_S), the
#                                                # rows the rest, the long ones while it lasts
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
peers=auto smoke=0 args=()
total=${GPU_SH_LIMIT_S:-740}
started=$SECONDS
for a in "$@"; do
    case "$a" in
        --peers-only) peers=only ;;
        --cpu-smoke) smoke=1; args+=("$a") ;;
        *) args+=("$a") ;;
    esac
done
[[ $peers == auto && $smoke == 1 ]] && peers=no
if [[ $peers != no ]]; then
    if [[ $smoke == 1 ]]; then
        size=(--preset tiny --num_train 16 --num_validation 8 --device cpu --name peers_smoke
              --tools shardtune_packing,hf_trainer,trl_sft --results_dir "${PEERS_RESULTS_DIR:-$(mktemp -d)}")
        limit=900  # a shared 2-core machine can be slow: this is a functional check, not a timing
    else
        size=(--preset demo --num_train 400 --num_validation 50 --name gpu_peers)
        limit=$((total < 340 ? total / 2 : 170))
    fi
    # a failure here is reported and the GPU rows still run (--peers-only: the exit status)
    timeout "$limit" python -m bench --only trainer --datasets plain --repeats 1 "${size[@]}" \
        || { status=$?; echo "peers comparison failed (exit $status)"; [[ $peers == only ]] && exit "$status"; }
fi
[[ $peers == only ]] && exit 0
# the rows get what is left but the GRPO row's and the objectives' shares; their long rows plan against a deadline
# 30 s before it
left=$((total - (SECONDS - started)))
grpo=${GPU_SH_GRPO_S:-$((left < 300 ? 60 : 90))}  # 0: no GRPO row
objectives=${GPU_SH_OBJECTIVES_S:-$((left < 400 ? 0 : 150))}  # 0: no side-by-side rows
((smoke)) && objectives=0  # tiny shapes beside TRL take minutes on a CPU: bench/objectives.py's own smoke is that
left=$((left - grpo - objectives))
((left > 570)) && left=570
deadline=(--deadline_s $((left - 30)))
status=0
timeout "$left" python -m torch.distributed.run --standalone --nproc_per_node 1 -m bench.gpu "${args[@]}" \
    "${deadline[@]}" || status=$?
# last, the GRPO row: shardtune grpo on the GPU in bf16 (demo preset, 64 completions of up to 128 tokens per step,
# beta 0.04), its step time and that reward and kl stay finite (bench/grpo.py --part gpu; --cpu-smoke: tiny, CPU)
grpo_args=()
[[ $smoke == 1 ]] && grpo_args=(--cpu_smoke)
if ((grpo > 0)); then
    timeout "$grpo" python -m bench.grpo --part gpu "${grpo_args[@]}" \
        || { grpo_status=$?; echo "GRPO row failed (exit $grpo_status)"; ((status)) || status=$grpo_status; }
fi
# the issue-48 table's rows on the GPU (bf16 on both sides): GRPO, DPO, KTO, RLOO and reward beside TRL's trainers at
# demo-32k, one run each of 4 timed steps (bench/results/gpu_objectives.md); SFT beside its peers ran first
if ((objectives > 0)); then
    timeout "$objectives" python -m bench.objectives --device cuda --only grpo,dpo,kto,rloo,reward --grpo_presets \
        demo-32k --steps 4 --warmup 1 --repeats 1 --name gpu_objectives \
        || { obj_status=$?; echo "objectives rows failed (exit $obj_status)"; ((status)) || status=$obj_status; }
fi
exit "$status"
