"""Two test hosts on one machine: network namespaces with their own address, hostname and hosts file.

Multi-node bugs hide on one host: every launcher shares one hostname, one address and one loopback, so a
rendezvous that resolves the wrong name, a store bound to 127.0.0.1 or a node-local output directory still
"works". Here each host is a network namespace with its own address on a veth pair (``10.77.0.1`` and
``10.77.0.2``; nothing else but loopback is ever targeted), its own hostname (``unshare --uts``) and an
``/etc/hosts`` naming both (``ip netns exec`` bind-mounts ``/etc/netns/<ns>/hosts``). The hostnames matter:
torchrun's c10d rendezvous decides which node hosts its store by matching the endpoint against the machine's
hostname, so two namespaces that share one hostname hang.

Use it through the ``two_hosts`` fixture of tests/multihost/conftest.py (one pair per test session)::

    def test_x(two_hosts, cache_dir):
        procs = [two_hosts.popen(i, [sys.executable, "-m", "shardtune", "sft", "--nnodes", "2", ...,
                                     "--rdzv_endpoint", f"{two_hosts.hostnames[0]}:29500"],
                                 env=cli_env(cache_dir)) for i in (0, 1)]
        outputs = two_hosts.wait(procs, timeout=300)   # [(returncode, stdout, stderr), ...]

or, shorter, through ``sft_on_two_hosts`` (``shardtune sft`` with the c10d flags on both hosts) and
``launch_on_two_hosts`` (any command per host) of the same conftest.

``ip netns exec``, ``unshare`` and ``sh`` all exec, so a Popen's pid is the program's own: signals sent with
``proc.send_signal(SIGUSR1)`` reach it (a ``shardtune sft`` launcher) directly; ``pids(i)`` lists
everything host ``i`` runs (its workers too, e.g. to SIGKILL node 1's workers).
``popen(i, argv, env, node_local_dirs=[d])`` also mounts an empty tmpfs over each ``d`` for host ``i`` only:
the same path is then a different directory on each host, as a node-local disk is. Every host sees the rest
of the file system (the repository, the models, pytest's tmp_path), like nodes with a shared file system.
``GLOO_SOCKET_IFNAME`` is set to the hosts' veth (``st0`` on both, as ``eth0`` is on real nodes: an
environment copied from one node to the other, as sbatch / srun do, stays right). Processes left in the
namespaces are killed and the namespaces and hosts files removed at the end, also when a test fails.

Needs root and iproute2 (``ip``) and util-linux (``unshare``); ``skip_reason()`` says why not when not.
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
from pathlib import Path

ADDRESSES = ("10.77.0.1", "10.77.0.2")
HOSTNAMES = ("hostA", "hostB")
INTERFACE = "st0"  # the veth end's name on each host: the same on both, as eth0 is on real nodes
NETNS_ETC = Path("/etc/netns")


def skip_reason() -> str | None:
    """Why two namespace hosts cannot be made here, or None when they can."""
    if os.geteuid() != 0:
        return "two-host tests need root (network namespaces); CI runs as root"
    for tool, package in (("ip", "iproute2"), ("unshare", "util-linux")):
        if shutil.which(tool) is None:
            return f"two-host tests need `{tool}` (apt-get install {package})"
    return None


def _run(*argv: str) -> None:
    subprocess.run(argv, check=True, capture_output=True, text=True, timeout=30)


class TwoHosts:
    """Two namespace hosts joined by a veth pair; names unique per ``tag`` so concurrent sessions never clash."""

    def __init__(self, tag: str) -> None:
        self.namespaces = (f"st{tag}a", f"st{tag}b")
        self.interface = INTERFACE
        self.hostnames = HOSTNAMES
        self.addresses = ADDRESSES

    def create(self) -> "TwoHosts":
        try:
            for ns in self.namespaces:
                _run("ip", "netns", "add", ns)
            _run(
                "ip",
                "link",
                "add",
                INTERFACE,
                "netns",
                self.namespaces[0],
                "type",
                "veth",
                "peer",
                "name",
                INTERFACE,
                "netns",
                self.namespaces[1],
            )
            hosts = "127.0.0.1 localhost\n" + "".join(f"{a} {h}\n" for a, h in zip(self.addresses, self.hostnames))
            for ns, address in zip(self.namespaces, self.addresses):
                _run("ip", "-n", ns, "addr", "add", f"{address}/24", "dev", INTERFACE)
                _run("ip", "-n", ns, "link", "set", INTERFACE, "up")
                _run("ip", "-n", ns, "link", "set", "lo", "up")
                (NETNS_ETC / ns).mkdir(parents=True, exist_ok=True)
                (NETNS_ETC / ns / "hosts").write_text(hosts)
        except BaseException:
            self.destroy()
            raise
        return self

    def pids(self, host: int) -> list[int]:
        """Every process running on host ``host``."""
        out = subprocess.run(["ip", "netns", "pids", self.namespaces[host]], capture_output=True, text=True).stdout
        return [int(pid) for pid in out.split()]

    def kill_processes(self) -> None:
        """SIGKILL everything still running in the two namespaces (launchers, their workers)."""
        for host in (0, 1):
            for pid in self.pids(host):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass

    def destroy(self) -> None:
        """Kill what still runs in the namespaces, then remove them (the veth pair goes with them)."""
        self.kill_processes()
        for ns in self.namespaces:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
            shutil.rmtree(NETNS_ETC / ns, ignore_errors=True)

    def command(self, host: int, argv: list[str], node_local_dirs: list[Path] = ()) -> list[str]:
        """``argv`` as run on host ``host`` (0 or 1): in its namespace, under its hostname."""
        setup = [f"hostname {self.hostnames[host]}"]
        setup += [
            f"mkdir -p {shlex.quote(str(d))} && mount -t tmpfs tmpfs {shlex.quote(str(d))}" for d in node_local_dirs
        ]
        script = " && ".join(setup) + ' && exec "$@"'
        return [
            "ip",
            "netns",
            "exec",
            self.namespaces[host],
            "unshare",
            "--uts",
            "--mount",
            "--",
            "sh",
            "-c",
            script,
            "sh",
            *argv,
        ]

    def popen(
        self, host: int, argv: list[str], env: dict[str, str], node_local_dirs: list[Path] = (), **kwargs
    ) -> subprocess.Popen:
        """Start ``argv`` on host ``host`` with ``GLOO_SOCKET_IFNAME`` set to its veth; output is captured."""
        env = {**env, "GLOO_SOCKET_IFNAME": INTERFACE}
        kwargs.setdefault("stdout", subprocess.PIPE)
        kwargs.setdefault("stderr", subprocess.PIPE)
        return subprocess.Popen(self.command(host, argv, node_local_dirs), env=env, text=True, **kwargs)

    def run(
        self, host: int, argv: list[str], env: dict[str, str], timeout: float = 60, **kwargs
    ) -> subprocess.CompletedProcess:
        """Run ``argv`` on host ``host`` to completion."""
        return subprocess.run(
            self.command(host, argv),
            env={**env, "GLOO_SOCKET_IFNAME": INTERFACE},
            capture_output=True,
            text=True,
            timeout=timeout,
            **kwargs,
        )

    def wait(self, procs: list[subprocess.Popen], timeout: float) -> list[tuple[int, str, str]]:
        """(returncode, stdout, stderr) of each process; everything on both hosts is killed past ``timeout``."""
        try:
            outputs = [p.communicate(timeout=timeout) for p in procs]
        except subprocess.TimeoutExpired:
            self.kill_processes()
            raise
        return [(p.returncode, out, err) for p, (out, err) in zip(procs, outputs)]
