"""Every dotted ``shardtune.x.y`` name that the docs and the package's docstrings and comments give exists: a module
of the package, and a name that module defines at its top level. A module moved into a floor (shardtune.precision
-> shardtune.runtime.precision) leaves no stale name behind. Read from the files: no shardtune import."""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# a dotted name starting at shardtune (not a file name such as output_dir/.shardtune.lock)
DOTTED = re.compile(r"(?<![\w./-])shardtune(?:\.[A-Za-z_]\w*)+")


def module_file(dotted: str) -> Path | None:
    path = ROOT.joinpath(*dotted.split("."))
    for candidate in (path.with_suffix(".py"), path / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


@functools.cache
def top_level_names(path: Path) -> frozenset[str]:
    names: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(t.id for t in targets if isinstance(t, ast.Name))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
    if "__getattr__" in names:  # a lazy face (shardtune's own exports): the names its tables spell
        tree = ast.parse(path.read_text())
        names.update(n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str))
    return frozenset(names)


def resolves(dotted: str) -> bool:
    """Whether the longest module prefix of ``dotted`` is a module and the name after it one that module defines."""
    parts = dotted.split(".")
    for end in range(len(parts), 0, -1):
        path = module_file(".".join(parts[:end]))
        if path is not None:
            return end == len(parts) or parts[end] in top_level_names(path) or module_file(".".join(parts[: end + 1]))
    return False


def stale_in(text: str) -> list[str]:
    """The dotted names of ``text`` that do not resolve."""
    return [name for name in sorted({m.group(0) for m in DOTTED.finditer(text)}) if not resolves(name)]


def test_every_dotted_shardtune_name_in_the_docs_and_the_package_exists():
    paths = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "shardtune").rglob("*.py"))]
    stale = {str(path.relative_to(ROOT)): stale_in(path.read_text()) for path in paths}
    assert {path: names for path, names in stale.items() if names} == {}


def test_a_stale_name_is_found():
    """The control: a module that is not there, and a name its module does not define, are both reported; a module,
    a name it defines and a lock file's name are not."""
    text = (
        "see shardtune.precision, shardtune.runtime.precision.no_such_function, shardtune.runtime.precision, "
        "shardtune.runtime.distributed.all_reduce_sum and output_dir/.shardtune.lock"
    )
    assert stale_in(text) == ["shardtune.precision", "shardtune.runtime.precision.no_such_function"]
