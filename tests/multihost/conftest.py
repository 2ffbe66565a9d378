"""Fixtures for tests that run shardtune on two hosts (network namespaces; see tests/netns.py for the rig).

``two_hosts``: a TwoHosts pair made once per session (skipped with the reason when not root or ``ip`` is
missing); after each test whatever it left running on the hosts is killed. ``launch_on_two_hosts`` runs one
command per host at the same time and returns both results; ``sft_on_two_hosts`` does it for
``python -m shardtune sft`` with the c10d rendezvous on host A (the TRL guide's manual commands).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, cli_env
from tests.netns import TwoHosts, skip_reason

RDZV_PORT = 29500  # a fixed port is safe: each session's namespaces have their own network stack


@pytest.fixture(scope="session")
def two_hosts_session():
    reason = skip_reason()
    if reason:
        pytest.skip(reason)
    hosts = TwoHosts(tag=str(os.getpid() % 100000)).create()
    try:
        yield hosts
    finally:
        hosts.destroy()


@pytest.fixture
def two_hosts(two_hosts_session):
    yield two_hosts_session
    two_hosts_session.kill_processes()


@pytest.fixture
def launch_on_two_hosts(two_hosts, cache_dir):
    """``launch(argvs, env_per_host=None, node_local_dirs=None, timeout=300)`` runs argvs[i] on host i."""

    def launch(
        argvs: list[list[str]],
        env_per_host: list[dict] | None = None,
        node_local_dirs: list[list[Path]] | None = None,
        timeout: float = 300,
    ) -> list[tuple[int, str, str]]:
        procs = [
            two_hosts.popen(
                host,
                argv,
                env={**cli_env(cache_dir), **(env_per_host or [{}, {}])[host]},
                node_local_dirs=(node_local_dirs or [[], []])[host],
                cwd=REPO,
            )
            for host, argv in enumerate(argvs)
        ]
        return two_hosts.wait(procs, timeout)

    return launch


def sft_argvs(two_hosts, nproc_per_node: int, args: list, args_per_host: list[list] | None = None) -> list[list[str]]:
    """``shardtune sft`` for each host with torchrun's multi-node flags, c10d rendezvous on host A."""
    return [
        [
            sys.executable,
            "-m",
            "shardtune",
            "sft",
            "--nnodes",
            "2",
            "--nproc_per_node",
            str(nproc_per_node),
            "--node_rank",
            str(host),
            "--rdzv_backend",
            "c10d",
            "--rdzv_id",
            "two-hosts",
            "--rdzv_endpoint",
            f"{two_hosts.hostnames[0]}:{RDZV_PORT}",
            *map(str, args),
            *map(str, (args_per_host or [[], []])[host]),
        ]
        for host in (0, 1)
    ]


@pytest.fixture
def sft_on_two_hosts(launch_on_two_hosts, two_hosts):
    """``sft(nproc_per_node, args, args_per_host=None, **launch_kwargs)``: ``shardtune sft`` on both hosts
    with torchrun's multi-node flags, c10d rendezvous on host A; returns [(returncode, stdout, stderr)] x 2."""

    def sft(
        nproc_per_node: int, args: list[str], args_per_host: list[list[str]] | None = None, **launch_kwargs
    ) -> list[tuple[int, str, str]]:
        return launch_on_two_hosts(sft_argvs(two_hosts, nproc_per_node, args, args_per_host), **launch_kwargs)

    return sft


def assert_succeeded(results: list[tuple[int, str, str]]) -> None:
    for host, (code, out, err) in enumerate(results):
        assert code == 0, f"host {host} exited {code}\n--- stdout\n{out[-3000:]}\n--- stderr\n{err[-5000:]}"
