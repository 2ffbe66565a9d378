"""Padding-free rows on this device: loss and gradients equal padding's, and which attention kernel ran.

    python -m bench.varlen_check [--device cuda] [--dtype bfloat16] [--sliding_window 32]

On CUDA in bf16 the row goes through torch's FlashAttention varlen kernel (with ``window_size`` when the model
has a sliding window); the reference is the padded batch
through SDPA. Prints one JSON line; exits 1 when the numbers differ beyond the dtype's tolerance.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import sys
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16" if torch.cuda.is_available() else "float32")
    ap.add_argument("--preset", default="demo")
    ap.add_argument(
        "--autocast",
        default="",
        help="e.g. bfloat16: fp32 weights, autocast compute (DDP's mixed precision) instead of weights in --dtype",
    )
    ap.add_argument(
        "--sliding_window",
        type=int,
        default=0,
        help="load the preset's weights as a Mistral whose "
        "layers see only this many tokens back (shorter than the examples), so the window reaches the "
        "kernel",
    )
    args = ap.parse_args()

    import shardtune.model.attention as attention
    from shardtune.data.batching import collate_flat, collate_padding
    from shardtune.model.loading import load_model, resolve_model_name
    from shardtune.model.loss import token_loss_sum

    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    path = resolve_model_name(f"preset:{args.preset}")
    model = (
        windowed_model(path, args.sliding_window, dtype) if args.sliding_window else load_model(path, dtype=dtype)
    ).to(device)
    rng = random.Random(0)
    examples = []
    for n in (37, 120, 8, 250, 64, 1, 90):
        ids = [rng.randint(4, 1000) for _ in range(n)]
        examples.append({"input_ids": ids, "labels": [-100] * (n // 3) + ids[n // 3 :]})

    autocast = (
        torch.autocast(device.type, dtype=getattr(torch, args.autocast)) if args.autocast else contextlib.nullcontext()
    )

    def loss_and_grads(batch):
        model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        with autocast:
            loss = token_loss_sum(model, batch, device)
        loss.backward()
        if device.type == "cuda":
            torch.cuda.synchronize()
        grads = torch.cat([p.grad.float().flatten() for p in model.parameters()])
        return float(loss.detach()), grads, time.perf_counter() - start

    padded_loss, padded_grads, _ = loss_and_grads(collate_padding(examples, pad_id=0))
    attention.use_varlen_attention(model)
    flat = collate_flat(examples)
    kernel = attention._kernel_applies(device, getattr(torch, args.autocast) if args.autocast else dtype, 0.0)
    flat_loss, flat_grads, seconds = loss_and_grads(flat)
    loss_diff = abs(flat_loss - padded_loss) / abs(padded_loss)
    grad_diff = float((flat_grads - padded_grads).norm() / padded_grads.norm())
    tolerance = 1e-5 if dtype == torch.float32 and not args.autocast else 2e-2
    ok = loss_diff <= tolerance and grad_diff <= 10 * tolerance
    print(
        json.dumps(
            {
                "device": str(device),
                "dtype": args.dtype,
                "autocast": args.autocast,
                "sliding_window": args.sliding_window,
                "kernel": "flash varlen" if kernel else "SDPA per example",
                "loss_padded": padded_loss,
                "loss_flat": flat_loss,
                "loss_rel_diff": loss_diff,
                "grad_rel_diff": grad_diff,
                "flat_step_s": seconds,
                "ok": ok,
            }
        )
    )
    sys.exit(0 if ok else 1)


def windowed_model(path: str, sliding_window: int, dtype: torch.dtype) -> torch.nn.Module:
    """The Llama preset as a Mistral (the same layers and weight names, plus a sliding window)."""
    from transformers import AutoConfig, MistralConfig, MistralForCausalLM

    llama = AutoConfig.from_pretrained(path).to_dict()
    keep = {k: v for k, v in llama.items() if k not in ("model_type", "architectures", "transformers_version")}
    config = MistralConfig(**keep, sliding_window=sliding_window)
    return MistralForCausalLM.from_pretrained(path, config=config, dtype=dtype, attn_implementation="sdpa")


if __name__ == "__main__":
    main()
