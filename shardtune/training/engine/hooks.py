"""What a run tells a script's code while it trains, and what that code may ask of it: the loop's side of the Python
face's callbacks (shardtune.api.callbacks turns them into transformers' ``TrainerCallback`` calls).

The loop calls the installed :class:`Hooks` on every rank alike (a script runs in every process of the run) and asks
them, after each step, whether to evaluate, save or stop now; a stop is agreed across ranks (one rank's wish stops
all), so that no rank waits in a collective the others left. With no hooks installed (the command line) nothing is
called and nothing is exchanged.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator


class Hooks:
    """The loop's events; the control answers are read (and cleared) once per step."""

    def on_train_begin(self, max_steps: int) -> None: ...

    def on_step_end(self, row: dict[str, Any]) -> None: ...

    def on_evaluate(self, row: dict[str, Any]) -> None: ...

    def on_save(self, step: int) -> None: ...

    def on_train_end(self) -> None: ...

    def take_evaluate(self) -> bool:
        return False

    def take_save(self) -> bool:
        return False

    def wants_stop(self) -> bool:
        return False


_installed: Hooks | None = None


def installed() -> Hooks | None:
    return _installed


@contextlib.contextmanager
def install(hooks: Hooks | None) -> Iterator[None]:
    """``hooks`` for the runs started inside (one at a time in a process)."""
    global _installed
    previous, _installed = _installed, hooks
    try:
        yield
    finally:
        _installed = previous
