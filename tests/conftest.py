"""Shared fixtures: a tiny preset model on disk and a runner for the real `shardtune` CLI."""

from __future__ import annotations

import contextlib
import inspect
import io
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.register_assert_rewrite("tests.helpers")

REPO = Path(__file__).resolve().parent.parent
LAUNCHING_FOLDERS = ("e2e", "distributed", "multihost")
# what a test's own code says when it starts torchrun or the shardtune CLI itself, without the run_cli fixture
LAUNCHING_CODE = ('"torch.distributed.run"', '"torchrun"', '"-m", "shardtune"', "shardtune_argv(", "cli_env(")


def launches(item) -> bool:
    """Whether a test starts real processes (torchrun, the shardtune CLI): by its folder, its run_cli fixture, or
    its own code (a test elsewhere that launches by hand: `-m "not launch"` must leave it out)."""
    folder = Path(str(item.fspath)).relative_to(REPO / "tests").parts[0]
    if folder in LAUNCHING_FOLDERS or "run_cli" in getattr(item, "fixturenames", ()):
        return True
    try:
        code = inspect.getsource(item.function)
    except (AttributeError, OSError, TypeError):
        return False
    return any(spelling in code for spelling in LAUNCHING_CODE)


def pytest_collection_modifyitems(config, items):
    """The markers (pyproject.toml): launch from :func:`launches`, multihost from the folder; gpu tests skipped
    where no CUDA device is."""
    cuda = None
    for item in items:
        folder = Path(str(item.fspath)).relative_to(REPO / "tests").parts[0]
        if launches(item):
            item.add_marker(pytest.mark.launch)
        if folder == "multihost":
            item.add_marker(pytest.mark.multihost)
        if item.get_closest_marker("gpu"):
            if cuda is None:
                import torch

                cuda = torch.cuda.is_available()
            if not cuda:
                item.add_marker(pytest.mark.skip(reason="needs a CUDA device"))


def shardtune_argv(*args) -> list[str]:
    """``python -m shardtune ARGS`` as the tests run it. A training command that does not mention --save_plots (nor
    a --config recipe, which may) gets --save_plots false: the end-of-run charts cost rank 0 ~2 s per launch, and
    only tests/e2e/test_trl_recipe.py (with a recipe) and tests/unit/test_plot.py look at them."""
    args = [str(a) for a in args]
    if (
        args
        and args[0] in ("sft", "dpo", "grpo")
        and not {"-h", "--help"} & set(args)
        and not any(a.startswith(("--save_plots", "--config")) for a in args)
    ):
        args += ["--save_plots", "false"]
    return [sys.executable, "-m", "shardtune", *args]


def cli_env(cache_dir: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        SHARDTUNE_CACHE=str(cache_dir),
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        PYTHONPATH=str(REPO),
    )
    env.pop("CUDA_VISIBLE_DEVICES", None)
    return env


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("shardtune-cache")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    """The tiny preset written once per session, as a user would with `shardtune init-model`."""
    from shardtune.model.loading import init_model

    return init_model("tiny", tmp_path_factory.mktemp("models") / "tiny", seed=0)


@pytest.fixture
def run_cli(cache_dir):
    """Run `python -m shardtune ARGS` as a user would; returns the CompletedProcess."""

    def run(
        *args: str,
        timeout: float = 600,
        check: bool = True,
        env: dict | None = None,
        cwd: Path | None = None,
        stdin: str | None = None,
    ) -> subprocess.CompletedProcess:
        proc = subprocess.run(
            shardtune_argv(*args),
            capture_output=True,
            text=True,
            input=stdin,
            timeout=timeout,
            env={**cli_env(cache_dir), **(env or {})},
            cwd=cwd or REPO,
        )
        if check and proc.returncode != 0:
            raise AssertionError(
                f"shardtune {' '.join(map(str, args))} exited {proc.returncode}\n"
                f"--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-6000:]}"
            )
        return proc

    return run


def main_in_process(*args) -> subprocess.CompletedProcess:
    """``shardtune ARGS`` through ``shardtune.cli.main`` inside this test process (the same code a shell runs,
    without a second interpreter importing torch again): its exit status, stdout and stderr."""
    from shardtune.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            status = main([str(a) for a in args])
        except SystemExit as e:  # argparse's own errors
            status = e.code if isinstance(e.code, int) else 1
    return subprocess.CompletedProcess(["shardtune", *map(str, args)], status, out.getvalue(), err.getvalue())


@pytest.fixture
def cli_in_process(cache_dir, monkeypatch):
    """:func:`main_in_process` with ``run_cli``'s environment and working directory (both restored afterwards): for
    commands that must stop before any process starts."""

    def run(*args) -> subprocess.CompletedProcess:
        saved = dict(os.environ)
        os.environ.update({k: v for k, v in cli_env(cache_dir).items() if k != "PYTHONPATH"})
        monkeypatch.chdir(REPO)
        try:
            return main_in_process(*args)
        finally:
            os.environ.clear()
            os.environ.update(saved)

    return run
