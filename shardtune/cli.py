"""The ``shardtune`` command: collects the verbs of shardtune.commands (one module each); no logic here.

The one-line helps are here, not in the command modules, so that ``shardtune --help`` imports no command (and no
torch)."""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
from typing import NamedTuple

from shardtune.config.objectives import OBJECTIVES


class Command(NamedTuple):
    module: str  # the module of shardtune.commands that runs it (``main(argv) -> exit status``)
    help: str  # its line in ``shardtune --help``


# The one registry of commands: the training verbs, one per objective (shardtune.config.objectives; each runs the sft
# command with its objective), then the others. Help, the unknown-command error and dispatch all read it.
COMMANDS = {
    **{name: Command("sft", registration.help) for name, registration in OBJECTIVES.items()},
    "init-model": Command(
        "init_model", "write a small random-init Llama preset with its tokenizer as a Hugging Face directory"
    ),
    "export": Command(
        "export", "turn a training checkpoint (any world size, any strategy) into a Hugging Face model directory"
    ),
    "generate": Command(
        "generate", "generate text with a model, a model + PEFT adapter, or a merged model (prompt, file or stdin)"
    ),
    "plan": Command(
        "plan", "per-GPU memory and speed of a configuration and its alternatives, from config.json alone (no GPU)"
    ),
    "eval": Command(
        "eval", "eval loss, perplexity and ROUGE of generated summaries on a samsum-format split; JSON report"
    ),
    "plot": Command(
        "plot",
        "PNG charts (loss, lr, tokens/s, MFU, memory) of one or more runs, overlaid; reads metrics.jsonl or "
        "llama-cookbook's metrics_data_*.json",
    ),
    "doctor": Command(
        "doctor", "check versions, devices, topology, bandwidth and the NCCL / gloo environment on every node"
    ),
    "run": Command(
        "run",
        "run a Python training script (from shardtune import SFTTrainer, TRL's shape) on the processes torchrun's "
        "flags or the cluster describe",
    ),
}


def main(argv: list[str] | None = None) -> int:
    """``argv`` None: this process is the command (``shardtune ...``, ``python -m shardtune ...``); a list: called
    from other code (tests), which keeps its garbage collector as it is."""
    as_program = argv is None
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: shardtune {" + ",".join(COMMANDS) + "} ...\n")
        for name, registered in COMMANDS.items():
            print(f"  {name:<12} {registered.help}")
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        print(f"shardtune: error: unknown command {command!r}: choose one of {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    if command in OBJECTIVES and ("-h" in rest or "--help" in rest):  # at once: no torch, no transformers
        from shardtune.launch.torchrun import sft_help_text

        print(sft_help_text(command))
        return 0
    try:
        module = importlib.import_module(f"shardtune.commands.{COMMANDS[command].module}")
        with frozen_imports(as_program):
            if command in OBJECTIVES:  # the training command with the verb's objective
                status = module.main(rest, objective=command)
            else:
                status = module.main(rest)
    except KeyboardInterrupt:  # Ctrl-C before (or without) a run's own stop handling: one line, a shell's status
        print("shardtune: interrupted", file=sys.stderr)
        return 130
    if as_program:
        exit_without_teardown(status)
    return status


def exit_without_teardown(status: int) -> None:
    """End the command's process once its work is done, without the interpreter's teardown.

    Everything the process wrote is already closed (or flushed) by then, and the exit handlers still run (logging,
    trackers, the data loader's worker processes, temporary directories: ``atexit``), as do the threads that are
    not daemons (thread pools told to stop, then joined, as the interpreter does); what is skipped is the
    interpreter's last garbage collection and the destruction of every module and C++ object imported (torch's and
    transformers' millions): ~2 s of a 2-core CPU at every exit, on each process of a run, for nothing the run keeps.
    A process that fails with an exception never gets here and exits as before."""
    import atexit
    import threading

    shutdown = getattr(threading, "_shutdown", None)
    if shutdown is not None:  # the interpreter's own first step of exit: thread pools' exit hooks (torch.compile's
        shutdown()  # workers wait for them, forever otherwise), then the non-daemon threads joined
    else:
        for thread in threading.enumerate():
            if thread is not threading.current_thread() and not thread.daemon:
                thread.join()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(status if isinstance(status, int) else 1)


@contextlib.contextmanager
def frozen_imports(freeze: bool = True):
    """While the command runs, the objects of its imports (torch's and transformers' millions, alive as long as the
    process) are out of the garbage collector's way (gc.freeze): full collections during training no longer walk
    them (10 demo steps 13.5 -> 12.6 s here). Thawed at the end: a caller that goes on (tests) collects as before
    (a worker that exited through the interpreter's teardown with them frozen aborted once, in C++ teardown; the
    command now ends without that teardown, :func:`exit_without_teardown`)."""
    import gc

    if freeze:
        gc.freeze()
    try:
        yield
    finally:
        if freeze:
            gc.unfreeze()


if __name__ == "__main__":
    sys.exit(main())
