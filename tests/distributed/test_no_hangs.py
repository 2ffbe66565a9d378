"""Many nodes never hang: a node that does not come, or a rank that dies, ends the job with one line.

Two simulated nodes are two launchers on this host (c10d rendezvous on 127.0.0.1), as in test_checkpoint.py.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time

from shardtune.launch.torchrun import DEFAULT_JOIN_TIMEOUT_S
from tests.conftest import REPO, cli_env, shardtune_argv
from tests.distributed.test_checkpoint import (
    COMMON,
    finish,
    free_port,
    start_two_nodes,
    worker_pids,
)
from tests.helpers import logged_steps, wait_for


def test_a_node_that_never_joins_is_named_within_the_join_timeout(tiny_model, cache_dir, tmp_path):
    endpoint = f"127.0.0.1:{free_port()}"
    args = [
        "sft",
        "--nnodes",
        2,
        "--node_rank",
        0,
        "--nproc_per_node",
        1,
        "--rdzv_backend",
        "c10d",
        "--rdzv_endpoint",
        endpoint,
        "--rdzv_id",
        "lonely",
        "--rdzv_conf",
        "join_timeout=10",
        "--model_name",
        tiny_model,
        "--output_dir",
        tmp_path / "run",
        *COMMON,
    ]
    started = time.monotonic()
    # no hang until torchrun's default join timeout: past half of it the run's own timeout fails the test
    proc = subprocess.run(
        shardtune_argv(*args),
        capture_output=True,
        text=True,
        timeout=DEFAULT_JOIN_TIMEOUT_S / 2,
        env=cli_env(cache_dir),
        cwd=REPO,
    )
    elapsed_s = time.monotonic() - started
    errors = [line for line in proc.stderr.splitlines() if line.startswith("shardtune: error:")]
    assert proc.returncode == 1 and len(errors) == 1, proc.stderr[-3000:]
    assert f"rendezvous at {endpoint} (--rdzv_id lonely): 1 of 2 nodes joined within 10 s" in errors[0]
    assert "same --nnodes and --rdzv_id" in errors[0] and "firewall" in errors[0]
    assert "Traceback" not in proc.stderr
    print(f"node that never joined: error after {elapsed_s:.1f} s (join timeout 10 s, start-up included)")


def test_a_dead_rank_on_node_1_ends_node_0_within_seconds(tiny_model, cache_dir, tmp_path):
    """Not after --dist_timeout: the surviving rank's collective fails as soon as its peer is gone."""
    out = tmp_path / "run"
    nodes = start_two_nodes(cache_dir, tiny_model, out, "--save_steps", 0, "--dist_timeout", 300)
    try:
        wait_for(lambda: True if logged_steps(out) >= 3 else None, nodes[0], "step 3")
        os.kill(
            wait_for(lambda: worker_pids(nodes[1].pid).get(0), nodes[1], "node 1's worker was found"), signal.SIGKILL
        )
        killed = time.monotonic()
        nodes[0].wait(timeout=250)
        node0_s = time.monotonic() - killed
    finally:
        outputs = finish(nodes)
    assert [p.returncode for p in nodes] == [1, 1]
    # c10d assigns global ranks by arrival: node 1's worker may be rank 0 or 1
    assert re.search(r"shardtune: training failed: rank \d exited with code -9", outputs[1][1]), outputs[1][1][-2000:]
    # node 0's worker fails in a collective with its peer gone: one line, recorded by the worker
    # (shardtune.training.engine.worker)
    assert re.search(
        r"shardtune: error: rank \d: RuntimeError: .*(Connection reset|Connection closed|peer)", outputs[0][1]
    ), outputs[0][1][-2000:]
    assert "Traceback" not in outputs[0][1]
    assert node0_s < 60, node0_s
    print(f"node 0 ended {node0_s:.1f} s after node 1's rank died")


def test_doctor_on_two_nodes_reports_topology_bandwidth_and_what_is_wrong(cache_dir, tmp_path):
    """Two simulated nodes on one host: the shared host name and its loopback address are real problems for
    real nodes; NCCL_IB_DISABLE set on node 1 only is the planted one."""
    endpoint = f"127.0.0.1:{free_port()}"
    nodes = []
    for node_rank in (0, 1):
        args = [
            "doctor",
            "--nnodes",
            2,
            "--node_rank",
            node_rank,
            "--nproc_per_node",
            1,
            "--rdzv_backend",
            "c10d",
            "--rdzv_endpoint",
            endpoint,
            "--rdzv_id",
            "doctor",
            "--rdzv_conf",
            f"is_host={int(node_rank == 0)}",
            "--bandwidth_mb",
            1,
        ]
        env = {**cli_env(cache_dir), "OMP_NUM_THREADS": "1", **({"NCCL_IB_DISABLE": "1"} if node_rank else {})}
        nodes.append(
            subprocess.Popen(
                shardtune_argv(*args),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=env,
                cwd=REPO,
                start_new_session=True,
            )
        )
    outputs = finish(nodes)
    report = outputs[0][0] + outputs[1][0]  # global rank 0 (which prints) is on either launcher
    assert [p.returncode for p in nodes] == [1, 1], outputs[0][1][-3000:]
    assert "topology: 2 node(s) x 1 process(es) = world size 2, backend gloo" in report
    assert "node 0: host" in report and "node 1: host" in report and "ranks [1], device CPU" in report
    assert "versions: python" in report and "torch 2." in report
    assert "communication environment:" in report and "NCCL_IB_DISABLE=1" in report
    for group in ("all ranks", "across nodes"):
        line = next(line for line in report.splitlines() if line.startswith(f"bandwidth ({group}):"))
        assert float(line.split("all_reduce ")[1].split(" GB/s")[0]) > 0, line
    problems = [line for line in report.splitlines() if line.startswith("problem:")]
    assert any("NCCL_IB_DISABLE differs between ranks" in p for p in problems), problems
    assert any(
        re.search(r"NCCL_IB_DISABLE=1 on node \d: cross-node traffic goes over TCP sockets", p) for p in problems
    ), problems
    assert any("nodes share a host name" in p for p in problems), problems
    # the problems are findings, not a crash of the checks: exit status 1 with a line saying so on every node
    assert all(
        "shardtune doctor: " in err and "problem(s) found" in err and "exited with code" not in err
        for _out, err in outputs
    ), [err[-1000:] for _out, err in outputs]


def test_doctor_on_one_node_judges_only_what_matters_there(run_cli):
    """One node, one rank: NCCL_IB_DISABLE is no cross-node problem, no bandwidth of 0.00 GB/s is reported (there is
    no link), nothing is wrong so the exit status is 0; an impossible --bandwidth_iters is one line before launch."""
    proc = run_cli("doctor", "--nproc_per_node", 1, "--bandwidth_mb", 1, env={"NCCL_IB_DISABLE": "1"}, check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "NCCL_IB_DISABLE=1" in proc.stdout  # reported in the environment, not judged
    assert "problem:" not in proc.stdout and "no problem found" in proc.stdout
    assert "bandwidth: not measured (one rank: no collective traffic)" in proc.stdout
    assert "0.00 GB/s" not in proc.stdout
    bad = run_cli("doctor", "--bandwidth_iters", 0, check=False)
    assert bad.returncode == 2 and bad.stderr.strip().splitlines() == [
        "shardtune: error: --bandwidth_iters 0 must be >= 1: the bandwidth is timed over that many repetitions"
    ]
