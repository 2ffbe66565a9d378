"""Ring attention (context parallelism) on real gloo processes equals one process's per-document causal SDPA.

Each launch runs C processes (tests/distributed/ring_probe.py); each holds two load-balanced chunks of a 3072-token
row and computes its output and dq / dk / dv with K/V rotating around the ring. Here the whole row is computed in
one process and every rank's slice is compared, forward and backward, GQA (4 query heads on 2 KV heads).
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from tests.conftest import REPO, cli_env
from tests.distributed.ring_probe import ROWS, local_tokens, make_row, reference_attention

TOLERANCE = 1e-5  # max |ring - reference| / max |reference|, per tensor


def reference(name: str) -> dict[str, torch.Tensor]:
    row = make_row(list(ROWS).index(name))
    inputs = {n: row[n].clone().requires_grad_() for n in ("query", "key", "value")}
    out = reference_attention(**inputs, bounds=ROWS[name])
    out.backward(row["grad_out"])
    return {"out": out.detach(), **{f"d{n[0]}": t.grad for n, t in inputs.items()}}


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max())


def launch_ring(world_size: int, out_dir, cache_dir) -> list[dict]:
    subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            str(world_size),
            "tests/distributed/ring_probe.py",
            str(out_dir),
        ],
        check=True,
        capture_output=True,
        text=True,
        env={**cli_env(cache_dir), "OMP_NUM_THREADS": "1"},
        cwd=REPO,
        timeout=300,
    )
    return [torch.load(out_dir / f"rank{r}.pt") for r in range(world_size)]


@pytest.mark.parametrize("world_size", [2, 4])
def test_ring_attention_equals_one_process_forward_and_backward(world_size, tmp_path, cache_dir):
    ranks = launch_ring(world_size, tmp_path, cache_dir)
    references = {name: reference(name) for name in ROWS}
    worst = {}
    for rank in ranks:
        chunk_ids, chunk_len = rank["chunk_ids"], rank["chunk_len"]
        for name, want in references.items():
            for what in ("out", "dq", "dk", "dv"):
                token_dim = 1 if what == "out" else 2
                error = relative_error(rank[name][what], local_tokens(want[what], chunk_ids, chunk_len, token_dim))
                worst[name, what] = max(worst.get((name, what), 0.0), error)
        # controls: the comparison detects attention across documents and mislabelled chunks
        packed_out = local_tokens(references["packed"]["out"], chunk_ids, chunk_len, 1)
        assert relative_error(rank["control_no_boundaries"]["out"], packed_out) > 1e-2
        assert relative_error(rank["control_wrong_chunks"]["out"], packed_out) > 1e-2
    print(f"C={world_size} worst relative errors:", {f"{n}.{w}": f"{e:.1e}" for (n, w), e in worst.items()})
    assert max(worst.values()) <= TOLERANCE, worst
