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


def test_the_type_checker_passes():
    """mypy over its scope ([tool.mypy] in pyproject.toml: config/, api/ and the engine), as the quick tier runs it."""
    proc = subprocess.run([sys.executable, "-m", "mypy"], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]


def test_few_modules_at_the_top_and_no_function_too_long():
    """A function reads at once (80 lines at most; how tangled one may be is ruff's C901, pyproject.toml); a module's
    length is not the measure (a table of settings is long and simple)."""
    import ast

    top = sorted(p.name for p in (REPO / "shardtune").glob("*.py"))
    assert len(top) <= 6, top
    long = [
        f"{p.relative_to(REPO)}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for p in (REPO / "shardtune").rglob("*.py")
        for node in ast.walk(ast.parse(p.read_text()))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > 80
    ]
    assert not long, f"functions over 80 lines: {long}"
