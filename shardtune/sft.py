"""``python -m shardtune.sft``: what torchrun runs for every objective (``torchrun ... -m shardtune.sft --flag value``,
``--objective dpo`` / ``grpo`` for the others: what ``shardtune dpo`` launches); the command itself is
shardtune.commands.sft."""

import signal

if __name__ == "__main__":
    # Ctrl-C reaches the launcher and every worker at once: while a worker imports, the launcher alone answers it
    # (the worker's own handlers, installed before training, see its stop request; shardtune/runtime/preemption.py)
    signal.signal(signal.SIGINT, signal.SIG_IGN)

from shardtune.commands.sft import main  # noqa: E402

if __name__ == "__main__":
    from shardtune.cli import exit_without_teardown, frozen_imports

    with frozen_imports():  # the imports above are the process's for good
        status = main()
    exit_without_teardown(status)
