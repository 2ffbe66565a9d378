"""A TRL user's own ``train.py`` (TRL's docs' shape, ``from shardtune import ...`` instead of ``from trl import ...``)
run as TRL's distributed-training guide runs it: ``python train.py``, ``torchrun --nproc_per_node 2 train.py`` and
the manual two-node form (``torchrun --nnodes 2 --node_rank R --rdzv_backend c10d --rdzv_endpoint HOST:PORT``,
both nodes on this host), under ``shardtune run --nproc_per_node 2 train.py`` and under ``accelerate launch
--config_file <TRL's fsdp2 profile> --num_processes 2 train.py``. Same effective batch -> the same per-step losses,
LoRA dropout on (GRPO: the same completions and rewards too). A run of a script stopped by a signal under ``shardtune
run`` checkpoints and exits 75, and the script resumed in another layout ends like the uninterrupted run."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
from pathlib import Path

from shardtune.runtime.preemption import EXIT_PREEMPTED
from tests.conftest import REPO, cli_env
from tests.helpers import logged_steps, wait_for

EXAMPLES = REPO / "examples"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def result_of(output: str) -> dict:
    lines = [line for line in output.splitlines() if line.startswith("RESULT ")]
    assert len(lines) == 1, output[-3000:]
    return json.loads(lines[0].removeprefix("RESULT "))


def run(argv: list[str], cache_dir: Path, cwd: Path) -> subprocess.CompletedProcess:
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=600, env=cli_env(cache_dir), cwd=cwd)
    assert proc.returncode == 0, f"{argv} exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc


def test_a_trl_script_gives_the_same_steps_under_python_torchrun_and_two_nodes(tiny_model, cache_dir, tmp_path):
    script = EXAMPLES / "sft_chat_lora.py"
    torchrun = [sys.executable, "-m", "torch.distributed.run"]
    one = result_of(run([sys.executable, str(script), str(tiny_model), "one", "4", "1"], cache_dir, tmp_path).stdout)
    two = result_of(
        run(
            [*torchrun, "--nproc_per_node", "2", str(script), str(tiny_model), "two", "1", "2"], cache_dir, tmp_path
        ).stdout
    )
    launcher = run(  # shardtune's launcher: 2 processes x batch 2
        [sys.executable, "-m", "shardtune", "run", "--nproc_per_node", "2", str(script), str(tiny_model), "three"]
        + ["2", "1"],
        cache_dir,
        tmp_path,
    )
    assert "topology: 1 node" in launcher.stdout
    three = result_of(launcher.stdout)
    profile = REPO / "shardtune" / "config" / "dialects" / "accelerate_profiles" / "fsdp2.yaml"  # as TRL ships it
    accelerate = run(
        [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(profile), "--num_processes", "2"]
        + [str(script), str(tiny_model), "accelerate", "1", "2"],
        cache_dir,
        tmp_path,
    )
    assert "strategy: fsdp2 FULL_SHARD, world size 2" in accelerate.stdout  # the strategy accelerate's file named
    port = free_port()
    nodes = [
        subprocess.Popen(
            [*torchrun, "--nnodes", "2", "--node_rank", str(rank), "--nproc_per_node", "1", "--rdzv_backend", "c10d"]
            + ["--rdzv_endpoint", f"127.0.0.1:{port}", str(script), str(tiny_model), "nodes", "1", "2"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=cli_env(cache_dir),
            cwd=tmp_path,
        )
        for rank in (0, 1)
    ]
    outputs = [node.communicate(timeout=600) for node in nodes]
    assert all(node.returncode == 0 for node in nodes), outputs[0][1][-4000:] + outputs[1][1][-4000:]
    nodes_result = result_of(outputs[0][0])

    def losses(result: dict) -> list[float]:
        return [row["loss"] for row in result["history"] if "loss" in row]

    assert len(losses(one)) == 5 and one["global_step"] == 5
    last_eval = [row for row in one["history"] if "eval_loss" in row][-1]
    assert last_eval["step"] == 5  # evaluate() evaluated the trained adapter afresh: the run's last evaluation
    assert abs(one["eval"]["eval_loss"] - last_eval["eval_loss"]) <= 1e-6 and one["eval"]["epoch"] == one["epoch"]
    for other in (two, three, nodes_result, result_of(accelerate.stdout)):
        assert all(abs(a - b) <= 1e-5 for a, b in zip(losses(one), losses(other), strict=True)), (
            losses(one),
            losses(other),
        )
        assert abs(other["eval"]["eval_loss"] - one["eval"]["eval_loss"]) <= 1e-5
    first = next(row for row in one["history"] if "loss" in row)
    assert {"loss", "learning_rate", "epoch", "step"} <= set(first)  # TRL's names in log_history
    assert one["model"] == "PeftModelForCausalLM"  # the trained adapter on its base, usable in the script
    assert (tmp_path / "one-saved" / "adapter_config.json").is_file()
    saved = {p.name for p in (tmp_path / "two-saved").iterdir()}  # the model's files, not the run's nor its lock
    assert "adapter_model.safetensors" in saved and not saved & {"metrics.jsonl", "config.yaml", ".shardtune.lock"}


def test_a_script_streaming_an_iterable_dataset_gives_the_same_steps_on_any_layout(tiny_model, cache_dir, tmp_path):
    """examples/sft_streaming.py: an IterableDataset made by a generator as the steps read it, 10 steps across the
    stream's end: 1 process x batch 4 and torchrun 2 x batch 1 x accumulation 2 train the same steps."""
    script = EXAMPLES / "sft_streaming.py"
    one = result_of(run([sys.executable, str(script), str(tiny_model), "one", "4", "1"], cache_dir, tmp_path).stdout)
    two = result_of(
        run(
            [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", str(script), str(tiny_model)]
            + ["two", "1", "2"],
            cache_dir,
            tmp_path,
        ).stdout
    )
    rows = {name: [r for r in result["history"] if "loss" in r] for name, result in (("one", one), ("two", two))}
    assert [r["step"] for r in rows["one"]] == list(range(1, 11)) and one["global_step"] == 10
    assert rows["one"][7]["num_tokens"] - rows["one"][6]["num_tokens"] == rows["one"][0]["num_tokens"]  # step 8: again
    for a, b in zip(rows["one"], rows["two"], strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(a["loss"]), (rows["one"], rows["two"])
    evals = [[r["eval_loss"] for r in result["history"] if "eval_loss" in r] for result in (one, two)]
    assert len(evals[0]) == 2 and all(abs(a - b) <= 1e-5 for a, b in zip(*evals, strict=True))


def test_callbacks_see_the_run_and_early_stopping_stops_it(tiny_model, cache_dir, tmp_path):
    """transformers' EarlyStoppingCallback (the eval loss falls, and greater_is_better says that is worse: patience
    2 stops at the third evaluation) and a callback that records the events and asks for a checkpoint."""
    script = EXAMPLES / "early_stopping.py"
    result = result_of(run([sys.executable, str(script), str(tiny_model), "out"], cache_dir, tmp_path).stdout)
    events = result["events"]
    assert result["steps"] == 3 and events[0] == ["begin", 20] and events[-1] == ["end", 3]
    assert [e[1] for e in events if e[0] == "step"] == [1, 2, 3]
    assert [e[1] for e in events if e[0] == "evaluate"] == [1, 2, 3] and all(e[2] for e in events if e[0] == "evaluate")
    assert ["log", ["grad_norm", "learning_rate", "loss"]] in events
    for step in (1, 2, 3):  # each evaluation row is logged (on_log), then on_evaluate: as Trainer's evaluate()
        assert events.index(["log_eval", step]) == events.index(["evaluate", step, True]) - 1
    history = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    first_eval = next(row for row in history if "eval_loss" in row)  # greater_is_better: the highest, the first
    assert result["best"] == {"metric": first_eval["eval_loss"], "step": 1, "checkpoint": None}
    assert [e for e in events if e[0] == "save"] == [["save", 2]]
    assert [p.name for p in (tmp_path / "out" / "checkpoints").iterdir() if p.name.startswith("step-")] == [
        "step-000002"
    ]


def test_the_dpo_example_trains_and_reports_trls_reward_metrics(tiny_model, cache_dir, tmp_path):
    result = result_of(
        run([sys.executable, str(EXAMPLES / "dpo.py"), str(tiny_model), "dpo"], cache_dir, tmp_path).stdout
    )
    steps = [row for row in result["history"] if "loss" in row]
    assert len(steps) == 4 and abs(steps[0]["loss"] - 0.693147) < 1e-4  # the policy starts as its reference
    assert {"rewards/chosen", "rewards/margins", "learning_rate", "grad_norm"} <= set(steps[0])
    assert {"logits/chosen", "logits/rejected", "entropy", "mean_token_accuracy"} <= set(steps[0])  # TRL's keys
    assert result["model"] == "PeftModelForCausalLM"


def test_the_grpo_example_samples_and_trains_the_same_steps_under_python_and_torchrun(tiny_model, cache_dir, tmp_path):
    """examples/grpo.py (the script's own reward functions, one reading a dataset column; beta > 0): 1 process x 4
    completions and torchrun 2 x 2 sample the same completions (the same rewards) and train the same 4 steps, with
    TRL's metric names in log_history, and evaluate the held-out prompts alike."""
    script = EXAMPLES / "grpo.py"
    one = result_of(run([sys.executable, str(script), str(tiny_model), "one", "4"], cache_dir, tmp_path).stdout)
    two = result_of(
        run(
            [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", str(script), str(tiny_model)]
            + ["two", "2"],
            cache_dir,
            tmp_path,
        ).stdout
    )
    rows = {name: [r for r in result["history"] if "loss" in r] for name, result in (("one", one), ("two", two))}
    assert [r["step"] for r in rows["one"]] == [1, 2, 3, 4] and one["global_step"] == 4
    compared = ["loss", "reward", "reward_std", "rewards/short/mean", "rewards/counts_on/mean", "kl", "entropy"]
    compared += ["grad_norm", "completions/mean_length", "clip_ratio/region_mean"]
    for a, b in zip(rows["one"], rows["two"], strict=True):
        assert all(abs(a[k] - b[k]) <= 1e-5 for k in compared), (a, b)
    assert len({r["reward"] for r in rows["one"]}) > 1  # each step sampled new completions with the weights it had
    assert abs(one["loss"] - sum(r["loss"] for r in rows["one"]) / 4) <= 1e-12  # train()'s TrainOutput
    evaluations = {
        name: [r for r in result["history"] if "eval_loss" in r] for name, result in (("one", one), ("two", two))
    }
    assert [r["step"] for r in evaluations["one"]] == [2, 4]
    for a, b in zip(evaluations["one"], evaluations["two"], strict=True):  # the 8 held-out prompts x 4, all ranks'
        assert all(
            abs(a[k] - b[k]) <= 1e-5 for k in ("eval_loss", "eval_reward", "eval_rewards/counts_on/mean", "eval_kl")
        ), (a, b)


# TRL's docs' shape, slowed by a callback so that a signal lands mid-run
STOPPABLE = """
import json, os, sys, time
from datasets import Dataset
from peft import LoraConfig
from transformers import TrainerCallback
from shardtune import SFTConfig, SFTTrainer

model, output_dir, batch, accumulation, resume = sys.argv[1:6]


class Slow(TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        time.sleep(0.4)


rows = [{"prompt": f"count to {n}", "completion": " " + " ".join(map(str, range(n)))} for n in range(1, 49)]
trainer = SFTTrainer(
    model=model,
    args=SFTConfig(output_dir=output_dir, per_device_train_batch_size=int(batch), max_steps=12, logging_steps=1,
                   gradient_accumulation_steps=int(accumulation), learning_rate=2e-3, save_steps=100),
    train_dataset=Dataset.from_list(rows),
    peft_config=LoraConfig(r=8, lora_alpha=16, lora_dropout=0.1, target_modules=["q_proj", "v_proj"]),
    callbacks=[Slow()],
)
trainer.train(resume_from_checkpoint=resume == "resume" or None)
if int(os.environ.get("RANK", "0")) == 0:
    print("RESULT " + json.dumps({"history": trainer.state.log_history}))
"""


def test_a_script_stopped_under_shardtune_run_checkpoints_exits_75_and_resumes_in_another_layout(
    tiny_model, cache_dir, tmp_path
):
    """SIGUSR1 to ``shardtune run --nproc_per_node 2 train.py`` (batch 2): every rank ends its step, the checkpoint
    is written, the script ends inside train() (its later lines do not run) and the launcher exits 75; the same
    script in one process (batch 4) with train(resume_from_checkpoint=True) ends like the uninterrupted run."""
    script = tmp_path / "train.py"
    script.write_text(STOPPABLE)
    whole = result_of(
        run([sys.executable, str(script), str(tiny_model), "whole", "4", "1", "no"], cache_dir, tmp_path).stdout
    )
    part = tmp_path / "part"
    launcher = subprocess.Popen(
        [sys.executable, "-m", "shardtune", "run", "--nproc_per_node", "2", str(script), str(tiny_model), str(part)]
        + ["2", "1", "no"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=cli_env(cache_dir),
        cwd=tmp_path,
        start_new_session=True,
    )
    try:
        wait_for(lambda: True if logged_steps(part) >= 2 else None, launcher, "step 2", poll_s=0.2)
        launcher.send_signal(signal.SIGUSR1)
        stdout, stderr = launcher.communicate(timeout=300)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == EXIT_PREEMPTED, stderr[-4000:]
    assert "stopped by SIGUSR1 after step" in stdout + stderr and "RESULT" not in stdout
    checkpoints = [p.name for p in (part / "checkpoints").iterdir() if p.name.startswith("step-")]
    assert len(checkpoints) == 1 and 2 <= int(checkpoints[0].removeprefix("step-")) < 12, checkpoints
    resumed = run([sys.executable, str(script), str(tiny_model), str(part), "4", "1", "resume"], cache_dir, tmp_path)
    assert "resumed from" in resumed.stdout
    losses = {
        name: [row["loss"] for row in r["history"] if "loss" in row]
        for name, r in (("whole", whole), ("part", result_of(resumed.stdout)))
    }
    assert len(losses["whole"]) == 12
    assert all(abs(a - b) <= 1e-5 for a, b in zip(losses["whole"], losses["part"], strict=True)), losses
