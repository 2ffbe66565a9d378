"""TRL 1.16's own scripts — trl/scripts/sft.py, dpo.py and grpo.py, read from the installed trl — with only ``trl``
replaced by ``shardtune`` in their imports, run with TRL's documented flags as TRL's distributed-training guide runs
them: ``python``, ``torchrun --nproc_per_node 2``, ``accelerate launch --num_processes 2`` (TRL's fsdp2 profile) and
two c10d nodes. The same effective batch gives the same per-step losses on every layout (1e-5), and the unmodified
script under trl gives the same losses as shardtune's (SFT and DPO: every step a full pass over the data, so the
data order does not matter; 1e-3 asked, ~1e-7 seen). GRPO samples its completions with generators of its own (the
same completions on every layout, not TRL's), so its rewards are compared across layouts and its loss with TRL's
only where both are the policy-gradient loss at ratio 1 of full-length completions (zero up to rounding)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, cli_env
from tests.hub_standin import HubStandIn

PROFILE = REPO / "shardtune" / "config" / "dialects" / "accelerate_profiles" / "fsdp2.yaml"  # as TRL ships it
COMMON = ["--model_name_or_path", "tiny", "--learning_rate", "1e-3", "--num_train_epochs", "1", "--max_steps", "3"]
COMMON += ["--logging_steps", "1", "--report_to", "none", "--bf16", "false", "--seed", "0"]
# (launcher, per-device batch, accumulation): the same effective batch on each
LAYOUTS = {"python": 1, "torchrun": 2, "accelerate": 2, "nodes": 2}  # processes


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def work(tmp_path_factory, tiny_model) -> Path:
    """The scripts with their imports changed, the data folders (train / test splits as TRL's scripts load them with
    load_dataset(folder)), a reward module of the user's, and the tiny model, in one working directory."""
    import trl.scripts

    work = tmp_path_factory.mktemp("trl-scripts")
    source = Path(trl.scripts.__file__).parent
    for name in ("sft", "dpo", "grpo"):
        text = (source / f"{name}.py").read_text()
        changed = re.sub(r"\bfrom trl(\.rewards)? import", lambda m: f"from shardtune{m.group(1) or ''} import", text)
        assert "trl" not in re.findall(r"^\s*(?:from|import) (\w+)", changed, re.M), "an import of trl is left"
        (work / f"{name}.py").write_text(changed)
    rows = {
        "sft": [{"prompt": f"Count from {i}:", "completion": f" {i} {i + 1} {i + 2} {i + 3}"} for i in range(24)],
        "dpo": [
            {"prompt": f"Count from {i}:", "chosen": f" {i} {i + 1} {i + 2}", "rejected": f" {i} {i + 5} {i}"}
            for i in range(24)
        ],
        "grpo": [{"prompt": f"Say a number bigger than {i}:", "solution": str(i + 1)} for i in range(24)],
    }
    for name, data in rows.items():
        (work / f"{name}data").mkdir()
        for split, part in (("train", data[:16]), ("test", data[16:])):
            lines = "".join(json.dumps(row) + "\n" for row in part)
            (work / f"{name}data" / f"{split}.jsonl").write_text(lines)
    (work / "my_rewards.py").write_text(
        "def length_reward(completions, **kwargs):\n"
        "    return [len(c if isinstance(c, str) else c[-1]['content']) / 10 for c in completions]\n"
        "\n"
        "def broken_reward(completions, **kwargs):\n"
        "    raise ValueError('my reward is broken')\n"
    )
    (work / "tiny").symlink_to(tiny_model)
    return work


def launcher(layout: str, port: int) -> list[list[str]]:
    """The command prefix of each process group member (one per node for ``nodes``)."""
    torchrun = [sys.executable, "-m", "torch.distributed.run"]
    if layout == "python":
        return [[sys.executable]]
    if layout == "torchrun":
        return [[*torchrun, "--nproc_per_node", "2"]]
    if layout == "accelerate":
        return [[sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(PROFILE)]]
    rdzv = ["--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{port}", "--nproc_per_node", "1"]
    return [[*torchrun, "--nnodes", "2", "--node_rank", str(rank), *rdzv] for rank in (0, 1)]


def run(
    work: Path, cache_dir: Path, layout: str, script: str, flags: list[str], env: dict | None = None, fails=False
) -> str:
    """Run ``script`` (a path) under ``layout``; its stdout (rank 0's node); with ``fails``, its stderr, the run having
    failed."""
    extra = ["--num_processes", "2"] if layout == "accelerate" else []
    port = free_port()
    environment = {**cli_env(cache_dir), **(env or {})}
    procs = [
        subprocess.Popen(
            [*prefix, *extra, script, *flags],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=environment,
            cwd=work,
        )
        for prefix in launcher(layout, port)
    ]
    outputs = [proc.communicate(timeout=600) for proc in procs]
    if fails:
        assert all(proc.returncode != 0 for proc in procs), outputs[0][0][-2000:]
        return outputs[0][1]
    for proc, (out, err) in zip(procs, outputs):
        assert proc.returncode == 0, f"{layout} {script} exited {proc.returncode}\n{out[-3000:]}\n{err[-6000:]}"
    return outputs[0][0]


def ours(work: Path, name: str) -> list[dict]:
    return [json.loads(line) for line in (work / name / "metrics.jsonl").read_text().splitlines()]


def theirs(work: Path, name: str, step: int) -> list[dict]:
    """trl's log history, from the trainer_state.json of its checkpoint at ``step``."""
    return json.loads((work / name / f"checkpoint-{step}" / "trainer_state.json").read_text())["log_history"]


def column(rows: list[dict], key: str) -> list[float]:
    return [row[key] for row in rows if key in row]


def close(a: list[float], b: list[float], tolerance: float) -> bool:
    return len(a) == len(b) > 0 and all(abs(x - y) <= tolerance for x, y in zip(a, b))


def trl_script(name: str) -> str:
    import trl.scripts

    return str(Path(trl.scripts.__file__).parent / f"{name}.py")


def layout_runs(work, cache_dir, name: str, flags, batch: int) -> dict[str, list[dict]]:
    """The script under every layout at effective batch ``batch``: processes x per-device batch x accumulation."""
    runs = {}
    for layout, processes in LAYOUTS.items():
        accumulation = 2 if layout == "accelerate" else 1
        per_device = batch // processes // accumulation
        shape = ["--per_device_train_batch_size", str(per_device), "--gradient_accumulation_steps", str(accumulation)]
        out = f"{name}-{layout}"
        run(work, cache_dir, layout, f"{name}.py", [*flags, *shape, "--output_dir", out, "--save_strategy", "no"])
        runs[layout] = ours(work, out)
    return runs


def test_trls_sft_script_runs_on_every_launcher_as_under_trl_pushes_and_reruns(work, cache_dir):
    flags = [*COMMON, "--dataset_name", "sftdata", "--eval_strategy", "steps", "--eval_steps", "3"]
    runs = layout_runs(work, cache_dir, "sft", flags, batch=16)
    one = runs["python"]
    for layout, rows in runs.items():
        assert close(column(rows, "loss"), column(one, "loss"), 1e-5), (layout, column(rows, "loss"))
        assert close(column(rows, "eval_loss"), column(one, "eval_loss"), 1e-5), layout
    shape = ["--per_device_train_batch_size", "16", "--output_dir", "sft-trl", "--save_steps", "3"]
    run(work, cache_dir, "python", trl_script("sft"), [*flags, *shape])
    trl_rows = theirs(work, "sft-trl", 3)
    assert close(column(one, "loss"), column(trl_rows, "loss"), 1e-3), (column(one, "loss"), column(trl_rows, "loss"))
    assert close(column(one, "eval_loss"), column(trl_rows, "eval_loss"), 1e-3)
    # --push_to_hub: the run uploads its model, the script's trainer.push_to_hub() the card, hub_model_id printed
    with HubStandIn() as hub:
        env = {"HF_HUB_OFFLINE": "0", "HF_ENDPOINT": hub.url, "HF_TOKEN": "hf_standin"}
        push = ["--push_to_hub", "--hub_model_id", "tester/sft-tiny", "--per_device_train_batch_size", "16"]
        out = run(work, cache_dir, "python", "sft.py", [*flags, *push, "--output_dir", "sft-python"], env)
        received = hub.received("tester/sft-tiny")
    assert "Model pushed to the Hub in https://huggingface.co/tester/sft-tiny." in out
    assert {"model.safetensors", "config.json", "tokenizer.json", "README.md"} <= set(received)
    assert b"- sftdata" in received["README.md"] and b"base_model: tiny" in received["README.md"]
    # run again where it ran (TRL has no overwrite_output_dir): the ended run moved into previous/, nothing lost
    previous = list((work / "sft-python" / "previous").iterdir())
    assert len(previous) == 1 and {"metrics.jsonl", "model.safetensors"} <= {p.name for p in previous[0].iterdir()}
    assert (work / "sft-python" / "README.md").is_file()  # the second run's card, written by push_to_hub()
    assert close(column(ours(work, "sft-python"), "loss"), column(one, "loss"), 1e-6)


def test_trls_dpo_script_runs_on_every_launcher_as_under_trl(work, cache_dir):
    flags = [*COMMON, "--dataset_name", "dpodata", "--no_remove_unused_columns"]
    runs = layout_runs(work, cache_dir, "dpo", flags, batch=16)
    one = runs["python"]
    for layout, rows in runs.items():
        assert close(column(rows, "loss"), column(one, "loss"), 1e-5), (layout, column(rows, "loss"))
        assert close(column(rows, "rewards/margins"), column(one, "rewards/margins"), 1e-5), layout
    shape = ["--per_device_train_batch_size", "16", "--output_dir", "dpo-trl", "--save_steps", "3"]
    run(work, cache_dir, "python", trl_script("dpo"), [*flags, *shape])
    trl_rows = theirs(work, "dpo-trl", 3)
    assert close(column(one, "loss"), column(trl_rows, "loss"), 1e-3), (column(one, "loss"), column(trl_rows, "loss"))
    assert close(column(one, "rewards/margins"), column(trl_rows, "rewards/margins"), 1e-3)


def test_trls_grpo_script_runs_on_every_launcher_with_the_same_completions(work, cache_dir):
    flags = [*COMMON, "--dataset_name", "grpodata", "--num_generations", "4", "--max_completion_length", "6"]
    flags += ["--reward_funcs", "my_rewards.length_reward"]  # a dotted path: the script imports it from its cwd
    runs = layout_runs(work, cache_dir, "grpo", flags, batch=8)
    one = runs["python"]
    assert len(set(column(one, "reward"))) > 1  # rewards that vary: the comparison below can fail
    for layout, rows in runs.items():
        assert close(column(rows, "loss"), column(one, "loss"), 1e-5), (layout, column(rows, "loss"))
        assert close(column(rows, "reward"), column(one, "reward"), 1e-5), layout  # the same completions
    shape = ["--per_device_train_batch_size", "8", "--output_dir", "grpo-trl", "--save_steps", "3"]
    run(work, cache_dir, "python", trl_script("grpo"), [*flags, *shape])
    trl_rows = theirs(work, "grpo-trl", 3)
    assert all(row["completions/mean_length"] == 6 for row in trl_rows if "loss" in row)  # full length: ratio-1 loss 0
    assert all(row["completions/mean_length"] == 6 for row in one if "loss" in row)
    assert close(column(one, "loss"), column(trl_rows, "loss"), 1e-3)
    assert os.path.isfile(work / "grpo-python" / "model.safetensors")
    # the script's own reward raising: the script ends with its exception and traceback, as under trl
    broken = [*flags[: flags.index("--reward_funcs")], "--reward_funcs", "my_rewards.broken_reward"]
    shape = ["--per_device_train_batch_size", "8", "--output_dir", "grpo-broken"]
    err = run(work, cache_dir, "python", "grpo.py", [*broken, *shape], fails=True)
    assert "Traceback (most recent call last)" in err and 'my_rewards.py", line 5, in broken_reward' in err
    assert "ValueError: my reward is broken\n" in err
