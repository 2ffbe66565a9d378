"""Stop cleanly on SIGTERM / SIGUSR1: finish the optimizer step, write a checkpoint, exit with EXIT_PREEMPTED.

SLURM sends SIGUSR1 before a time limit (``#SBATCH --signal=USR1@120``) and on preemption; Kubernetes sends
SIGTERM and waits its grace period. The signal may reach every process (SLURM signals the whole job step), only
the launcher (Kubernetes signals the container's first process) or only one node. So:

- the launcher (``shardtune sft``) handles both signals itself instead of torchrun's agent, which would pass them
  on as a death signal and SIGKILL the workers 30 s later: it writes a "stop requested" file into a per-launch
  control folder whose path the workers inherit (``SHARDTUNE_CONTROL_DIR``); a second signal falls back to
  torchrun's shutdown (terminate the workers now);
- every worker handles both signals too (a flag), and after each optimizer step all ranks agree with one
  all-reduce whether any rank saw the flag or the file: the decision to stop is collective, so every node stops
  after the same step and writes the same checkpoint;
- workers then exit 0 (so no agent restarts them and every node's agent passes torchrun's exit barrier), and
  local rank 0 of each node leaves a "stopped" file for its launcher, which exits with EXIT_PREEMPTED.

SIGINT (Ctrl-C, which the terminal sends to the launcher and every worker at once) is the same stop, ending with
EXIT_INTERRUPTED (130, what a shell reports for Ctrl-C) instead of a traceback per rank. A second signal
terminates at once: the launcher leaves a "terminate" file and lets torchrun's agent send SIGTERM to the workers,
and a worker that receives a signal after a first one, or with that file present, dies of it at once.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist

# sysexits.h EX_TEMPFAIL, "temporary failure; the user is invited to retry": a checkpoint was written after a stop
# signal and the run is not finished. recipes/multinode.slurm requeues the job on it.
EXIT_PREEMPTED = 75
EXIT_INTERRUPTED = 130  # 128 + SIGINT: the same stop after Ctrl-C
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
CONTROL_DIR_ENV = "SHARDTUNE_CONTROL_DIR"
STOP_REQUESTED_FILE = "stop-requested"
TERMINATE_FILE = "terminate"
STOPPED_FILE = "stopped"
# torchrun's default --signals_to_handle without the stop signals, which the launcher handles itself
TORCHRUN_SIGNALS = "SIGHUP,SIGQUIT"


def exit_status(signal_name: str) -> int:
    """The status a run stopped by ``signal_name`` (with its checkpoint written) exits with."""
    return EXIT_INTERRUPTED if signal_name == "SIGINT" else EXIT_PREEMPTED


_received: list[int] = []  # signals this worker process received (set by the handler)


class Preempted(Exception):
    """Raised on every rank after the checkpoint of a stop was written."""

    def __init__(self, signal_name: str, step: int, checkpoint: Path):
        self.status = exit_status(signal_name)
        super().__init__(
            f"stopped by {signal_name} after step {step}: checkpoint {checkpoint} written; the run "
            f"continues with --resume latest (or --resume auto), exit status {self.status}"
        )
        self.checkpoint = checkpoint


# -- worker side ----------------------------------------------------------------------------------------------------
def _terminate_requested() -> bool:
    control_dir = os.environ.get(CONTROL_DIR_ENV)
    return bool(control_dir) and (Path(control_dir) / TERMINATE_FILE).exists()


def _on_stop_signal(signum: int, _frame) -> None:
    if _received or _terminate_requested():  # a second signal, or the launcher's second: die of it now
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        return
    _received.append(signum)


def install_worker_handlers() -> None:
    """Record SIGTERM / SIGUSR1 / SIGINT instead of dying; training looks at the record after each optimizer step."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, _on_stop_signal)


def _local_stop_signal() -> int:
    """The signal number this process (or, through the control folder, its launcher) received; 0 if none."""
    if _received:
        return _received[0]
    control_dir = os.environ.get(CONTROL_DIR_ENV)
    if control_dir:
        with contextlib.suppress(OSError, ValueError):
            return int((Path(control_dir) / STOP_REQUESTED_FILE).read_text().strip() or 0)
    return 0


def stop_signal_anywhere(device: torch.device) -> str | None:
    """Collective (every rank calls it after each step): the stop signal's name if any rank received one."""
    flag = torch.tensor([_local_stop_signal()], dtype=torch.int64, device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    signum = int(flag.item())
    return signal.Signals(signum).name if signum else None


def report_stopped(error: Preempted) -> bool:
    """Local rank 0 tells its node's launcher that the workers stopped with a checkpoint (the launcher prints it);
    False when there is no shardtune launcher (plain torchrun)."""
    control_dir = os.environ.get(CONTROL_DIR_ENV)
    if control_dir and os.environ.get("LOCAL_RANK", "0") == "0":
        (Path(control_dir) / STOPPED_FILE).write_text(f"{error.status}\t{error}\n", encoding="utf-8")
    return bool(control_dir)


# -- launcher side --------------------------------------------------------------------------------------------------
@contextlib.contextmanager
def stop_signals_forwarded() -> Iterator[Path]:
    """While torchrun runs in this process: the first SIGTERM / SIGUSR1 / SIGINT asks the workers to stop after their
    step; a second one leaves the "terminate" file and raises torchrun's SignalException (its agent then sends the
    workers SIGTERM, which they die of at once)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException

    control_dir = Path(tempfile.mkdtemp(prefix="shardtune-control-"))

    def handle(signum: int, _frame) -> None:
        request = control_dir / STOP_REQUESTED_FILE
        name = signal.Signals(signum).name
        if request.exists():
            (control_dir / TERMINATE_FILE).write_text(str(signum), encoding="utf-8")
            raise SignalException(f"second {name}: terminating the workers", sigval=signal.Signals(signum))
        request.write_text(str(signum), encoding="utf-8")
        again = "press Ctrl-C again" if signum == signal.SIGINT else "send it again"
        print(
            f"shardtune: {name} received: every rank finishes its optimizer step and writes a checkpoint, then "
            f"the job exits with status {exit_status(name)} ({again} to terminate now)",
            file=sys.stderr,
            flush=True,
        )

    previous = {sig: signal.signal(sig, handle) for sig in STOP_SIGNALS}
    os.environ[CONTROL_DIR_ENV] = str(control_dir)
    try:
        yield control_dir
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        os.environ.pop(CONTROL_DIR_ENV, None)
        shutil.rmtree(control_dir, ignore_errors=True)


def workers_stopped(control_dir: Path) -> tuple[int, str] | None:
    """The exit status and the line the workers reported when they stopped for a signal (None: they ran to the
    end)."""
    stopped = control_dir / STOPPED_FILE
    if not stopped.is_file():
        return None
    status, _, line = stopped.read_text(encoding="utf-8").strip().partition("\t")
    return int(status), line
