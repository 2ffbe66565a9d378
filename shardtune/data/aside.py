"""Build a dataset's Arrow cache in a forked child, so the process that goes on (the launcher) only maps it.

``datasets.load_dataset`` on a fresh data file parses it into Arrow tables and writes them to its cache; what the
parsing allocates stays in the process as heap its allocators keep (on a 37 MiB JSONL file of 14M tokens, ~100 MiB
of anonymous memory, growing ~6 MiB per million tokens). The launcher lives for the whole run (it holds torchrun's
agent), and the tokenising workers it forks copy its heap, so that memory counted in every process until the end.
Loaded once in a child that exits, the same call in the parent finds the cache whole and memory-maps it (a few MiB,
milliseconds). A child that fails says nothing: the parent's own call then fails with the error it always gave.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
from collections.abc import Callable
from typing import Any


def _run_quietly(load: Callable[[], Any]) -> None:
    try:
        load()
    except BaseException:  # the parent loads again and raises it in its own words
        os._exit(1)


def build_aside(load: Callable[[], Any]) -> bool:
    """Run ``load`` (a ``datasets.load_dataset`` call) in a forked child that exits when it returns; True when it
    succeeded. Not on platforms without fork (where the parent builds the cache itself, as before), nor in a rank
    (the launcher built the cache before launch; a rank is not forked for a load that maps it)."""
    from shardtune.runtime.distributed import is_torchrun_worker

    if sys.platform != "linux" or is_torchrun_worker():
        return False
    child = multiprocessing.get_context("fork").Process(target=_run_quietly, args=(load,), daemon=True)
    child.start()
    child.join()
    return child.exitcode == 0
