"""Errors raised alike on every rank and reported as one line by the command: the loop, the checkpointer and the
strategies raise them; none of them imports another to do so."""

import sys
import traceback


class TrainingStopped(RuntimeError):
    """Training cannot go on (e.g. a non-finite loss): one line saying where, what was kept, and the fix."""


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read: one line naming the path, the cause and the fix."""


def fail(message: str, debug: bool) -> None:
    """Print a user-facing error as one line on stderr (the traceback too under --debug)."""
    if debug:
        traceback.print_exc()
    print(f"shardtune: error: {message}", file=sys.stderr, flush=True)
