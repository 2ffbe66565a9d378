"""``shardtune doctor``: check a machine or a cluster before a long run, under the same launcher as training.

    shardtune doctor --nproc_per_node 8                                   # one node
    shardtune doctor --nnodes 2 --nproc_per_node 8 --rdzv_backend c10d --rdzv_endpoint HOST:29500 ...  # each node

Every rank reports its host, versions, device and communication environment; rank 0 prints them grouped by node,
the topology torchrun resolved, the all-reduce / all-gather bus bandwidth across all ranks and across nodes only,
and what is wrong, in words. Exit status 0: no problem found; 1: problems (listed).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import platform
import socket
import sys
import time

from shardtune.config.schema import ConfigError

# Where the workers tell the launcher of their node how many problems they found (a finding, not a crash).
RESULT_ENV = "SHARDTUNE_DOCTOR_RESULT"
# The environment that decides how collectives travel (NCCL / gloo / torch's NCCL watchdog) and where.
COMM_ENV_PREFIXES = ("NCCL_", "GLOO_", "TORCH_NCCL_", "TORCH_DISTRIBUTED_")
COMM_ENV_NAMES = ("CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS", "MASTER_ADDR", "MASTER_PORT")
PACKAGES = ("torch", "transformers", "peft", "accelerate", "deepspeed", "bitsandbytes")
# Bus bandwidth below which a GPU interconnect is called slow (GB/s); gloo on CPU is not judged.
SLOW_GPU_BUS_GB_S = {"all ranks": 20.0, "across nodes": 5.0}


def parse_doctor_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="shardtune doctor",
        description="check versions, devices, topology, collective bandwidth and the NCCL / gloo environment of "
        "every rank; torchrun's flags (--nproc_per_node, --nnodes, --rdzv_endpoint ...) pass through",
    )
    parser.add_argument(
        "--bandwidth_mb",
        type=float,
        default=64.0,
        help="size of the all-reduce / all-gather test tensor per rank, in MB (default 64)",
    )
    parser.add_argument("--bandwidth_iters", type=int, default=5, help="timed repetitions (after one warm-up)")
    args = parser.parse_args(argv)
    if args.bandwidth_iters < 1:
        raise ConfigError(
            f"--bandwidth_iters {args.bandwidth_iters} must be >= 1: the bandwidth is timed over that many repetitions"
        )
    if not args.bandwidth_mb > 0:
        raise ConfigError(f"--bandwidth_mb {args.bandwidth_mb} must be a positive size in MB, e.g. 64")
    return args


def package_version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def rank_report(device) -> dict:
    """What this rank sees: host, versions, device, communication environment."""
    import torch

    versions = {"python": platform.python_version(), **{name: package_version(name) for name in PACKAGES}}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(device)
        device_text = f"{props.name} ({props.total_memory / 2**30:.0f} GiB), CUDA {torch.version.cuda}"
    else:
        device_text = "CPU"
    comm_env = {k: v for k, v in sorted(os.environ.items()) if k.startswith(COMM_ENV_PREFIXES) or k in COMM_ENV_NAMES}
    hostname = socket.gethostname()
    try:
        address = socket.gethostbyname(hostname)
    except OSError as e:
        address = f"unresolved ({e.strerror})"
    return {
        "rank": int(os.environ["RANK"]),
        "node": int(os.environ.get("GROUP_RANK", "0")),
        "local_rank": int(os.environ["LOCAL_RANK"]),
        "hostname": hostname,
        "address": address,
        "versions": versions,
        "device": device_text,
        "visible_gpus": torch.cuda.device_count(),
        "env": comm_env,
    }


def bus_bandwidth_gb_s(op: str, group, numel: int, iters: int, device) -> float:
    """nccl-tests' bus bandwidth: bytes per rank x the algorithm factor / time (comparable across group sizes)."""
    import torch
    import torch.distributed as dist

    n = dist.get_world_size(group)
    tensor = torch.ones(numel, dtype=torch.float32, device=device)
    gathered = torch.empty(numel * n, dtype=torch.float32, device=device)

    def once() -> None:
        if op == "all_reduce":
            dist.all_reduce(tensor, group=group)
        else:
            dist.all_gather_single(gathered, tensor, group=group)

    once()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dist.barrier(group=group)
    started = time.perf_counter()
    for _ in range(iters):
        once()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elapsed_s = (time.perf_counter() - started) / iters
    size_bytes = numel * 4 * (n if op == "all_gather" else 1)
    factor = 2 * (n - 1) / n if op == "all_reduce" else (n - 1) / n
    return size_bytes * factor / elapsed_s / 1e9


def bandwidth_table(args: argparse.Namespace, env) -> dict[str, dict[str, float]]:
    """Bus bandwidth per group: all ranks, and one rank per node (every node's local rank 0) across nodes."""
    import torch.distributed as dist

    numel = max(1, int(args.bandwidth_mb * 1e6 / 4))
    if env.world_size == 1:  # nothing crosses a link: no bandwidth to report
        return {}
    groups = {"all ranks": None}
    if env.num_nodes > 1:
        # every rank creates every group (new_group is collective); only members measure
        per_local_rank = [
            dist.new_group(list(range(local, env.world_size, env.local_world_size)))
            for local in range(env.local_world_size)
        ]
        groups["across nodes"] = per_local_rank[env.local_rank] if env.local_rank == 0 else None
    table: dict[str, dict[str, float]] = {}
    for name, group in groups.items():
        if name == "across nodes" and group is None:
            continue
        table[name] = {
            op: bus_bandwidth_gb_s(op, group, numel, args.bandwidth_iters, env.device)
            for op in ("all_reduce", "all_gather")
        }
    return table


def problems_found(reports: list[dict], env, bandwidth: dict) -> list[str]:
    """What is wrong, in words, each with what to do."""
    problems = []
    for field in ("python", *PACKAGES):
        seen: dict[str, list[int]] = {}
        for r in reports:
            seen.setdefault(r["versions"][field], []).append(r["node"])
        if len(seen) > 1:
            listed = "; ".join(f"{v} on node(s) {sorted(set(n))}" for v, n in seen.items())
            problems.append(f"{field} differs between ranks ({listed}): install the same versions everywhere")
    for name in sorted({k for r in reports for k in r["env"]} - {"MASTER_ADDR", "MASTER_PORT"}):
        values = {r["env"].get(name, "(unset)") for r in reports}
        if len(values) > 1:
            problems.append(
                f"{name} differs between ranks ({', '.join(sorted(values))}): set it the same on every "
                "node, or on purpose per node (e.g. an interface name)"
            )
    hostnames = {r["node"]: r["hostname"] for r in reports}
    if env.num_nodes > 1:
        if len(set(hostnames.values())) < env.num_nodes:
            problems.append(
                f"nodes share a host name ({sorted(set(hostnames.values()))}): torchrun's c10d "
                "rendezvous picks the node that hosts its store by host name; give each node its own "
                "name, or pass --rdzv_conf is_host=1 on the first node only"
            )
        loopback = sorted({r["node"] for r in reports if r["address"].startswith("127.")})
        if loopback:
            problems.append(
                f"the host name of node(s) {loopback} resolves to a loopback address (127.x): other "
                "nodes cannot reach them by it; fix /etc/hosts or DNS, or pass --local_addr ADDRESS"
            )
    for r in reports:
        if r["visible_gpus"] and env.local_world_size != r["visible_gpus"] and r["local_rank"] == 0:
            problems.append(
                f"node {r['node']} runs {env.local_world_size} processes but sees {r['visible_gpus']} "
                "GPUs: pass --nproc_per_node equal to the GPU count to use them all"
            )
        if r["env"].get("NCCL_IB_DISABLE") == "1" and r["local_rank"] == 0 and env.num_nodes > 1:
            problems.append(
                f"NCCL_IB_DISABLE=1 on node {r['node']}: cross-node traffic goes over TCP sockets, "
                "unset it if the nodes have InfiniBand / RoCE"
            )
    if env.backend == "nccl":
        for group, ops in bandwidth.items():
            slow = {op: gb for op, gb in ops.items() if gb < SLOW_GPU_BUS_GB_S[group]}
            if slow:
                problems.append(
                    f"{group}: bus bandwidth {', '.join(f'{op} {gb:.1f} GB/s' for op, gb in slow.items())}"
                    f" is below {SLOW_GPU_BUS_GB_S[group]:.0f} GB/s: check NCCL_SOCKET_IFNAME / "
                    "InfiniBand (NCCL_DEBUG=INFO says which transport is used); across slow links, "
                    "prefer --fsdp_config.sharding_strategy HYBRID_SHARD"
                )
    return problems


def render(reports: list[dict], env, bandwidth: dict, problems: list[str]) -> str:
    lines = [
        f"topology: {env.num_nodes} node(s) x {env.local_world_size} process(es) = world size "
        f"{env.world_size}, backend {env.backend}, rendezvous store {os.environ.get('MASTER_ADDR')}:"
        f"{os.environ.get('MASTER_PORT')}, run id {os.environ.get('TORCHELASTIC_RUN_ID', '-')}"
    ]
    for node in sorted({r["node"] for r in reports}):
        first = next(r for r in reports if r["node"] == node)
        ranks = [r["rank"] for r in reports if r["node"] == node]
        lines.append(
            f"node {node}: host {first['hostname']} ({first['address']}), ranks {ranks}, device {first['device']}"
        )
        lines.append("  versions: " + ", ".join(f"{k} {v}" for k, v in first["versions"].items()))
        env_text = ", ".join(f"{k}={v}" for k, v in first["env"].items()) or "(none set)"
        lines.append(f"  communication environment: {env_text}")
    if not bandwidth:
        lines.append("bandwidth: not measured (one rank: no collective traffic)")
    for group, ops in bandwidth.items():
        lines.append(
            f"bandwidth ({group}): "
            + ", ".join(f"{op} {gb:.2f} GB/s" for op, gb in ops.items())
            + " (bus bandwidth, as nccl-tests reports it)"
        )
    lines += [f"problem: {p}" for p in problems] or ["no problem found"]
    return "\n".join(lines)


def run_worker(args: argparse.Namespace) -> int:
    import torch.distributed as dist

    from shardtune.runtime.distributed import init_distributed, shutdown

    env = init_distributed(timeout_s=300)
    try:
        reports: list = [None] * env.world_size
        dist.all_gather_object(reports, rank_report(env.device))
        shared = [bandwidth_table(args, env)]  # rank 0's (a local rank 0: it measured across nodes too)
        dist.broadcast_object_list(shared, src=0)
        bandwidth = shared[0]
        problems = problems_found(reports, env, bandwidth)
        if env.is_main:
            print(render(reports, env, bandwidth, problems), flush=True)
        if env.local_rank == 0 and os.environ.get(RESULT_ENV):
            with open(os.environ[RESULT_ENV], "w") as f:
                f.write(str(len(problems)))
    finally:
        shutdown()
    return 0  # problems are findings, not a failure of the workers: the launcher turns them into exit status 1


def problems_reported(path: str) -> int:
    """The number of problems the workers of this node wrote (0 when they wrote nothing)."""
    try:
        with open(path) as f:
            return int(f.read().strip() or 0)
    except (OSError, ValueError):
        return 0


def main(argv: list[str] | None = None) -> int:
    import tempfile

    from shardtune.config.argv import split_argv
    from shardtune.launch.torchrun import launch, resolve_here
    from shardtune.runtime.distributed import is_torchrun_worker

    argv = sys.argv[1:] if argv is None else argv
    if {"-h", "--help"} & set(argv):
        parse_doctor_args(["--help"])  # prints the help and exits
    try:
        split = split_argv(argv)
        launch_args, rest = split.launcher, split.training_argv()
        args = parse_doctor_args(rest)
        if is_torchrun_worker():
            return run_worker(args)
        topology = resolve_here(launch_args)
    except ConfigError as e:
        print(f"shardtune: error: {e}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="shardtune-doctor-") as tmp:
        os.environ[RESULT_ENV] = os.path.join(tmp, "problems")
        status = launch(topology, "shardtune.commands.doctor", rest, what="the checks")
        found = problems_reported(os.environ.pop(RESULT_ENV))
    if status == 0 and found:
        print(f"shardtune doctor: {found} problem(s) found (listed in global rank 0's report)", file=sys.stderr)
        return 1
    return status


if __name__ == "__main__":
    sys.exit(main())
