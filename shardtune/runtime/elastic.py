"""Which start of the worker group this is, the same number on every node: the launcher's rendezvous handler
(shardtune.launch.rendezvous) agrees on it after each rendezvous round and exports it to the workers."""

from __future__ import annotations

import os
from collections.abc import Mapping

ATTEMPT_ENV = "SHARDTUNE_ATTEMPT"


def worker_group_attempt(environ: Mapping[str, str] = os.environ) -> int:
    """In a worker: how many times the worker group started before this one (0: the first start), the same number
    on every node when launched by ``shardtune sft`` with a dynamic rendezvous; else torchrun's per-node count."""
    value = environ.get(ATTEMPT_ENV) or environ.get("TORCHELASTIC_RESTART_COUNT") or "0"
    return int(value)
