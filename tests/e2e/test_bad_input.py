"""Bad input: one clear line naming the value and the fix, before any process group starts."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from shardtune.runtime.run_lock import LOCK_FILE


def assert_one_line_error(proc, *needles):
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("shardtune: error: "), lines[0]
    for needle in needles:
        assert needle in lines[0], lines[0]
    assert "Traceback" not in proc.stderr and "torch.distributed" not in proc.stderr


@pytest.mark.parametrize(
    "args,needles",
    [
        (["--batch_size_trainig", "4"], ["--batch_size_trainig", "did you mean --batch_size_training"]),
        (["--batch_size_training", "0"], ["--batch_size_training 0", "positive"]),
        (["--beta", "0.5", "--dry_run", "true"], ["--beta is a flag of shardtune dpo"]),  # a plan checks as a run
        (["--gradient_accumulation_steps", "-1"], ["--gradient_accumulation_steps -1"]),
        (["--lr", "fast"], ["--lr 'fast'", "number"]),
        (["--lr", "inf"], ["--lr inf is not a finite number"]),
        (
            ["--gradient_clipping", "--gradient_clipping_threshold", "nan"],
            ["--gradient_clipping_threshold nan is not a finite number"],
        ),
        (["--batching_strategy", "packed"], ["packed", "did you mean packing"]),
        (["--dataset", "samsum"], ["samsum", "samsum_dataset"]),
        (["--nproc_per_node", "0"], ["--nproc_per_node 0"]),
        (["--model_name", "/nonexistent/model"], ["/nonexistent/model"]),
        (["--model_name", "meta-llama/Llama-3.1-8B"], ["meta-llama/Llama-3.1-8B", "local"]),
        (["--context_length", "8"], ["--context_length 8"]),
        (["--samsum_dataset.data_path", "/nonexistent.jsonl", "--dataset", "samsum_dataset"], ["/nonexistent.jsonl"]),
        (["--custom_dataset.file", "/nonexistent.py", "--dataset", "custom_dataset"], ["/nonexistent.py"]),
        (
            [
                "--enable_fsdp",
                "--nproc_per_node",
                "4",
                "--fsdp_config.sharding_strategy",
                "HYBRID_SHARD",
                "--fsdp_config.sharding_group_size",
                "3",
            ],
            ["--fsdp_config.sharding_group_size 3", "world size 4"],
        ),
        (
            [
                "--enable_fsdp",
                "--nproc_per_node",
                "4",
                "--fsdp_config.sharding_strategy",
                "HYBRID_SHARD",
                "--fsdp_config.sharding_group_size",
                "2",
                "--fsdp_config.replica_group_size",
                "4",
            ],
            ["replica_group_size 4", "world size is 4"],
        ),
        (
            ["--enable_fsdp", "--fsdp_config.hsdp", "true", "--fsdp_config.sharding_strategy", "SHARD_GRAD_OP"],
            ["--fsdp_config.hsdp", "HYBRID_SHARD"],
        ),
        (["--enable_fsdp", "--quantization", "8bit"], ["--quantization 8bit", "--enable_fsdp"]),
        (["--enable_fsdp", "--use_fp16", "--pure_bf16"], ["--use_fp16", "pure_bf16"]),
        (["--use_fp16"], ["--use_fp16 needs CUDA GPUs", "fp32"]),
        (
            ["--pure_bf16"],
            ["--pure_bf16 (parameters, gradients and optimizer state in bf16) needs FSDP", "--enable_fsdp"],
        ),
        (["--fsdp_config.sharding_strategy", "SHARD_GRAD_OP"], ["SHARD_GRAD_OP", "--enable_fsdp"]),
        (["--low_cpu_fsdp"], ["--low_cpu_fsdp", "--enable_fsdp"]),
        (["--enable_fsdp", "--enable_deepspeed"], ["--enable_fsdp and --enable_deepspeed"]),
        (["--enable_deepspeed", "--compile"], ["--compile", "not supported with --enable_deepspeed"]),
        (
            ["--enable_deepspeed", "--deepspeed_config.zero_stage", "3", "--use_peft", "--quantization", "8bit"],
            ["--quantization 8bit", "ZeRO-3", "--quantization 4bit"],
        ),
        (
            ["--enable_deepspeed", "--deepspeed_config.zero_stage", "4"],
            ["--deepspeed_config.zero_stage 4", "1, 2 or 3"],
        ),
        (["--enable_deepspeed", "--deepspeed_config.offload_param", "true"], ["offload_param", "zero_stage 3"]),
        (["--deepspeed_config.zero_stage", "3"], ["--deepspeed_config.zero_stage 3", "--enable_deepspeed"]),
        (["--nproc_per_node", "4", "--sp_size", "3"], ["--sequence_parallel_size 3 = 3", "world size 4"]),
        (
            ["--nproc_per_node", "8", "--sequence_parallel_size", "8"],
            ["--sequence_parallel_size 8 must divide the model's 4 attention heads (2 KV heads"],
        ),
        (
            ["--nproc_per_node", "2", "--cp_size", "2", "--use_peft", "--peft_method", "prefix"],
            ["--context_parallel_size 2", "--peft_method prefix"],
        ),
        (["--gpus_per_node", "8"], ["--gpus_per_node", "add --dry_run"]),  # a plan's flag, without --dry_run
    ],
)
def test_bad_values_fail_early_with_one_line(args, needles, tiny_model, cli_in_process, tmp_path):
    """In this process (each would otherwise start an interpreter that imports torch, ~5 s); the tests below run the
    real command line in its own process."""
    out = tmp_path / "never-created"
    base = ["--model_name", str(tiny_model)] if "--model_name" not in args else []
    proc = cli_in_process("sft", *base, "--output_dir", out, *args)
    assert_one_line_error(proc, *needles)
    assert not out.exists(), "a failed validation must not create the output dir"


def test_output_dir_under_a_file_is_rejected(tiny_model, run_cli, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    proc = run_cli("sft", "--model_name", tiny_model, "--output_dir", blocker / "run", check=False)
    assert_one_line_error(proc, "--output_dir", "not a directory")


def test_unwritable_output_dir_is_rejected(tiny_model, cli_in_process, tmp_path):
    """A read-only filesystem refuses even root; /proc/sys/kernel is one on every Linux."""
    proc = cli_in_process("sft", "--model_name", tiny_model, "--output_dir", "/proc/sys/kernel/shardtune-run")
    assert_one_line_error(proc, "--output_dir", "not writable")


def test_an_unknown_command_lists_every_registered_command_and_help_too():
    """One registry (shardtune.cli.COMMANDS) names the commands: the unknown-command line and --help list each of them,
    and each is a module of shardtune.commands (every such module is one)."""
    from shardtune.cli import COMMANDS
    from tests.conftest import REPO, main_in_process

    proc = main_in_process("sfft")
    assert proc.returncode == 2 and "unknown command 'sfft': choose one of " in proc.stderr
    assert proc.stderr.strip().split("choose one of ")[1].split(", ") == list(COMMANDS)
    usage = main_in_process("--help").stdout
    assert all(f"\n  {name} " in usage for name in COMMANDS), usage
    modules = {path.stem for path in (REPO / "shardtune" / "commands").glob("*.py")} - {"__init__"}
    assert {command.module for command in COMMANDS.values()} == modules


def test_a_previous_run_is_never_overwritten_by_accident(tiny_model, run_cli, cli_in_process, tmp_path):
    out = tmp_path / "run"
    args = (
        "sft",
        "--model_name",
        tiny_model,
        "--output_dir",
        out,
        "--max_train_step",
        1,
        "--run_validation",
        "false",
        "--synthetic_dialogues.num_train",
        16,
        "--batch_size_training",
        1,
        "--num_workers_dataloader",
        0,
    )
    run_cli(*args)
    before = (out / "metrics.jsonl").read_text()
    proc = cli_in_process(*args)
    assert_one_line_error(proc, "already holds a run", "--overwrite_output_dir true")
    assert (out / "metrics.jsonl").read_text() == before
    # --resume auto finds no checkpoint to resume: a new run, refused like the plain rerun
    proc = cli_in_process(*args, "--resume", "auto")
    assert_one_line_error(proc, "already holds a run", "--overwrite_output_dir true")
    assert (out / "metrics.jsonl").read_text() == before
    # --output.previous_run move_aside (the Python trainers'): the first run renamed whole into previous/<UTC time>/,
    # said in one line, and the rerun writes into an output_dir of its own (--overwrite_output_dir true, which writes
    # over it, passes the same check: test_previous_run.py)
    first = {str(p.relative_to(out)): p.read_bytes() for p in out.rglob("*") if p.is_file() and p.name != LOCK_FILE}
    proc = run_cli(*args, "--output.previous_run", "move_aside")
    (moved,) = (out / "previous").iterdir()
    assert re.fullmatch(r"\d{8}-\d{6}", moved.name), moved.name
    assert {str(p.relative_to(moved)): p.read_bytes() for p in moved.rglob("*") if p.is_file()} == first
    assert {"config.yaml", "metrics.jsonl", LOCK_FILE, "previous"} <= set(os.listdir(out))
    said = [line for line in proc.stdout.splitlines() if "held an earlier run" in line]
    assert len(said) == 1 and said[0].startswith(f"shardtune: {out} held an earlier run: moved "), proc.stdout
    assert said[0].endswith(f"into {moved}/ (--output.previous_run move_aside)"), said


def test_the_hint_for_a_previous_run_offers_resume_only_where_a_checkpoint_is(tmp_path):
    from shardtune.config.checks import check_previous_run
    from shardtune.config.flags import config_from
    from shardtune.config.schema import ConfigError

    (tmp_path / "metrics.jsonl").write_text("")
    cfg = config_from(output_dir=str(tmp_path))
    with pytest.raises(ConfigError) as caught:
        check_previous_run(cfg)
    assert "already holds a run (metrics.jsonl)" in str(caught.value) and "--resume" not in str(caught.value)
    (tmp_path / "checkpoints" / "step-000004").mkdir(parents=True)
    with pytest.raises(ConfigError, match="--resume latest to continue it, --output.previous_run move_aside to move"):
        check_previous_run(cfg)


def test_deepspeed_config_file_cannot_change_our_batch_sizes(tiny_model, cli_in_process, tmp_path):
    """A TRL-style ds_config.json may say "auto" or repeat our value; anything else is refused, not overridden."""
    pytest.importorskip("deepspeed")
    path = tmp_path / "ds_config.json"
    path.write_text('{"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": "auto"}')
    proc = cli_in_process(
        "sft",
        "--model_name",
        tiny_model,
        "--output_dir",
        tmp_path / "out",
        "--enable_deepspeed",
        "--batch_size_training",
        "2",
        "--deepspeed_config.config_file",
        path,
    )
    assert_one_line_error(proc, str(path), "train_micro_batch_size_per_gpu", "is 8", "shardtune's is 2")


def model_dir_with_config(config, tiny_model, path):
    """A model directory as a user has it: a config.json and the tokenizer files (the checks read no weights)."""
    import shutil

    config.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (tiny_model / name).exists():
            shutil.copy(tiny_model / name, path / name)
    return path


@pytest.mark.parametrize(
    "flag,needles",
    [
        ("--enable_fsdp", ["--enable_fsdp: BioGptForCausalLM declares no _no_split_modules", "DDP"]),
        ("--compile", ["--compile: BioGptForCausalLM has no model.layers", "drop --compile"]),
    ],
)
def test_a_model_fsdp_or_compile_cannot_wrap_is_refused_before_launch(
    flag, needles, tiny_model, cli_in_process, tmp_path
):
    """BioGPT (a causal LM of transformers) declares no decoder layer class and keeps its layers in model.biogpt:
    found on the meta device before any worker starts."""
    from transformers import BioGptConfig

    config = BioGptConfig(
        vocab_size=1024, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64
    )
    model = model_dir_with_config(config, tiny_model, tmp_path / "biogpt")
    proc = cli_in_process("sft", "--model_name", model, "--output_dir", tmp_path / "out", flag)
    assert_one_line_error(proc, *needles)


def test_a_fault_inside_the_workers_is_one_line_without_traceback(tiny_model, run_cli, tmp_path):
    """A fault no check foresees (here: a config.json whose shapes differ from the weights, found by transformers
    while every rank loads) ends the run with one line naming the rank, the error and --debug; no traceback."""
    import json
    import shutil

    model = tmp_path / "edited"
    shutil.copytree(tiny_model, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "intermediate_size": 128}))
    proc = run_cli(
        "sft",
        "--nproc_per_node",
        2,
        "--model_name",
        model,
        "--output_dir",
        tmp_path / "out",
        "--synthetic_dialogues.num_train",
        64,
        "--synthetic_dialogues.num_validation",
        8,
        "--num_workers_dataloader",
        0,
        check=False,
    )
    assert proc.returncode == 1
    errors = [line for line in proc.stderr.splitlines() if "shardtune: error:" in line]
    assert len(errors) == 1, proc.stderr[-3000:]
    assert errors[0].startswith("shardtune: error: rank ") and "RuntimeError: " in errors[0], errors[0]
    assert errors[0].endswith("(--debug prints the traceback)"), errors[0]
    assert "Traceback" not in proc.stderr


def test_init_model_into_an_unwritable_place_is_one_line(cli_in_process, tmp_path):
    """A path under a file (and a read-only filesystem): one line before anything is built, no traceback."""
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    for target in (blocker / "model", Path("/proc/sys/kernel/shardtune-model")):
        proc = cli_in_process("init-model", "--preset", "tiny", target)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"shardtune: error: init_model: cannot write {target} ("), lines
        assert lines[0].endswith("): pick a directory you can write to")


def test_generate_refuses_sampling_at_temperature_zero_in_one_line(tiny_model, cli_in_process):
    for flags, needle in (
        (("--do_sample", "--temperature", "0"), "--temperature 0.0 with --do_sample: sampling needs"),
        (("--do_sample", "--top_p", "0"), "--top_p 0.0 must be in (0, 1]"),
    ):
        proc = cli_in_process("generate", "--model_name", tiny_model, *flags, "Hello")
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
        assert len(proc.stderr.strip().splitlines()) == 1 and needle in proc.stderr, proc.stderr


def test_eval_takes_a_recipe_as_sft_does():
    """scripts/demo.sh runs `shardtune eval --config recipes/demo.yaml ...` (the flag check refused it)."""
    from shardtune.commands.eval import check_flag_names

    check_flag_names(["--config", "recipes/demo.yaml", "--context_length", "512"], ["max_examples"])  # what sft takes


def test_eval_suggests_its_own_flags_for_a_typo(cli_in_process):
    proc = cli_in_process("eval", "--max_exampels", "5")
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        "shardtune: error: unknown flag --max_exampels: did you mean --max_examples?"
    ], proc.stderr


@pytest.mark.parametrize(
    "flags,needles",
    [
        (("--log_eval_samples", 2), ("--log_eval_samples generates summaries",)),
        (("--loss_type", "hinge", "--label_smoothing", 0.1), ("--label_smoothing 0.1 has no effect",)),
    ],
    ids=["log_eval_samples", "label_smoothing"],
)
def test_what_dpo_does_not_run_is_refused_before_launch(flags, needles, tiny_model, cli_in_process, tmp_path):
    """What shardtune dpo does not build is one line before any process starts (DeepSpeed ZeRO it runs)."""
    proc = cli_in_process("dpo", "--model_name", tiny_model, "--output_dir", tmp_path / "out", *flags)
    assert_one_line_error(proc, *needles)
