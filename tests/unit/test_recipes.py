"""Every shipped recipe parses and passes validation for the number of processes it is written for."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from shardtune.config.flags import parse_args
from shardtune.training.engine.checks import validate

CLUSTER_SPECS = ("skypilot.yaml",)  # a SkyPilot task, not a training recipe: checked below
RECIPES = sorted(
    p for p in (Path(__file__).resolve().parents[2] / "recipes").glob("*.yaml") if p.name not in CLUSTER_SPECS
)


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
    fsdp = [p for p in RECIPES if parse_args(["--config", str(p)]).parallel.strategy == "fsdp"]
    assert fsdp, "no FSDP recipe shipped"
    assert all(target_world_size(p) > 1 for p in fsdp)


RECIPES_DIR = Path(__file__).resolve().parents[2] / "recipes"
LAUNCHER_FLAGS = ("--nnodes", "--node_rank", "--rdzv", "--master_addr", "--nproc_per_node")


def sft_flags(command: list[str]) -> list[str]:
    """What follows `shardtune sft` in a recipe's command: training flags that must parse and validate."""
    assert command[:2] == ["shardtune", "sft"], command
    return command[2:]


def test_slurm_recipe_leaves_the_topology_to_shardtune_and_keeps_outputs_shared():
    import subprocess

    text = (RECIPES_DIR / "multinode.slurm").read_text()
    subprocess.run(["bash", "-n", str(RECIPES_DIR / "multinode.slurm")], check=True)  # parses as bash
    for line in ("#SBATCH --ntasks-per-node=1", "#SBATCH --signal=USR1@90", "#SBATCH --requeue"):
        assert line in text
    srun = next(line for line in text.splitlines() if line.startswith("srun "))
    assert "shardtune sft" in srun and not any(flag in srun for flag in LAUNCHER_FLAGS), srun
    assert "SHARDTUNE_CACHE=$SHARED/" in text and "OUTPUT_DIR=$SHARED/" in text


@pytest.mark.parametrize("name", ["k8s/trainjob.yaml", "k8s/pytorchjob.yaml", "skypilot.yaml"])
def test_cluster_recipes_run_shardtune_without_launcher_flags_on_a_shared_volume(name, tmp_path, monkeypatch):
    import yaml

    spec = yaml.safe_load((RECIPES_DIR / name).read_text())
    if spec.get("kind") == "TrainJob":
        trainer = spec["spec"]["trainer"]
        assert trainer["numNodes"] == 2
        command = trainer["command"] + trainer["args"]
    elif spec.get("kind") == "PyTorchJob":
        assert spec["spec"]["nprocPerNode"]
        command = spec["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]["command"]
    else:
        assert spec["num_nodes"] == 2
        command = spec["run"].split("\n", 1)[1].replace("\\\n", " ").split()
    flags = sft_flags(command)
    assert not any(f.startswith(LAUNCHER_FLAGS) for f in flags), flags
    assert flags[flags.index("--output_dir") + 1].startswith("/shared/")
    monkeypatch.chdir(RECIPES_DIR.parent)  # --config paths are relative to the repository
    cfg = parse_args(flags)
    monkeypatch.chdir(tmp_path)
    validate(cfg, 16)


def test_long_context_recipe_splits_a_million_token_row_over_its_eight_gpus():
    """recipes/long-context-1m-8gpu.yaml: one row of 1M tokens over all 8 processes, on Llama-3-8B's head counts,
    with the memory levers; a split the heads cannot take is refused by the same check (control)."""
    from transformers import LlamaConfig

    from shardtune.config.schema import ConfigError
    from shardtune.model.loading import PRESETS
    from shardtune.parallel.dims import ParallelDims
    from shardtune.parallel.sequence import check_sequence_split

    path = RECIPES_DIR / "long-context-1m-8gpu.yaml"
    cfg = parse_args(["--config", str(path)])
    dims = ParallelDims.from_config(cfg, target_world_size(path))
    assert (dims.sp * dims.cp, dims.dp_size, cfg.data.context_length) == (8, 1, 2**20)
    assert cfg.parallel.tiled_mlp and cfg.parallel.activation_offloading and cfg.parallel.activation_checkpointing
    assert cfg.model.rope_scaling == "yarn" and 8192 * cfg.model.rope_factor >= cfg.data.context_length
    llama3_8b = LlamaConfig(**PRESETS["llama-8b-shape"])
    check_sequence_split(cfg, llama3_8b)
    cfg.parallel.sequence_parallel_size = 6
    with pytest.raises(ConfigError, match="must divide the model's 32 attention heads"):
        check_sequence_split(cfg, llama3_8b)
