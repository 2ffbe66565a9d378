"""Peak memory of one forward + backward of the loss: lean (shardtune's default) vs the model's own loss
(``labels=``, full-sequence fp32 logits). Llama 3's vocabulary (128,256), a small model, a long sequence.

Each mode runs in a fresh process; torch's CPU allocations are invisible to tracemalloc, so the figure is the
process's peak resident set (ru_maxrss) minus its resident set just before the step. Prints one JSON line.

    python -m bench.loss_memory --mode lean --seq_len 4096
"""

from __future__ import annotations

import argparse
import json
import resource
import time

import torch

VOCAB = 128_256


def rss_bytes() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * resource.getpagesize()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=("lean", "default"), required=True)
    ap.add_argument("--seq_len", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=2)
    args = ap.parse_args()

    from transformers import AutoModelForCausalLM, LlamaConfig

    from shardtune.model.loss import num_label_tokens, token_loss_sum

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=4 * args.hidden,
        max_position_embeddings=args.seq_len,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    input_ids = torch.randint(0, VOCAB, (1, args.seq_len))
    batch = {"input_ids": input_ids, "labels": input_ids.clone()}  # every position labelled: the worst case
    for p in model.parameters():  # gradients allocated before the baseline: only the loss's memory is measured
        p.grad = torch.zeros_like(p)
    baseline = rss_bytes()
    tick = time.perf_counter()
    if args.mode == "lean":
        loss = token_loss_sum(model, batch, torch.device("cpu")) / num_label_tokens(batch["labels"])
    else:
        loss = model(input_ids=input_ids, labels=batch["labels"], use_cache=False).loss
    loss.backward()
    step_s = time.perf_counter() - tick
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(
        json.dumps(
            {
                "mode": args.mode,
                "seq_len": args.seq_len,
                "vocab": VOCAB,
                "loss": float(loss),
                "baseline_rss_bytes": baseline,
                "peak_rss_bytes": peak,
                "step_peak_bytes": peak - baseline,
                "full_logits_fp32_bytes": args.seq_len * VOCAB * 4,
                "step_s": step_s,
            }
        )
    )


if __name__ == "__main__":
    main()
