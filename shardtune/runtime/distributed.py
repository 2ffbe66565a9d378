"""Process group, device and rank-0 helpers. Same code for nccl on GPUs and gloo on CPU."""

from __future__ import annotations

import os
import random
import resource
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from shardtune.runtime.elastic import worker_group_attempt

WORKER_ENV_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class DistEnv:
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    device: torch.device
    backend: str

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def num_nodes(self) -> int:
        return max(1, self.world_size // max(1, self.local_world_size))


def is_torchrun_worker() -> bool:
    """True inside a process started by torchrun / torch.distributed.run."""
    return all(v in os.environ for v in WORKER_ENV_VARS)


def local_gpu_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def init_distributed(timeout_s: float = 1800.0) -> DistEnv:
    """Join the process group torchrun prepared: nccl with one GPU per process, else gloo on CPU."""
    rank = int(os.environ["RANK"])
    local_rank = int(os.environ["LOCAL_RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
    if backend == "nccl":
        os.environ.update(nccl_watchdog_env(timeout_s, os.environ))  # read when the process group is created
        if os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] in ("0", "2") and rank == 0:
            print(
                f"shardtune: warning: TORCH_NCCL_ASYNC_ERROR_HANDLING={os.environ['TORCH_NCCL_ASYNC_ERROR_HANDLING']}"
                " does not end the process when a collective fails or times out: a dead peer can hang the job; "
                "unset it (shardtune then sets 3)",
                file=sys.stderr,
                flush=True,
            )
    if not dist.is_initialized():
        kwargs = {"device_id": device} if backend == "nccl" else {}
        timeout = timedelta(seconds=timeout_s)
        store = attempt_store(world_size, timeout)
        if store is None and world_size == 1:  # nothing to meet: no TCP store, so no port open to anyone
            store = dist.HashStore()
        if store is not None:
            kwargs.update(store=store, rank=rank, world_size=world_size)
        dist.init_process_group(backend=backend, timeout=timeout, **kwargs)
    return DistEnv(rank, local_rank, world_size, local_world_size, device, backend)


# torch's default heartbeat timeout of the NCCL watchdog's monitor thread, and the least we set
NCCL_HEARTBEAT_MAX_S, NCCL_HEARTBEAT_MIN_S = 480, 60


def nccl_watchdog_env(dist_timeout_s: float, environ: Mapping[str, str]) -> dict[str, str]:
    """The TORCH_NCCL_* variables that make a dead peer end the job within --dist_timeout, for those not set (a
    value already set is kept). gloo sees a dead peer's closed connection at once (tests/distributed/
    test_no_hangs.py); NCCL often does not: the collective waits, and torch's watchdog thread ends it when the
    process group's timeout (--dist_timeout) has passed. What the watchdog does then is set by the environment,
    read when the process group is created:

    - ``TORCH_NCCL_ASYNC_ERROR_HANDLING=3``: end the process at once, without aborting the communicators first
      (``ncclCommAbort`` can itself hang when a peer is gone; 3 is torch's default, but torchrun's agent sets 1
      for its workers when the variable is unset, so ``shardtune sft`` sets it before the agent starts);
    - ``TORCH_NCCL_ENABLE_MONITORING=1`` and ``TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC``: a watchdog stuck in a CUDA or
      NCCL call cannot end anything; the monitor thread ends the process after this many seconds without a
      heartbeat from it: --dist_timeout, but at least 60 s and at most torch's default 480 s.
    """
    heartbeat_s = int(min(NCCL_HEARTBEAT_MAX_S, max(NCCL_HEARTBEAT_MIN_S, dist_timeout_s)))
    defaults = {
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3",
        "TORCH_NCCL_ENABLE_MONITORING": "1",
        "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": str(heartbeat_s),
    }
    return {k: v for k, v in defaults.items() if not environ.get(k)}


def attempt_store(world_size: int, timeout: timedelta) -> dist.Store | None:
    """The agent's store, with keys prefixed by the restart attempt (None outside torchrun's agent store).

    torchrun's agent keeps one store across worker restarts (--max_restarts) and torch does not prefix the
    process group's keys per attempt, so a restarted rank could read the address its dead predecessor
    published and fail to connect (seen here: gloo "connection refused" after a restart, in about half the
    runs). A prefix per attempt makes every attempt start from empty keys. The attempt is the number every node
    agrees on (shardtune/runtime/elastic.py), not torchrun's per-node restart count: nodes with different prefixes would
    wait for each other until the timeout. The same holds within one worker process that joins a process group a
    second time (a script's ``trainer.train()`` then ``trainer.evaluate()``): destroy_process_group resets torch's
    group names, so the second group would read the first one's addresses (a rank that got there first connected
    to its peer's closed gloo listener: "Connection reset by peer", the peer then waiting in init_process_group
    until the timeout); every process joins its groups in the same order, so a count of them agrees too.
    """
    global _groups_joined
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size, is_master=False, timeout=timeout
    )
    _groups_joined += 1
    return dist.PrefixStore(f"shardtune/attempt_{worker_group_attempt()}/group_{_groups_joined}", store)


_groups_joined = 0  # process groups this worker process has joined through attempt_store


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def seed_everything(seed: int) -> None:
    """Same seed on every rank: model init and dropout masks must not depend on the rank."""
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np

        np.random.seed(seed % 2**32)
    except ImportError:
        pass


def get_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def print0(*args, **kwargs) -> None:
    """Print on global rank 0 only (rank 0 talks; the others stay quiet unless something is wrong)."""
    if get_rank() == 0:
        print(*args, **kwargs, flush=True)


def warn0(message: str) -> None:
    if get_rank() == 0:
        print(f"shardtune: warning: {message}", file=sys.stderr, flush=True)


def all_reduce_sum(values: torch.Tensor, device: torch.device, to_host: bool = True) -> torch.Tensor:
    """Sum a small tensor over all ranks (float64 on the wire so token counts and loss sums stay exact); on the host,
    or (``to_host`` False) left on ``device``, so that a GPU's stream is not waited for."""
    t = values.detach().to(device=device, dtype=torch.float64).clone()
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t.cpu() if to_host else t


def all_reduce_max(values: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The element-wise maximum of a small tensor over all ranks (float64), left on ``device``."""
    t = values.detach().to(device=device, dtype=torch.float64).clone()
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t


def broadcast_from_main(value):
    """Rank 0's value (any picklable object) on every rank: one decision, where each rank deciding alone could
    differ."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]
    return value


def barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def peak_memory_bytes(device: torch.device) -> int:
    """Peak device memory on GPU; peak resident set size of this process on CPU."""
    if device.type == "cuda":
        import torch

        return int(torch.cuda.max_memory_allocated(device))
    rss_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss_kib * (1 if sys.platform == "darwin" else 1024))
