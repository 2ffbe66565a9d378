"""Ring attention for context parallelism: each rank holds a slice of one long row; K/V rotate around the ring.

The row is cut into ``2 C`` chunks of ``chunk_len`` tokens and rank ``r`` of ``C`` holds chunks ``r`` and
``2C - 1 - r`` (one from the front, its mirror from the back), so every rank does the same amount of causal
work. Each rank's two K/V chunks travel around the ring of the context-parallel group with point-to-point ops;
the next exchange is posted before the current block is computed, so communication overlaps compute where the
backend allows. For a (query chunk, key chunk) pair: a key chunk after the query chunk is skipped, the same chunk
is causal, an earlier one is attended in full — always only within documents (``cu_seq_lens`` of the whole
row), one document segment at a time, so no mask over the row ever exists. Partial outputs are merged by their
log-sum-exp in fp32.

Backward is the standard ring backward: K/V rotate again together with their gradient accumulators, which end
one more hop later at their owners. It recomputes the attention probabilities from the saved q, k, v, output
and log-sum-exp, so a rank's memory stays proportional to its own tokens.

The block math is portable (matmul + softmax in fp32, over row tiles of bounded size), so it runs on gloo/CPU as
on NCCL/CUDA.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import torch
import torch.distributed as dist

# scores of one row tile (heads x rows x keys), fp32: 16 MiB on CPU (a few such buffers are live at once, which
# bounds the scratch memory); 256 MiB on GPU, where larger matmuls run faster
TILE_ELEMENTS = {"cpu": 1 << 22, "cuda": 1 << 26}


def load_balanced_chunk_ids(cp_rank: int, cp_size: int) -> tuple[int, int]:
    """The two chunks (of ``2 * cp_size``) that rank ``cp_rank`` holds: one from the front, its mirror from the back."""
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank {cp_rank} is outside the context-parallel group of size {cp_size}")
    return cp_rank, 2 * cp_size - 1 - cp_rank


def ring_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    group: dist.ProcessGroup | None,
    cu_seq_lens: torch.Tensor,
    chunk_ids: tuple[int, int],
    chunk_len: int,
    scaling: float | None = None,
) -> torch.Tensor:
    """Causal attention of this rank's tokens against the whole row, within documents.

    query (1, H, T, D), key / value (1, H_kv, T, D) with ``T = 2 * chunk_len``: this rank's chunks ``chunk_ids``
    back to back. ``cu_seq_lens``: int32 document boundaries of the whole row in global token indices. Returns
    (1, T, H, D), like transformers' attention functions.
    """
    if query.shape[0] != 1:
        raise ValueError(f"ring attention takes one row (batch 1), got a batch of {query.shape[0]}")
    if query.shape[2] != 2 * chunk_len or key.shape[2] != query.shape[2] or value.shape != key.shape:
        raise ValueError(
            f"ring attention: q {tuple(query.shape)}, k {tuple(key.shape)}, v {tuple(value.shape)} "
            f"do not hold two chunks of {chunk_len} tokens"
        )
    if query.shape[1] % key.shape[1]:
        raise ValueError(f"ring attention: {query.shape[1]} query heads are not a multiple of {key.shape[1]} KV heads")
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    layout = _Layout(group, tuple(chunk_ids), chunk_len, tuple(int(b) for b in cu_seq_lens.tolist()))
    row_tokens = 2 * layout.size * chunk_len
    if layout.bounds[0] != 0 or layout.bounds[-1] != row_tokens:
        raise ValueError(
            f"ring attention: cu_seq_lens must run from 0 to the whole row's {row_tokens} tokens "
            f"(padding included), got {layout.bounds[0]} .. {layout.bounds[-1]}"
        )
    out = _RingAttention.apply(query[0], key[0], value[0], layout, scale)
    return out.transpose(0, 1).unsqueeze(0).contiguous()


@dataclass(frozen=True)
class _Layout:
    group: dist.ProcessGroup | None
    chunk_ids: tuple[int, int]
    chunk_len: int
    bounds: tuple[int, ...]  # document boundaries of the whole row

    @property
    def size(self) -> int:
        return dist.get_world_size(self.group) if dist.is_initialized() else 1

    @property
    def rank(self) -> int:
        return dist.get_rank(self.group) if dist.is_initialized() else 0

    def peer(self, offset: int) -> int:
        """Global rank of the group member ``offset`` places further along the ring."""
        group_rank = (self.rank + offset) % self.size
        return dist.get_global_rank(self.group, group_rank) if self.group is not None else group_rank

    def all_chunk_ids(self, device: torch.device) -> list[tuple[int, int]]:
        """Every group member's chunk ids, in group-rank order (one small all-gather, on the backend's device)."""
        if self.size == 1:
            return [self.chunk_ids]
        mine = torch.tensor(self.chunk_ids, dtype=torch.int64, device=device)
        gathered = [torch.empty_like(mine) for _ in range(self.size)]
        dist.all_gather(gathered, mine, group=self.group)
        return [tuple(t.tolist()) for t in gathered]

    def segment_pairs(self, q_chunk: int, k_chunk: int) -> list[tuple[slice, slice, bool]]:
        """(query rows, key rows, causal) within the two chunks, one per document both touch; [] if none."""
        if k_chunk > q_chunk:
            return []
        length = self.chunk_len
        q_lo, q_hi, k_lo = q_chunk * length, (q_chunk + 1) * length, k_chunk * length
        k_hi = k_lo + length
        pairs = []
        first = max(bisect.bisect_right(self.bounds, k_lo) - 1, 0)
        for doc_start, doc_end in zip(self.bounds[first:-1], self.bounds[first + 1 :]):
            if doc_start >= q_hi:
                break
            qs, qe, ks, ke = max(doc_start, q_lo), min(doc_end, q_hi), max(doc_start, k_lo), min(doc_end, k_hi)
            if qs < qe and ks < ke:
                pairs.append((slice(qs - q_lo, qe - q_lo), slice(ks - k_lo, ke - k_lo), k_chunk == q_chunk))
        return pairs


def _exchange(tensors: list[torch.Tensor], layout: _Layout) -> tuple[list[torch.Tensor], list]:
    """Post: send ``tensors`` to the next rank, receive the previous rank's into new buffers (not yet waited)."""
    received = [torch.empty_like(t) for t in tensors]
    ops = [dist.P2POp(dist.isend, t, layout.peer(1), layout.group) for t in tensors]
    ops += [dist.P2POp(dist.irecv, r, layout.peer(-1), layout.group) for r in received]
    return received, dist.batch_isend_irecv(ops)


def _wait(requests: list) -> None:
    for request in requests:
        request.wait()


def _local_pairs(layout: _Layout, q_chunks: tuple[int, int], k_chunks: tuple[int, int]):
    """(query rows, key rows, causal) in local coordinates (two chunks back to back) for a held K/V block."""
    length = layout.chunk_len
    for qi, q_chunk in enumerate(q_chunks):
        for ki, k_chunk in enumerate(k_chunks):
            for q_rows, k_rows, causal in layout.segment_pairs(q_chunk, k_chunk):
                yield (
                    slice(q_rows.start + qi * length, q_rows.stop + qi * length),
                    slice(k_rows.start + ki * length, k_rows.stop + ki * length),
                    causal,
                )


def _row_tiles(num_rows: int, num_heads: int, num_keys: int, device: torch.device):
    tile = max(1, TILE_ELEMENTS.get(device.type, TILE_ELEMENTS["cpu"]) // max(1, num_heads * num_keys))
    for start in range(0, num_rows, tile):
        yield start, min(start + tile, num_rows)


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float, row_offset: int, causal: bool) -> torch.Tensor:
    """fp32 scores (H_kv, G, rows, keys) of a row tile; causal masks keys after each row (square segments)."""
    scores = torch.matmul(q, k.unsqueeze(1).transpose(-1, -2)) * scale
    if causal:
        rows = torch.arange(row_offset, row_offset + q.shape[2], device=q.device)
        keys = torch.arange(k.shape[1], device=q.device)
        scores = scores.masked_fill(keys[None, :] > rows[:, None], float("-inf"))
    return scores


def _grouped(t: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """(H, T, D) -> (H_kv, G, T, D): query heads grouped by the KV head they share."""
    return t.reshape(num_kv_heads, t.shape[0] // num_kv_heads, *t.shape[1:])


def _block_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, pairs, scale: float
) -> None:
    """Merge the attention of q (H_kv, G, T, D) onto one held K/V block into out / lse (fp32, in place)."""
    for q_rows, k_rows, causal in pairs:
        k_seg, v_seg = k[:, k_rows], v[:, k_rows]
        for lo, hi in _row_tiles(q_rows.stop - q_rows.start, q.shape[0] * q.shape[1], k_seg.shape[1], q.device):
            rows = slice(q_rows.start + lo, q_rows.start + hi)
            keys = slice(0, hi) if causal else slice(None)  # a causal tile sees no key after its last row
            scores = _scores(q[:, :, rows], k_seg[:, keys], scale, lo, causal)
            block_lse = torch.logsumexp(scores, dim=-1)
            block_out = torch.matmul(torch.exp(scores - block_lse.unsqueeze(-1)), v_seg[:, keys].unsqueeze(1))
            merged = torch.logaddexp(lse[:, :, rows], block_lse)
            out[:, :, rows] = out[:, :, rows] * torch.exp(lse[:, :, rows] - merged).unsqueeze(
                -1
            ) + block_out * torch.exp(block_lse - merged).unsqueeze(-1)
            lse[:, :, rows] = merged


def _block_backward(q, k, v, dout, lse, delta, dq, dk, dv, pairs, scale: float) -> None:
    """Accumulate the gradients of one held K/V block (fp32, in place), recomputing its probabilities."""
    for q_rows, k_rows, causal in pairs:
        k_seg, v_seg = k[:, k_rows], v[:, k_rows]
        for lo, hi in _row_tiles(q_rows.stop - q_rows.start, q.shape[0] * q.shape[1], k_seg.shape[1], q.device):
            rows = slice(q_rows.start + lo, q_rows.start + hi)
            keys = slice(0, hi) if causal else slice(None)
            key_rows = slice(k_rows.start, k_rows.start + hi) if causal else k_rows
            q_tile, k_tile, v_tile = q[:, :, rows], k_seg[:, keys], v_seg[:, keys]
            probs = torch.exp(_scores(q_tile, k_tile, scale, lo, causal) - lse[:, :, rows].unsqueeze(-1))
            dout_tile = dout[:, :, rows]
            dv[:, key_rows] += torch.matmul(probs.transpose(-1, -2), dout_tile).sum(1)
            dprobs = torch.matmul(dout_tile, v_tile.unsqueeze(1).transpose(-1, -2))
            dscores = probs * (dprobs - delta[:, :, rows].unsqueeze(-1)) * scale
            dq[:, :, rows] += torch.matmul(dscores, k_tile.unsqueeze(1))
            dk[:, key_rows] += torch.matmul(dscores.transpose(-1, -2), q_tile).sum(1)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, query, key, value, layout: _Layout, scale: float):  # (H, T, D), (H_kv, T, D) x 2
        num_kv_heads = key.shape[0]
        chunk_ids = layout.all_chunk_ids(query.device)
        q = _grouped(query.float(), num_kv_heads)
        out = torch.zeros_like(q)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
        held = [key.contiguous(), value.contiguous()]  # sent as they are: point-to-point ops need contiguous tensors
        for step in range(layout.size):
            last = step == layout.size - 1
            incoming, requests = _exchange(held, layout) if not last else (None, [])
            k_chunks = chunk_ids[(layout.rank - step) % layout.size]
            pairs = list(_local_pairs(layout, layout.chunk_ids, k_chunks))
            _block_forward(q, held[0].float(), held[1].float(), out, lse, pairs, scale)
            _wait(requests)
            held = incoming
        ctx.save_for_backward(query, key, value, out, lse)
        ctx.layout, ctx.scale, ctx.chunk_ids = layout, scale, chunk_ids
        return out.reshape(query.shape).to(query.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        query, key, value, out, lse = ctx.saved_tensors
        layout, scale, chunk_ids = ctx.layout, ctx.scale, ctx.chunk_ids
        num_kv_heads = key.shape[0]
        q = _grouped(query.float(), num_kv_heads)
        dout = _grouped(grad_out.float(), num_kv_heads)
        delta = (dout * out).sum(-1)  # rowsum(dO * O), the softmax backward's correction term
        dq = torch.zeros_like(q)
        held = [key.contiguous(), value.contiguous()]  # sent as they are: point-to-point ops need contiguous tensors
        dkv = [torch.zeros(key.shape, dtype=torch.float32, device=key.device) for _ in range(2)]
        for step in range(layout.size):
            last = step == layout.size - 1
            incoming, requests = _exchange(held, layout) if not last else (None, [])
            k_chunks = chunk_ids[(layout.rank - step) % layout.size]
            pairs = list(_local_pairs(layout, layout.chunk_ids, k_chunks))
            _block_backward(q, held[0].float(), held[1].float(), dout, lse, delta, dq, dkv[0], dkv[1], pairs, scale)
            if layout.size > 1:  # the block's gradients follow it; after the last step, one hop home to its owner
                dkv, grad_requests = _exchange(dkv, layout)
                _wait(grad_requests)
            _wait(requests)
            held = incoming
        dk, dv = dkv
        return dq.reshape(query.shape).to(query.dtype), dk.to(key.dtype), dv.to(value.dtype), None, None
