"""What loading a dataset did: rows read, examples kept, rows skipped and why.

Bad rows never stop a run: each one is counted under a short reason (``missing_field``, ``not_a_string``,
``empty_summary``, ``too_long`` ...) and skipped. With ``--strict_data`` the first bad row raises a
:class:`DataError` naming the file (or source), the row and the fix instead.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shardtune.config.schema import ConfigError


class DataError(ConfigError):
    """A user-facing data error: one line naming the file (or source), the row when there is one, and the fix."""


STRICT_HINT = "fix the row, or drop --strict_data to skip bad rows"


@dataclass
class DataReport:
    source: str
    num_rows: int = 0
    num_examples: int = 0
    skipped: dict[str, int] = field(default_factory=dict)
    num_truncated: int = 0  # rows cut to --max_length (TRL's formats; the cookbook datasets skip long rows)

    def summary(self) -> str:
        line = f"{self.source}: {self.num_examples} of {self.num_rows} rows kept"
        if self.num_truncated:
            line += f" ({self.num_truncated} truncated to --max_length)"
        if not self.skipped:
            return line
        reasons = ", ".join(f"{reason} {count}" for reason, count in self.skipped.items())
        return f"{line}; skipped {sum(self.skipped.values())} ({reasons})"


class RowFilter:
    """Counts bad rows in a :class:`DataReport`, or raises on the first one when ``strict``."""

    def __init__(self, report: DataReport, strict: bool) -> None:
        self.report = report
        self.strict = strict

    def skip(self, reason: str, origin: str, row: int, problem: str, fix: str = STRICT_HINT) -> None:
        if self.strict:
            raise DataError(f"{origin} row {row}: {problem}: {fix}")
        self.report.skipped[reason] = self.report.skipped.get(reason, 0) + 1
