"""A real SLURM cluster on the two test hosts: slurmctld on host A, one slurmd per host, a private munged.

Debian's slurm-wlm (22.05) runs here as root with ``proctrack/linuxproc`` and ``task/none``; slurmd still
wants cgroup controllers mounted, so each slurmd gets them mounted in its own mount namespace. Each node
declares 2 GPUs (GRES backed by character devices made for the purpose) so that ``--gpus-per-node`` works and
srun sets ``SLURM_GPUS_ON_NODE``; CPU torch ignores ``CUDA_VISIBLE_DEVICES``. Everything lives under one
folder: configuration, munge key and socket, state, spool and logs.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import stat
import subprocess
import time
from pathlib import Path

from tests.netns import TwoHosts

DAEMONS = ("slurmctld", "slurmd", "munged", "sbatch", "sinfo")
GPUS_PER_NODE = 2
REQUEUE_DELAY_S = 10
# slurmd refuses to start without cgroup controllers under /sys/fs/cgroup (which `ip netns exec` remounts
# empty), and a cgroup v1 / v2 mix ("hybrid") is not supported: v2 alone where the machine is v2 only,
# else the v1 controllers slurmd looks at
MOUNT_CGROUP_V2 = "mount -t cgroup2 none /sys/fs/cgroup"
MOUNT_CGROUP_V1 = (
    "mount -t tmpfs cgroups /sys/fs/cgroup && for c in freezer cpuset memory devices; do "
    "mkdir -p /sys/fs/cgroup/$c && mount -t cgroup -o $c cgroup /sys/fs/cgroup/$c; done"
)


def cgroup_v2_only() -> bool:
    return all(line.startswith("0::") for line in Path("/proc/self/cgroup").read_text().splitlines())


def missing_programs() -> list[str]:
    return [name for name in DAEMONS if shutil.which(name) is None]


class SlurmCluster:
    def __init__(self, hosts: TwoHosts, root: Path) -> None:
        self.hosts, self.root = hosts, root
        self.conf = root / "slurm.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        self.daemons: list[subprocess.Popen] = []
        self.munged_pid: int | None = None

    def start(self, timeout_s: float = 60) -> None:
        """Write the configuration, start the daemons and wait until both nodes are idle."""
        self.write_config()
        self.start_munged()
        log = open(self.root / "daemons.log", "w")
        mount = MOUNT_CGROUP_V2 if cgroup_v2_only() else MOUNT_CGROUP_V1
        self.daemons.append(self.hosts.popen(0, ["slurmctld", "-D", "-i"], env=self.env, stdout=log, stderr=log))
        for host, name in enumerate(self.hosts.hostnames):
            self.daemons.append(
                self.hosts.popen(
                    host, ["sh", "-c", f"{mount} && exec slurmd -D -N {name}"], env=self.env, stdout=log, stderr=log
                )
            )
        deadline = time.monotonic() + timeout_s
        while self.node_states() != ["idle", "idle"]:
            if time.monotonic() > deadline or any(p.poll() is not None for p in self.daemons):
                raise RuntimeError(
                    f"SLURM did not come up (node states {self.node_states()}):\n"
                    + (self.root / "daemons.log").read_text()[-3000:]
                )
            time.sleep(1)

    def node_states(self) -> list[str]:
        out = self.hosts.run(0, ["sinfo", "-h", "-N", "-o", "%T"], env=self.env, timeout=30)
        return sorted(out.stdout.split())

    def submit(self, args: list[str], env: dict[str, str], cwd: Path) -> subprocess.Popen:
        """``sbatch --wait ARGS`` started on host A; ``finish`` waits for it."""
        return self.hosts.popen(
            0,
            ["sbatch", "--wait", f"--output={self.root / 'job.out'}", *args],
            env={**env, **self.env, "PATH": env["PATH"]},
            cwd=cwd,
        )

    def finish(self, proc: subprocess.Popen, timeout: float) -> tuple[int, str]:
        """The exit status of ``sbatch --wait`` (the job's, after any requeue) and its output and the job's."""
        out, err = proc.communicate(timeout=timeout)
        output = self.root / "job.out"
        return proc.returncode, out + err + (output.read_text() if output.exists() else "")

    def signal(self, job_id: str, name: str) -> None:
        """What SLURM does before a time limit (``--signal``) or on preemption: ``name`` to every task of the
        job's steps (here one ``shardtune sft`` launcher per node), not to the batch script."""
        self.hosts.run(0, ["scancel", f"--signal={name}", job_id], env=self.env, timeout=30, check=True)

    def stop(self) -> None:
        for p in self.daemons:
            p.terminate()
        for p in self.daemons:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
        if self.munged_pid:
            try:
                os.kill(self.munged_pid, signal.SIGTERM)
            except ProcessLookupError:
                pass

    def start_munged(self) -> None:
        key = self.root / "munge.key"
        key.write_bytes(secrets.token_bytes(1024))
        key.chmod(0o400)
        pid_file = self.root / "munged.pid"
        subprocess.run(
            [
                "munged",
                "--force",
                f"--socket={self.root / 'munge.socket'}",
                f"--key-file={key}",
                f"--pid-file={pid_file}",
                f"--log-file={self.root / 'munged.log'}",
                f"--seed-file={self.root / 'munged.seed'}",
            ],
            check=True,
            capture_output=True,
            timeout=30,
        )
        self.munged_pid = int(pid_file.read_text())

    def write_config(self) -> None:
        root = self.root
        for host in self.hosts.hostnames:
            (root / f"spool-{host}").mkdir(parents=True, exist_ok=True)
        (root / "state").mkdir(exist_ok=True)
        devices = []
        for i in range(GPUS_PER_NODE):  # character devices like /dev/null: what slurmd accepts as a GPU file
            device = root / f"gpu{i}"
            if not device.exists():
                os.mknod(device, 0o600 | stat.S_IFCHR, os.makedev(1, 3))
            devices.append(str(device))
        nodes = "".join(
            f"NodeName={h} NodeAddr={a} CPUs=2 Gres=gpu:{GPUS_PER_NODE} State=UNKNOWN\n"
            for h, a in zip(self.hosts.hostnames, self.hosts.addresses)
        )
        self.conf.write_text(
            f"ClusterName=shardtune-test\nSlurmctldHost={self.hosts.hostnames[0]}({self.hosts.addresses[0]})\n"
            "SlurmUser=root\nSlurmdUser=root\nAuthType=auth/munge\nCredType=cred/munge\n"
            # cred_expire is also how long a requeued job waits before it starts again (default 120 s)
            f"AuthInfo=socket={root / 'munge.socket'},cred_expire={REQUEUE_DELAY_S}\n"
            "ProctrackType=proctrack/linuxproc\nTaskPlugin=task/none\nJobAcctGatherType=jobacct_gather/none\n"
            "MpiDefault=none\nReturnToService=2\nSelectType=select/cons_tres\nSelectTypeParameters=CR_CPU\n"
            "GresTypes=gpu\nMailProg=/bin/true\n"
            # sbatch --wait polls the job after 2, 8, then every 32 s, but every 2 s while MinJobAge / 2 <= 2 (a
            # finished job's record is kept that long, at least; default 300 s): it ends 2 s after the job
            "MinJobAge=5\n"
            f"StateSaveLocation={root / 'state'}\nSlurmdSpoolDir={root}/spool-%n\n"
            f"SlurmctldPidFile={root / 'slurmctld.pid'}\nSlurmdPidFile={root}/slurmd-%n.pid\n"
            f"SlurmctldLogFile={root / 'slurmctld.log'}\nSlurmdLogFile={root}/slurmd-%n.log\n"
            f"{nodes}PartitionName=test Nodes=ALL Default=YES MaxTime=INFINITE State=UP\n"
        )
        (root / "gres.conf").write_text(
            "AutoDetect=off\n"
            + "".join(f"NodeName={h} Name=gpu File={','.join(devices)}\n" for h in self.hosts.hostnames)
        )
        (root / "cgroup.conf").write_text(f"CgroupPlugin=cgroup/{'v2' if cgroup_v2_only() else 'v1'}\n")
