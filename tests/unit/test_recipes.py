"""Every shipped recipe parses and passes validation for the number of processes it is written for."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from shardtune.config import parse_args, validate

RECIPES = sorted((Path(__file__).resolve().parents[2] / "recipes").glob("*.yaml"))


def target_world_size(path: Path) -> int:
    """A recipe names its process count in a ``# world_size: N`` comment; without one it runs anywhere (1)."""
    match = re.search(r"^# world_size: (\d+)$", path.read_text(), flags=re.MULTILINE)
    return int(match.group(1)) if match else 1


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_recipe_parses_and_validates(path, tmp_path, monkeypatch):
    cfg = parse_args(["--config", str(path)])
    monkeypatch.chdir(tmp_path)  # relative output dirs are probed here, not in the repository
    validate(cfg, target_world_size(path))  # hub ids are not looked up: validate needs no model


def test_fsdp_recipes_name_their_world_size():
    fsdp = [p for p in RECIPES if parse_args(["--config", str(p)]).enable_fsdp]
    assert fsdp, "no FSDP recipe shipped"
    assert all(target_world_size(p) > 1 for p in fsdp)
