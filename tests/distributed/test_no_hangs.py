"""Many nodes never hang: a node that does not come, or a rank that dies, ends the job with one line.

Two simulated nodes are two launchers on this host (c10d rendezvous on 127.0.0.1), as in test_checkpoint.py.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from tests.conftest import REPO, cli_env
from tests.distributed.test_checkpoint import (
    COMMON, finish, free_port, logged_steps, start_two_nodes, wait_for, worker_pids,
)


def test_a_node_that_never_joins_is_named_within_the_join_timeout(tiny_model, cache_dir, tmp_path):
    endpoint = f"127.0.0.1:{free_port()}"
    args = ["sft", "--nnodes", 2, "--node_rank", 0, "--nproc_per_node", 1, "--rdzv_backend", "c10d",
            "--rdzv_endpoint", endpoint, "--rdzv_id", "lonely", "--rdzv_conf", "join_timeout=15",
            "--model_name", tiny_model, "--output_dir", tmp_path / "run", *COMMON]
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "shardtune", *map(str, args)], capture_output=True, text=True,
                          timeout=300, env=cli_env(cache_dir), cwd=REPO)
    elapsed_s = time.monotonic() - started
    errors = [line for line in proc.stderr.splitlines() if line.startswith("shardtune: error:")]
    assert proc.returncode == 1 and len(errors) == 1, proc.stderr[-3000:]
    assert f"rendezvous at {endpoint} (--rdzv_id lonely): 1 of 2 nodes joined within 15 s" in errors[0]
    assert "same --nnodes and --rdzv_id" in errors[0] and "firewall" in errors[0]
    assert "Traceback" not in proc.stderr
    assert elapsed_s < 150, elapsed_s  # start-up + 15 s, not torchrun's default 600 s
    print(f"node that never joined: error after {elapsed_s:.1f} s (join timeout 15 s, start-up included)")


def test_a_dead_rank_on_node_1_ends_node_0_within_seconds(tiny_model, cache_dir, tmp_path):
    """Not after --dist_timeout: the surviving rank's collective fails as soon as its peer is gone."""
    out = tmp_path / "run"
    nodes = start_two_nodes(cache_dir, tiny_model, out, "--save_steps", 0, "--dist_timeout", 300)
    try:
        wait_for(lambda: True if logged_steps(out) >= 3 else None, nodes[0], "step 3")
        os.kill(wait_for(lambda: worker_pids(nodes[1].pid).get(0), nodes[1], "node 1's worker was found"),
                signal.SIGKILL)
        killed = time.monotonic()
        nodes[0].wait(timeout=250)
        node0_s = time.monotonic() - killed
    finally:
        outputs = finish(nodes)
    assert [p.returncode for p in nodes] == [1, 1]
    assert "shardtune: training failed: rank 1 exited with code -9" in outputs[1][1]
    assert "shardtune: training failed: rank 0 exited with code 1" in outputs[0][1]
    assert node0_s < 60, node0_s
    print(f"node 0 ended {node0_s:.1f} s after node 1's rank died")
