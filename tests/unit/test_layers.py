"""The package's floors hold: import-linter's contracts (pyproject.toml), and the size rules of the layout."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_import_contracts_are_kept():
    """Layers (each floor imports only floors below), no command imported by the library or by another command,
    data / launch kept apart from the floors above, no import cycle inside a package."""
    lint = Path(sys.executable).with_name("lint-imports")
    proc = subprocess.run(
        [str(lint)], cwd=REPO, capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(REPO)}
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "0 broken" in proc.stdout


def test_few_modules_at_the_top_and_none_too_long():
    top = sorted(p.name for p in (REPO / "shardtune").glob("*.py"))
    assert len(top) <= 6, top
    long = {
        str(p.relative_to(REPO)): n
        for p in (REPO / "shardtune").rglob("*.py")
        if (n := len(p.read_text().splitlines())) > 600
    }
    assert not long, f"modules over 600 lines: {long}"
