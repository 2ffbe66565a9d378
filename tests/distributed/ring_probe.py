"""A torchrun worker for tests/distributed/test_ring_attention.py: every rank runs ring attention on its two
load-balanced chunks of the same seeded rows, backpropagates a seeded output gradient, and writes its local
output and dq / dk / dv (plus the two controls' outputs) to OUT_DIR/rank{R}.pt.

    python -m torch.distributed.run --standalone --nproc_per_node C tests/distributed/ring_probe.py OUT_DIR
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from shardtune.parallel import ring
from shardtune.parallel.ring import load_balanced_chunk_ids, ring_attention

ROW_TOKENS = 3072  # divisible by 2 x 4: chunks of 768 tokens for C=2, 384 for C=4
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 4, 2, 16
# uneven documents that cross chunk boundaries (and one shorter than a chunk inside one), then one document
ROWS = {"packed": [0, 700, 2000, 2037, 2592, 3072], "single": [0, ROW_TOKENS]}


def make_row(seed: int) -> dict[str, torch.Tensor]:
    """q (1, H, L, D), k / v (1, H_kv, L, D) and an output gradient (1, L, H, D) for a whole row."""
    gen = torch.Generator().manual_seed(seed)
    shapes = {
        "query": (1, NUM_HEADS, ROW_TOKENS, HEAD_DIM),
        "key": (1, NUM_KV_HEADS, ROW_TOKENS, HEAD_DIM),
        "value": (1, NUM_KV_HEADS, ROW_TOKENS, HEAD_DIM),
        "grad_out": (1, ROW_TOKENS, NUM_HEADS, HEAD_DIM),
    }
    return {name: torch.randn(shape, generator=gen) for name, shape in shapes.items()}


def reference_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, bounds: list[int]) -> torch.Tensor:
    """One process, the whole row: causal SDPA per document, (1, L, H, D)."""
    outputs = [
        F.scaled_dot_product_attention(
            query[:, :, s:e], key[:, :, s:e], value[:, :, s:e], is_causal=True, enable_gqa=True
        )
        for s, e in zip(bounds[:-1], bounds[1:])
    ]
    return torch.cat(outputs, dim=2).transpose(1, 2)


def local_tokens(t: torch.Tensor, chunk_ids: tuple[int, int], chunk_len: int, dim: int) -> torch.Tensor:
    return torch.cat([t.narrow(dim, c * chunk_len, chunk_len) for c in chunk_ids], dim=dim)


def run_ring(
    row: dict[str, torch.Tensor],
    bounds: list[int],
    chunk_ids: tuple[int, int],
    claimed_chunk_ids: tuple[int, int],
    chunk_len: int,
) -> dict[str, torch.Tensor]:
    """Ring attention on this rank's ``chunk_ids`` tokens, told they are ``claimed_chunk_ids``."""
    inputs = {
        name: local_tokens(row[name], chunk_ids, chunk_len, 2).requires_grad_() for name in ("query", "key", "value")
    }
    # key and value as the model passes them: transposed views, not contiguous
    key, value = (inputs[n].transpose(1, 2).contiguous().transpose(1, 2) for n in ("key", "value"))
    out = ring_attention(
        inputs["query"],
        key,
        value,
        group=None,
        cu_seq_lens=torch.tensor(bounds, dtype=torch.int32),
        chunk_ids=claimed_chunk_ids,
        chunk_len=chunk_len,
    )
    out.backward(local_tokens(row["grad_out"], chunk_ids, chunk_len, 1))
    return {"out": out.detach(), **{f"d{name[0]}": t.grad for name, t in inputs.items()}}


def main(out_dir: Path) -> None:
    ring.TILE_ELEMENTS["cpu"] = 1 << 17  # row tiles of ~20-40 rows, so segments span several tiles (partial ones too)
    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    chunk_len = ROW_TOKENS // (2 * size)
    chunk_ids = load_balanced_chunk_ids(rank, size)
    results = {}
    for seed, (name, bounds) in enumerate(ROWS.items()):
        row = make_row(seed)
        results[name] = run_ring(row, bounds, chunk_ids, chunk_ids, chunk_len)
        if name == "packed":  # controls: the same data with the boundaries ignored, or the chunks mislabelled
            results["control_no_boundaries"] = run_ring(row, [0, ROW_TOKENS], chunk_ids, chunk_ids, chunk_len)
            results["control_wrong_chunks"] = run_ring(row, bounds, chunk_ids, (rank, rank + size), chunk_len)
    torch.save({"chunk_ids": chunk_ids, "chunk_len": chunk_len, **results}, out_dir / f"rank{rank}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
