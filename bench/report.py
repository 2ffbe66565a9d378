"""latest.json -> the markdown table docs/benchmarks.md quotes."""

from __future__ import annotations


def _mib(num_bytes: float) -> str:
    return f"{num_bytes / 2**20:,.1f} MiB"


TOOL_LABELS = (
    ("shardtune_packing", "shardtune, packing (padding-free)"),
    ("shardtune_padding_free", "shardtune, padding --padding_free"),
    ("shardtune_padding", "shardtune, padding"),
    ("hf_trainer", "transformers.Trainer + DataCollatorForSeq2Seq"),
    ("trl_sft", "TRL SFTTrainer, packing bfd (padding-free), completion-only loss"),
)
PEER_LABELS = {"hf_trainer": "Trainer", "trl_sft": "TRL"}


def markdown(r: dict) -> str:
    m = r["machine"]
    lines = [
        f"Measured {r['date']} on {m['cpu']} ({m['cpu_count']} cores, {m['memory_gib']} GiB)"
        f"{', GPU ' + m['gpu'] if m.get('gpu') else ''}, torch "
        f"{m['torch']}, transformers {m['transformers']}; matmul peak (fp32, measured) "
        f"{r['peak_fp32_flops_per_s'] / 1e9:.0f} GFLOP/s; load average at start "
        f"{m['load_average_at_start'][0]:.1f}, at end {m['load_average_at_end'][0]:.1f} (other jobs share "
        f"this machine: ratios are taken side by side, medians of repeated runs). `python -m bench` "
        f"took {r['bench_wall_s'] / 60:.1f} min.",
        "",
    ]
    for number, t in enumerate((r.get("trainer") or {}).values()):
        s = t["setup"]
        lines += [
            f"**1{'abcdefgh'[number]}. One epoch vs Hugging Face Trainer and TRL: {s['dataset']}** "
            f"(preset {s.get('preset', 'demo')}, "
            f"{s['num_train']} train / {s['num_validation']} validation dialogues of "
            f"{s['mean_example_tokens']:.0f} tokens on average; Trainer's padded batches compute "
            f"{s['trainer_padding_ratio']:.2f}x the real tokens; AdamW ({s.get('optim', 'adamw_torch')}) "
            f"lr {s['lr']} constant, clip 1.0, "
            f"~8 examples per step: padding {s['padding_batch_examples']} examples, packing {s['packing']}; "
            f"{s['repeats']} epochs per tool, median; peers timed in train() only, shardtune's epoch is its "
            "logged step times and its whole process is the command from start to exit, start-up and "
            "evaluation included)",
            "",
            "| tool | epoch time (steps / train()) | whole process | steps | label tokens/s | eval loss | "
            f"vs {PEER_LABELS.get(t.get('fastest_peer'), 'the faster peer')}: epoch | whole process | "
            "run-to-run spread |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for name, label in TOOL_LABELS:
            if name not in t:
                continue
            x = t[name]
            ratio = (
                f"**{x['speedup_vs_fastest_peer']:.2f}x** | **{x['process_speedup_vs_fastest_peer']:.2f}x**"
                if "speedup_vs_fastest_peer" in x
                else ("1.00x (fastest peer) | " if name == t.get("fastest_peer") else " | ")
            )
            process = f"{x['process_s']:.1f} s" if "process_s" in x else ""
            lines.append(
                f"| {label} | {x['epoch_s']:.1f} s | {process} | {x['steps']} | "
                f"{x['label_tokens_per_s']:,.0f} | {x['eval_loss']:.4f} | {ratio} | "
                f"{x['epoch_s_spread']:.0%} |"
            )
        lines.append("")
    o = r.get("overhead")
    if o:
        lines += [
            f"**2. Overhead vs bare PyTorch** (identical pre-built packed padding-free rows, {o['steps']} steps "
            "interleaved, median step time)",
            "",
            "| shardtune train_step | 10-line PyTorch loop | ratio |",
            "|---|---|---|",
            f"| {o['shardtune_step_s'] * 1e3:.0f} ms | {o['bare_step_s'] * 1e3:.0f} ms | {o['ratio']:.3f} |",
            "",
        ]
    lm = r.get("loss_memory")
    if lm:
        s = lm["setup"]
        lines += [
            f"**3. Peak memory of the loss** (vocabulary {s['vocab']:,}, sequence {s['seq_len']:,}, hidden "
            f"{s['hidden']}, {s['layers']} layers, every position labelled; forward + backward, peak RSS "
            f"above the pre-step RSS, fresh process each; one fp32 logits tensor is "
            f"{_mib(s['full_logits_fp32_bytes'])})",
            "",
            "| loss | peak memory of the step | step time | loss value |",
            "|---|---|---|---|",
        ]
        for mode, label in (("default", "model's own (`labels=`, full logits)"), ("lean", "shardtune lean (chunked)")):
            x = lm[mode]
            lines.append(f"| {label} | {_mib(x['step_peak_bytes'])} | {x['step_s']:.1f} s | {x['loss']:.5f} |")
        lines += [f"| **lean / default** | **{lm['ratio_lean_over_default']:.2f}** | | |", ""]
    ms = r.get("model_state")
    if ms:
        lines += [
            "**4. Model state per rank** (demo preset, fp32 parameters + gradients + AdamW state, the local "
            "shards each rank holds after a real step; the largest rank)",
            "",
            "| strategy | processes | params | grads | AdamW state | per rank | all ranks |",
            "|---|---|---|---|---|---|---|",
        ]
        for x in ms["rows"]:
            lines.append(
                f"| {x['strategy'].upper()} | {x['world_size']} | {_mib(x['param_bytes'])} | "
                f"{_mib(x['grad_bytes'])} | {_mib(x['optimizer_bytes'])} | {_mib(x['per_rank_bytes'])} | "
                f"{_mib(x['all_ranks_bytes'])} |"
            )
        if not ms["fsdp_available"]:
            lines.append("FSDP was not available in this build: DDP only.")
        lines.append("")
    if "mfu" in r:
        m = r["mfu"]
        lines += [
            f"**5. MFU on CPU** ({m.get('preset', 'demo')} preset, shardtune packing on "
            f"{m.get('dataset', 'the dialogues')}, median over steps): "
            f"{m['shardtune_packing_median']:.1%} of the measured fp32 matmul peak "
            f"({m['model_flops_per_s_median'] / 1e9:.1f} model GFLOP/s; FLOPs as computed: output "
            "layer on labelled tokens, causal attention, `shardtune/accounting/flops.py`). A model with hidden size "
            f"{m.get('hidden_size', 256)} runs small matmuls that do not reach the 2048 x 2048 peak.",
            "",
        ]
    lines += ["GPU figures (bench/gpu.sh on one H200): pending, no GPU was available; see bench/results/gpu.md.", ""]
    return "\n".join(lines)
