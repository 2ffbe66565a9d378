"""Run under torchrun (gloo): one packed row computed whole on every rank, and split over cp x sp ranks.

Writes rank{R}.json with the largest differences between the split and the whole computation: logits of every
token, the token-loss sum (all-reduced), and the gradients of the trainable parameters (all-reduced sums), for a
full model and for a LoRA model; plus a control whose layout ignores the documents' boundaries.

    torchrun --nproc_per_node N tests/distributed/sequence_probe.py MODEL_DIR OUT_DIR CP SP
"""

from __future__ import annotations

import copy
import json
import sys
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

from shardtune.data.batching import collate_flat
from shardtune.model.attention import use_varlen_attention
from shardtune.model.loss import SEQUENCE_LAYOUT, full_logits_loss_sum, model_inputs
from shardtune.parallel.dims import ParallelDims
from shardtune.parallel.sequence import RowSlice, SequenceGroups, split_row, use_sequence_attention

DOCUMENT_LENGTHS = (37, 101, 64, 250, 13, 90)  # 555 tokens: not a multiple of 2 x cp x sp, so the row is padded
PAD_ID = 3


def packed_row(vocab_size: int) -> dict:
    generator = torch.Generator().manual_seed(0)
    examples = []
    for n in DOCUMENT_LENGTHS:
        ids = torch.randint(4, vocab_size, (n,), generator=generator).tolist()
        examples.append({"input_ids": ids, "labels": [-100] * (n // 3) + ids[n // 3 :]})  # prompt masked
    return collate_flat(examples)


def global_positions(row: dict, row_slice: RowSlice) -> torch.Tensor:
    """Index in the whole row of each token of this rank's slice (-1: padding added by the split)."""
    indices = {**row, "input_ids": torch.arange(row["input_ids"].shape[1])[None]}
    return split_row(indices, row_slice, pad_id=-1)["input_ids"][0]


def gathered_logits(model, batch: dict, positions: torch.Tensor, length: int) -> torch.Tensor:
    """The whole row's logits, put together from every rank's slice."""
    local = model(**model_inputs(batch, torch.device("cpu")), use_cache=False).logits[0].detach()
    all_local = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    all_positions = [torch.empty_like(positions) for _ in range(dist.get_world_size())]
    dist.all_gather(all_local, local)
    dist.all_gather(all_positions, positions)
    whole = torch.zeros(length, local.shape[-1])
    for logits, pos in zip(all_local, all_positions):
        keep = pos >= 0
        whole[pos[keep]] = logits[keep]
    return whole


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def compare(whole_model, split_model, row: dict, split: dict, positions: torch.Tensor) -> dict:
    length = row["input_ids"].shape[1]
    reference_logits = whole_model(**model_inputs(row, torch.device("cpu")), use_cache=False).logits[0].detach()
    split_logits = gathered_logits(split_model, split, positions, length)
    reference_loss = full_logits_loss_sum(whole_model, row, torch.device("cpu"))
    reference_loss.backward()
    split_loss = full_logits_loss_sum(split_model, split, torch.device("cpu"))
    split_loss.backward()
    total = split_loss.detach().clone()
    dist.all_reduce(total)
    gradient_differences = {}
    for (name, p_ref), (_, p) in zip(whole_model.named_parameters(), split_model.named_parameters()):
        if p.requires_grad:
            grad = p.grad.clone()
            dist.all_reduce(grad)
            gradient_differences[name] = relative(grad, p_ref.grad)
    return {
        "logits_max_abs_diff": float((split_logits - reference_logits).abs().max()),
        "loss_relative_diff": abs(float(total) - reference_loss.item()) / reference_loss.item(),
        "grad_max_relative_diff": max(gradient_differences.values()),
        "num_trainable": len(gradient_differences),
    }


def main() -> None:
    model_dir, out_dir, cp, sp = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    dims = ParallelDims(dp_replicate=1, dp_shard=dist.get_world_size() // (cp * sp), cp=cp, sp=sp)
    groups = SequenceGroups.from_mesh(dims.build_mesh("cpu"), dims)
    row_slice = RowSlice.of_rank(dims, rank)
    torch.manual_seed(0)
    whole = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    use_varlen_attention(whole)
    split_model = copy.deepcopy(whole)
    use_sequence_attention(split_model, groups)
    row = packed_row(whole.config.vocab_size)
    split = split_row(row, row_slice, PAD_ID)
    positions = global_positions(row, row_slice)
    result = {
        "rank": rank,
        "row_length": row["input_ids"].shape[1],
        "slice_length": split["input_ids"].shape[1],
        "full": compare(whole, split_model, row, split, positions),
    }

    from peft import LoraConfig, get_peft_model

    lora = LoraConfig(
        r=4,
        lora_alpha=8,
        lora_dropout=0.0,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
        init_lora_weights=False,
    )  # non-zero B, so every LoRA matrix has a gradient
    whole_lora = get_peft_model(whole, lora)
    split_lora = get_peft_model(split_model, copy.deepcopy(lora))
    split_lora.load_state_dict(whole_lora.state_dict())
    for model in (whole_lora, split_lora):
        model.zero_grad(set_to_none=True)
    result["lora"] = compare(whole_lora, split_lora, row, split, positions)

    # control: a layout that forgets the documents (one causal sequence over the whole row) must show up
    one_document = replace(
        split[SEQUENCE_LAYOUT],
        cu_seq_lens=torch.tensor([0, split[SEQUENCE_LAYOUT].chunk_len * 2 * cp], dtype=torch.int32),
    )
    with torch.no_grad():
        result["control_logits_max_abs_diff"] = float(
            (
                gathered_logits(
                    split_lora, {**split, SEQUENCE_LAYOUT: one_document}, positions, row["input_ids"].shape[1]
                )
                - gathered_logits(split_lora, split, positions, row["input_ids"].shape[1])
            )
            .abs()
            .max()
        )
    (out_dir / f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
