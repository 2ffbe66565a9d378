"""One restart count for the whole job (shardtune/runtime/elastic.py) and the NCCL watchdog's settings.

Real torch stores and torchrun's real c10d rendezvous handler, in this process; the two-host run where a lost
node is restarted is tests/multihost/test_two_hosts.py.
"""

from __future__ import annotations

import os
import threading
from datetime import timedelta

import pytest
import torch.distributed as dist
from torch.distributed.elastic.rendezvous import RendezvousParameters, rendezvous_handler_registry
from torch.distributed.run import get_args_parser

from shardtune.launch.rendezvous import agree_on_attempt, count_attempts_across_nodes, counting_backend
from shardtune.runtime.distributed import nccl_watchdog_env
from shardtune.runtime.elastic import ATTEMPT_ENV, worker_group_attempt


def test_every_agent_of_a_round_gets_the_same_attempt_and_later_rounds_larger_ones():
    """Three rounds of three agents; the agents other than group rank 0 ask first (they wait for its answer), and
    which agent is group rank 0 changes: the count lives in the store, not in an agent."""
    base = dist.HashStore()
    base.set_timeout(timedelta(seconds=20))
    agreed = []
    for round_ in range(3):
        store = dist.PrefixStore(f"torch.rendezvous.job.{round_}", base)  # as the dynamic rendezvous prefixes it
        answers: dict[int, int] = {}
        waiting = [
            threading.Thread(
                target=lambda r=r, answers=answers, store=store: answers.__setitem__(
                    r, agree_on_attempt(store, r, "job")
                )
            )
            for r in (1, 2)
        ]
        for thread in waiting:
            thread.start()
        answers[0] = agree_on_attempt(store, 0, "job")
        for thread in waiting:
            thread.join(timeout=20)
        assert len(set(answers.values())) == 1, answers
        agreed.append(answers[0])
    assert agreed == [0, 1, 2]
    # another run id in the same store counts on its own
    assert agree_on_attempt(dist.PrefixStore("torch.rendezvous.other.0", base), 0, "other") == 0
    # a store that is not a prefixed one has nothing that outlives a round: no count (the per-node one applies)
    assert agree_on_attempt(base, 0, "job") is None


def test_workers_read_the_agreed_attempt_else_torchruns_own_count():
    assert worker_group_attempt({ATTEMPT_ENV: "2", "TORCHELASTIC_RESTART_COUNT": "0"}) == 2
    assert worker_group_attempt({"TORCHELASTIC_RESTART_COUNT": "1"}) == 1
    assert worker_group_attempt({}) == 0


def parsed(*argv: str):
    return get_args_parser().parse_args([*argv, "-m", "shardtune.sft"])


def test_the_launcher_counts_with_dynamic_rendezvous_and_leaves_static_alone():
    standalone = parsed("--standalone", "--nproc_per_node=2")
    count_attempts_across_nodes(standalone)
    assert (standalone.standalone, standalone.rdzv_backend, standalone.rdzv_endpoint) == (
        False,
        "shardtune-c10d",
        "localhost:0",
    )
    c10d = parsed("--nnodes=2", "--rdzv_backend=c10d", "--rdzv_endpoint=hostA:29500", "--rdzv_id=7")
    count_attempts_across_nodes(c10d)
    count_attempts_across_nodes(c10d)  # idempotent
    assert (c10d.rdzv_backend, c10d.rdzv_endpoint, c10d.rdzv_id) == ("shardtune-c10d", "hostA:29500", "7")
    static = parsed("--nnodes=2", "--master_addr=hostA", "--master_port=29500")
    count_attempts_across_nodes(static)
    assert static.rdzv_backend == "static"


def test_the_wrapped_c10d_handler_sets_the_attempt_after_each_rendezvous(monkeypatch):
    """torchrun's own c10d rendezvous, one node, in this process: each next_rendezvous is a new round."""
    monkeypatch.setenv(ATTEMPT_ENV, "")  # recorded, so that what the handler sets is undone after the test
    monkeypatch.delenv(ATTEMPT_ENV)
    params = RendezvousParameters(
        counting_backend("c10d"),
        "localhost:0",
        "unit-test",
        1,
        1,
        is_host=True,
        join_timeout=20,
        last_call_timeout=1,
        close_timeout=5,
    )
    handler = rendezvous_handler_registry.create_handler(params)
    try:
        assert handler.get_backend() == "shardtune-c10d" and handler.get_run_id() == "unit-test"
        seen = []
        for _ in range(2):
            info = handler.next_rendezvous()
            assert (info.rank, info.world_size) == (0, 1)
            seen.append(os.environ[ATTEMPT_ENV])
        assert seen == ["0", "1"]
        assert handler.num_nodes_waiting() == 0
    finally:
        handler.shutdown()


@pytest.mark.parametrize(("dist_timeout", "heartbeat"), [(1800, "480"), (300, "300"), (10, "60")])
def test_nccl_watchdog_ends_a_process_with_a_dead_peer_within_the_timeout(dist_timeout, heartbeat):
    """Unit only: no GPUs here to watch NCCL's watchdog fire."""
    assert nccl_watchdog_env(dist_timeout, {}) == {
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3",
        "TORCH_NCCL_ENABLE_MONITORING": "1",
        "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": heartbeat,
    }
    # what the user (or torchrun's agent) set is kept
    assert nccl_watchdog_env(
        dist_timeout, {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1", "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": "900"}
    ) == {"TORCH_NCCL_ENABLE_MONITORING": "1"}
