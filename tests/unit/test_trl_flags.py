"""A TRL user's flags, recipes and Accelerate files mean here what they mean in TRL, or are refused in one line.

Nothing here launches: the parser, the schedules, the Accelerate mapping and activation checkpointing are checked
in this process (the one TRL-style launch is tests/e2e/test_trl_recipe.py).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from shardtune.config.argv import split_argv
from shardtune.config.checks import check_fields
from shardtune.config.dialects.accelerate import read_accelerate
from shardtune.config.dialects.trl import PROFILES
from shardtune.config.flags import build_config, parse_args, recipe_launch_settings
from shardtune.config.help import flag_table
from shardtune.config.schema import ConfigError, TrainConfig
from shardtune.parallel.optim import build_optimizer, build_scheduler
from shardtune.training.engine.checks import validate

REPO = Path(__file__).resolve().parents[2]
# TRL's accelerate keys (examples/accelerate_configs/*.yaml), written here for the tests
COMMON = {
    "compute_environment": "LOCAL_MACHINE",
    "debug": False,
    "downcast_bf16": "no",
    "machine_rank": 0,
    "main_training_function": "main",
    "num_machines": 1,
    "rdzv_backend": "static",
    "same_network": True,
    "tpu_env": [],
    "tpu_use_cluster": False,
    "tpu_use_sudo": False,
    "use_cpu": False,
}


def write(folder: Path, name: str, content: dict) -> str:
    path = folder / name
    path.write_text(yaml.safe_dump(content))
    return str(path)


def settings(tmp_path: Path, accelerate: dict, argv: list[str] = ()):
    args = split_argv(["--accelerate_config", write(tmp_path, "acc.yaml", accelerate), *argv])
    launch, train = read_accelerate(args.accelerate)
    notes: list[str] = []
    return launch, build_config(args.training, args.recipe, train, notes), notes


def test_max_grad_norm_given_turns_clipping_on_at_that_norm():
    assert parse_args(["--max_grad_norm", "0.3"]).optim.max_grad_norm == 0.3
    assert parse_args(["--max_grad_norm", "0"]).optim.max_grad_norm is None  # HF: 0 means no clipping
    assert parse_args([]).optim.max_grad_norm is None
    # llama-cookbook's two flags for the one setting, in either order
    assert (
        parse_args(["--gradient_clipping_threshold", "0.5", "--gradient_clipping", "true"]).optim.max_grad_norm
        == parse_args(["--gradient_clipping", "true", "--gradient_clipping_threshold", "0.5"]).optim.max_grad_norm
        == 0.5
    )
    assert parse_args(["--gradient_clipping", "true"]).optim.max_grad_norm == 1.0
    assert (
        parse_args(["--gradient_clipping", "false", "--gradient_clipping_threshold", "0.5"]).optim.max_grad_norm is None
    )


@pytest.mark.parametrize("scheduler", ["step", "linear", "cosine", "cosine_with_min_lr", "constant_with_warmup"])
def test_warmup_is_honoured_under_every_scheduler(scheduler):
    extra = ["--min_lr_rate", "0.1"] if scheduler == "cosine_with_min_lr" else []
    for warmup in (["--warmup_steps", "4"], ["--warmup_ratio", "0.2"]):  # 0.2 x 20 steps = 4
        cfg = parse_args(["--lr_scheduler_type", scheduler, "--learning_rate", "1.0", *warmup, *extra])
        optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=cfg.optim.lr)
        scheduler_obj, unit = build_scheduler(optimizer, cfg, total_steps=20, steps_per_epoch=10)
        assert unit == "step"
        lrs = []
        for _ in range(20):
            lrs.append(optimizer.param_groups[0]["lr"])
            scheduler_obj.step()
        assert lrs[:5] == pytest.approx([0.2, 0.4, 0.6, 0.8, 1.0]), scheduler  # (s + 1) / (w + 1), then the peak
        if scheduler == "constant_with_warmup":
            assert lrs[5:] == pytest.approx([1.0] * 15)
        elif scheduler == "step":
            assert lrs[10] == pytest.approx(0.85)  # x gamma once per epoch
        else:
            assert lrs[-1] < lrs[5] and all(a >= b for a, b in zip(lrs[4:], lrs[5:]))
    assert parse_args(["--warmup_steps", "0.1"]).optim.warmup_steps == 0.1  # transformers 5: a float is a ratio
    assert parse_args(["--warmup_ratio", "0.1"]) == parse_args(["--warmup_steps", "0.1"])


def test_warmup_that_would_be_ignored_is_refused_in_one_line(tmp_path):
    for argv, named in [
        (["--lr_scheduler_type", "constant", "--warmup_steps", "3"], "constant_with_warmup"),
        (["--warmup_steps", "3.5"], "neither a whole number"),
        (["--lr_scheduler_type", "cosine_with_min_lr"], "min_lr_rate"),
        (["--lr_scheduler_type", "polynomial"], "not built"),
        (["--min_lr_rate", "0.1"], "no effect"),
    ]:
        with pytest.raises(ConfigError, match=named) as error:
            validate(parse_args([*argv, "--output_dir", str(tmp_path / "o")]), 1)
        assert "\n" not in str(error.value)


def test_cosine_with_min_lr_ends_at_the_floor():
    cfg = parse_args(
        [
            "--lr_scheduler_type",
            "cosine_with_min_lr",
            "--lr_scheduler_kwargs",
            '{"min_lr_rate": 0.1}',
            "--learning_rate",
            "1.0",
        ]
    )
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    scheduler, _ = build_scheduler(optimizer, cfg, total_steps=10)
    for _ in range(10):
        scheduler.step()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.1)


def test_weight_decay_skips_biases_and_norm_weights_and_adam_settings_are_honoured():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    cfg = parse_args(
        ["--weight_decay", "0.1", "--adam_beta1", "0.8", "--adam_epsilon", "1e-6", "--optim", "adamw_torch_fused"]
    )
    optimizer = build_optimizer(model, cfg)
    decayed, plain = optimizer.param_groups
    assert [p.shape for p in decayed["params"]] == [torch.Size([4, 4])] and decayed["weight_decay"] == 0.1
    assert len(plain["params"]) == 3 and plain["weight_decay"] == 0.0  # bias, norm weight, norm bias
    assert decayed["betas"] == (0.8, 0.999) and decayed["eps"] == 1e-6 and decayed["fused"]


def test_recipe_wins_over_the_accelerate_file_and_a_disagreement_is_said_in_one_line(tmp_path):
    recipe = write(tmp_path, "recipe.yaml", {"gradient_accumulation_steps": 8, "learning_rate": 3e-4})
    zero1 = {
        **COMMON,
        "distributed_type": "DEEPSPEED",
        "mixed_precision": "bf16",
        "num_processes": 2,
        "deepspeed_config": {"gradient_accumulation_steps": 1, "zero_stage": 1},
    }
    launch, cfg, notes = settings(tmp_path, zero1, ["--config", recipe])
    assert cfg.train.gradient_accumulation_steps == 8 and cfg.parallel.strategy == "deepspeed" and cfg.optim.lr == 3e-4
    assert len(notes) == 1 and recipe in notes[0] and "8" in notes[0] and "1" in notes[0] and "\n" not in notes[0]
    _, cfg, _ = settings(tmp_path, zero1, ["--config", recipe, "--gradient_accumulation_steps", "2"])
    assert cfg.train.gradient_accumulation_steps == 2  # the command line wins over both


def test_single_gpu_file_starts_one_process_whatever_num_processes_says(tmp_path):
    launch, cfg, _ = settings(
        tmp_path, {**COMMON, "distributed_type": "NO", "mixed_precision": "bf16", "num_processes": 8}
    )
    assert (
        launch == {"nproc_per_node": "1"} and cfg.parallel.strategy != "fsdp" and cfg.parallel.strategy != "deepspeed"
    )


def test_parallelism_config_maps_onto_the_mesh(tmp_path):
    sizes = {
        "parallelism_config_dp_replicate_size": 1,
        "parallelism_config_dp_shard_size": 1,
        "parallelism_config_tp_size": 1,
        "parallelism_config_cp_size": 2,
    }
    fsdp = {
        **COMMON,
        "distributed_type": "FSDP",
        "mixed_precision": "bf16",
        "num_processes": 2,
        "fsdp_config": {"fsdp_version": 2, "fsdp_reshard_after_forward": True},
    }
    launch, cfg, _ = settings(tmp_path, {**fsdp, "parallelism_config": sizes})  # context_parallel_2gpu
    assert (
        launch == {"nproc_per_node": "2"}
        and cfg.parallel.context_parallel_size == 2
        and cfg.parallel.strategy == "fsdp"
    )
    ulysses = {
        **COMMON,
        "distributed_type": "DEEPSPEED",
        "mixed_precision": "bf16",
        "num_processes": 4,
        "deepspeed_config": {"zero_stage": 3, "seq_parallel_communication_data_type": "bf16"},
        "parallelism_config": {
            **sizes,
            "parallelism_config_dp_shard_size": 2,
            "parallelism_config_cp_backend": "deepspeed",
            "parallelism_config_cp_seq_length_is_variable": True,
            "parallelism_config_cp_attn_implementation": "flash_attention_2",
        },
    }
    launch, cfg, _ = settings(tmp_path, ulysses)  # alst_ulysses_4gpu: ALST's cp is Ulysses
    assert (
        launch == {"nproc_per_node": "4"}
        and cfg.parallel.sequence_parallel_size == 2
        and cfg.parallel.context_parallel_size == 1
    )
    sp = {
        **ulysses,
        "parallelism_config": {
            "parallelism_config_sp_size": 4,
            "parallelism_config_sp_backend": "deepspeed",
            "parallelism_config_dp_replicate_size": 1,
        },
    }
    assert settings(tmp_path, sp)[1].parallel.sequence_parallel_size == 4
    hsdp = {
        **fsdp,
        "num_processes": 4,
        "parallelism_config": {"parallelism_config_dp_replicate_size": 2, "parallelism_config_dp_shard_size": 2},
    }
    cfg = settings(tmp_path, hsdp)[1]
    assert cfg.parallel.sharding_strategy == "HYBRID_SHARD" and cfg.parallel.replica_group_size == 2
    for bad, named in [
        ({**sizes, "parallelism_config_tp_size": 2}, "tensor parallelism"),
        ({**sizes, "parallelism_config_cp_size": 4}, "num_processes is 2"),
    ]:
        with pytest.raises(ConfigError, match=named) as error:
            settings(tmp_path, {**fsdp, "parallelism_config": bad})
        assert "\n" not in str(error.value)


def test_packaged_profiles_are_accepted_by_name():
    for name in PROFILES:
        launch, train = read_accelerate(name)
        cfg = parse_args([], train)
        assert (cfg.parallel.strategy == "deepspeed") == name.startswith("zero") and (
            cfg.parallel.strategy == "fsdp"
        ) == name.startswith("fsdp")
        assert launch == ({"nproc_per_node": "1"} if name == "single_gpu" else {})
    assert parse_args([], read_accelerate("zero3")[1]).parallel.zero_stage == 3


def test_trl_names_have_trls_meaning():
    cfg = parse_args(
        [
            "--model_name_or_path",
            "m",
            "--use_peft",
            "--lora_r",
            "4",
            "--lora_alpha",
            "8",
            "--lora_target_modules",
            "all-linear",
            "--lora_modules_to_save",
            "lm_head",
            "--use_rslora",
            "--load_in_4bit",
            "--bnb_4bit_quant_type",
            "fp4",
            "--packing",
            "false",
            "--bf16",
            "--gradient_checkpointing",
            "--num_train_epochs",
            "2.0",
            "--max_steps",
            "-1",
            "--per_device_train_batch_size",
            "3",
            "--resume_from_checkpoint",
            "--report_to",
            "tensorboard,wandb",
            "--eval_strategy",
            "steps",
            "--eval_steps",
            "5",
            "--save_strategy",
            "steps",
            "--save_steps",
            "10",
            "--dtype",
            "bfloat16",
            "--packing_strategy",
            "bfd",
        ]
    )
    lc = cfg.peft.lora
    assert (cfg.model.name, cfg.peft.method, lc.r, lc.alpha, lc.target_modules, lc.modules_to_save, lc.use_rslora) == (
        "m",
        "lora",
        4,
        8,
        ["all-linear"],
        ["lm_head"],
        True,
    )
    assert cfg.model.quantization == "4bit" and cfg.model.quant_type == "fp4"
    assert not cfg.model.double_quant  # TRL's default for --use_bnb_nested_quant
    assert cfg.data.batching == "padding" and cfg.train.precision == "auto"
    assert cfg.parallel.activation_checkpointing and cfg.parallel.strategy != "fsdp"  # under DDP too
    assert (cfg.train.num_epochs, cfg.train.max_steps, cfg.train.batch_size, cfg.checkpoint.resume) == (
        2,
        0,
        3,
        "latest",
    )
    assert cfg.logging.report_to == ["tensorboard", "wandb"] and cfg.eval.steps == 5 and cfg.checkpoint.save_steps == 10
    assert parse_args(["--packing"]).data.batching == "packing"
    assert parse_args(["--resume_from_checkpoint", "out/step-000002"]).checkpoint.resume == "out/step-000002"


def test_a_fractional_num_train_epochs_stops_where_trainer_stops_and_the_schedule_ends_there():
    """Trainer: max_steps = ceil(epochs x update steps per epoch), over ceil(epochs) epochs of data order."""
    from shardtune.training.engine.intervals import planned_steps

    cfg = parse_args(
        ["--num_train_epochs", "2.5", "--lr_scheduler_type", "linear", "--per_device_train_batch_size", "2"]
    )
    assert cfg.train.num_epochs == 2.5
    validate(cfg, 2)
    assert planned_steps(cfg, units=range(30), dp_size=2) == math.ceil(2.5 * 7)  # 30 units // (2 x 2): 7 per epoch
    quarter = parse_args(["--num_train_epochs", "0.25", "--per_device_train_batch_size", "4"])
    assert planned_steps(quarter, units=range(30), dp_size=1) == 2  # ceil(7 / 4)
    cfg.train.stop_after_steps = 5  # llama-cookbook's --max_train_step: a cap
    assert planned_steps(cfg, units=range(30), dp_size=2) == 5
    older = parse_args(["--fractional_epochs", "2.5"])  # the older name; shardtune's, so the cookbook's defaults
    assert older == parse_args(["--num_train_epochs", "2.5", "--defaults", "cookbook"])


def test_flags_that_cannot_be_honoured_are_refused_in_one_line():
    for argv, named in [
        (["--num_train_epochs", "-1"], "must be positive"),
        (["--optim", "sgd"], "adamw_8bit"),
        (["--hub_strategy", "every_save", "--push_to_hub"], "use end"),
        (["--attn_implementation", "flash_attention_3"], "not built"),
        (["--defaults", "cookbook", "--save_strategy", "steps"], "--save_steps N"),
    ]:
        with pytest.raises(ConfigError, match=named) as error:
            parse_args(argv)
        assert "\n" not in str(error.value)


@pytest.mark.parametrize(
    "typo,suggested",
    [
        ("packng", "packing"),
        ("bf61", "bf16"),
        ("gradient_checkpointng", "gradient_checkpointing"),
        ("resume_from_checkpont", "resume_from_checkpoint"),
    ],
)
def test_a_mistyped_trl_flag_gets_the_right_suggestion(typo, suggested):
    with pytest.raises(ConfigError, match=f"did you mean --{suggested}\\?"):
        parse_args([f"--{typo}", "1"])


def test_a_trl_recipe_names_every_unknown_key_at_once_and_reads_env_and_accelerate_config(tmp_path):
    bad = write(tmp_path, "bad.yaml", {"learning_rate": 1e-4, "lernin_rate": 1, "packng": True, "zzz_qqq": 3})
    with pytest.raises(ConfigError) as error:
        parse_args(["--config", bad])
    message = str(error.value)
    assert all(k in message for k in ("lernin_rate", "packng", "zzz_qqq")) and "\n" not in message
    good = write(
        tmp_path, "good.yaml", {"learning_rate": 1e-4, "env": {"WANDB_MODE": "offline"}, "accelerate_config": "zero2"}
    )
    assert recipe_launch_settings(good) == ({"WANDB_MODE": "offline"}, "zero2", {})
    assert parse_args(["--config", good]).optim.lr == 1e-4


def test_a_trl_recipes_launcher_keys_are_the_launchers_as_trl_passes_them_to_accelerate(tmp_path):
    """clis.md's recipe says num_processes: 2 (Accelerate's: the processes of all machines)."""
    one = write(tmp_path, "one.yaml", {"learning_rate": 1e-4, "num_processes": 2})
    assert recipe_launch_settings(one)[2] == {"nproc_per_node": "2"}
    assert parse_args(["--config", one]).optim.lr == 1e-4  # not a setting: the builder does not see it
    two = write(tmp_path, "two.yaml", {"num_processes": 4, "num_machines": 2, "machine_rank": 1})
    assert recipe_launch_settings(two)[2] == {
        "nproc_per_node": "2",
        "nnodes": "2",
        "node_rank": "1",
        "master_addr": "127.0.0.1",
        "master_port": "29500",
    }
    odd = write(tmp_path, "odd.yaml", {"num_processes": 3, "num_machines": 2})
    with pytest.raises(ConfigError, match="--config .*odd.yaml: num_processes 3 is not a multiple of num_machines 2"):
        recipe_launch_settings(odd)


def test_a_trl_recipes_mappings_and_peft_task_type(tmp_path):
    """lr_scheduler_kwargs as a YAML mapping; lora_task_type CAUSAL_LM (TRL's default, the one shardtune trains);
    model_init_kwargs' dtype and attention; a datasets: (mixture) entry with a key TRL's DatasetConfig does not have
    is refused naming it."""
    recipe = {
        "lr_scheduler_type": "cosine_with_min_lr",
        "lr_scheduler_kwargs": {"min_lr_rate": 0.1},
        "use_peft": True,
        "lora_task_type": "CAUSAL_LM",
        "model_init_kwargs": {"dtype": "bfloat16", "attn_implementation": "eager", "trust_remote_code": False},
    }
    cfg = parse_args(["--config", write(tmp_path, "r.yaml", recipe)])
    assert (cfg.optim.lr_scheduler, cfg.optim.min_lr_rate, cfg.peft.method) == ("cosine_with_min_lr", 0.1, "lora")
    assert cfg.model.attn_implementation == "eager" and cfg.train.precision == "auto"
    for key, value, named in [
        ("lora_task_type", "SEQ_CLS", "lora_task_type SEQ_CLS .*CAUSAL_LM"),
        ("model_init_kwargs", {"device_map": "cpu"}, "model_init_kwargs device_map .*drop"),
        ("model_init_kwargs", {"torch_dtype": "int8"}, "torch_dtype int8 is not valid"),
        ("datasets", [{"path": "a.jsonl", "sample": 2}], "datasets: entry 1: unknown key 'sample'"),
    ]:
        with pytest.raises(ConfigError, match=named) as error:
            parse_args(["--config", write(tmp_path, "bad.yaml", {key: value})])
        assert "\n" not in str(error.value)


def test_activation_checkpointing_under_ddp_gives_the_same_gradients(tiny_model):
    """The wrappers DDP and DeepSpeed apply (as FSDP does) recompute each layer: same loss and gradients."""
    from shardtune.model.loading import load_model
    from shardtune.parallel.fsdp import checkpoint_activations

    batch = torch.tensor([[1, 5, 9, 14, 3, 7, 2, 8]])
    grads = []
    for on in (False, True):
        model = load_model(str(tiny_model), dtype=torch.float32)
        cfg = TrainConfig()
        cfg.parallel.activation_checkpointing = on
        checkpoint_activations(model, cfg)
        model(input_ids=batch, labels=batch).loss.backward()
        grads.append({n.replace("_checkpoint_wrapped_module.", ""): p.grad for n, p in model.named_parameters()})
        assert any("_checkpoint_wrapped_module" in n for n, _ in model.named_parameters()) == on
        assert "_checkpoint_wrapped_module" not in "".join(model.state_dict())  # saved names stay HF's
    assert grads[0].keys() == grads[1].keys()
    assert all(torch.allclose(grads[0][k], grads[1][k], rtol=1e-5, atol=1e-7) for k in grads[0])


def test_eval_on_start_is_trls_flag_and_needs_evaluation():
    """--eval_on_start (TRL's name) is the canonical eval.on_start; with evaluation off it is refused in one line
    naming the flag as typed (what it does in a run: tests/e2e/test_trl_recipe.py)."""
    assert parse_args(["--eval_on_start"]).eval.on_start and not parse_args([]).eval.on_start
    for off in (["--eval_strategy", "no"], ["--run_validation", "false"]):
        with pytest.raises(
            ConfigError, match=f"--eval_on_start needs {off[0]} on, and it is off: turn it on, or drop --eval_on_start"
        ):
            check_fields(parse_args(["--eval_on_start", *off]), 1)
    check_fields(parse_args(["--eval_on_start", "--eval_strategy", "epoch"]), 1)


def test_docs_flag_table_is_current():
    assert (REPO / "docs" / "flags.md").read_text() == flag_table(), (
        "docs/flags.md is stale: python -m shardtune.config.help > docs/flags.md"
    )


def test_help_lists_the_trl_names_beside_ours():
    from shardtune.config.help import help_text

    text = help_text()
    assert "TRL: --max_grad_norm" in text and "TRL: --learning_rate" in text and "TRL: --gradient_checkpointing" in text
    assert "--optim.lr FLOAT" in text and "llama-cookbook: --lr" in text
    assert text.startswith("usage: shardtune sft ")
    dpo = subprocess.run(
        [sys.executable, "-m", "shardtune", "dpo", "--help"], capture_output=True, text=True, cwd=REPO, check=True
    ).stdout
    assert dpo.startswith("usage: shardtune dpo ") and "--beta, --loss_type, --loss_weights" in dpo


def test_plan_takes_sfts_topology_flags():
    from shardtune.commands.plan import plan_values

    def plan_args(argv: list[str]) -> tuple[dict, list]:
        args = split_argv(argv)
        return plan_values(args.hardware, args.launcher), args.training

    values, rest = plan_args(["--nproc_per_node", "8", "--nnodes", "2", "--master_addr", "10.0.0.1", "--enable_fsdp"])
    assert (values["gpus_per_node"], values["nnodes"], rest) == ("8", "2", [("enable_fsdp", None)])
    assert plan_args(["--num_processes", "4"])[0]["gpus_per_node"] == "4"
    with pytest.raises(ConfigError, match="disagree"):
        plan_args(["--nproc_per_node", "8", "--gpus_per_node", "4"])


def test_cookbook_checkpoint_folders_without_output_dir_are_the_runs_directory():
    cookbook = [
        "--dist_checkpoint_root_folder",
        "model_checkpoints",
        "--dist_checkpoint_folder",
        "fine-tuned",
        "--model_name",
        "meta-llama/Llama-3.2-1B",
    ]
    assert parse_args(cookbook).output.dir == "model_checkpoints/fine-tuned-meta-llama/Llama-3.2-1B"
    assert parse_args([*cookbook, "--output_dir", "mine"]).output.dir == "mine"


def test_plot_works_after_the_default_install():
    import tomllib

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert any(d.startswith("matplotlib") for d in project["dependencies"])


def test_more_trl_training_names():
    cfg = parse_args(
        ["--use_liger_kernel", "--save_only_model", "--gradient_checkpointing_kwargs", '{"use_reentrant": false}']
    )
    assert cfg.model.fast_kernels and not cfg.checkpoint.save_optimizer
    with pytest.raises(ConfigError, match="use_reentrant"):
        parse_args(["--gradient_checkpointing_kwargs", '{"preserve_rng_state": true}'])


@pytest.mark.parametrize("name", ["gradient_checkpointing_kwargs", "activation_checkpointing_kwargs"])
def test_checkpointing_kwargs_take_the_same_forms_with_one_meaning(name, tmp_path):
    """TRL's --gradient_checkpointing_kwargs and transformers 5's --activation_checkpointing_kwargs are one setting:
    JSON text, a JSON file or a recipe's mapping; use_reentrant false and every_n_layers 1 (what shardtune does:
    every layer, non-reentrantly) are accepted, any other key or value is refused in the same line."""
    plain = parse_args([])
    kwargs = {"use_reentrant": False, "every_n_layers": 1}
    json_file = tmp_path / "kwargs.json"
    json_file.write_text(json.dumps(kwargs))
    recipe = write(tmp_path, "recipe.yaml", {name: kwargs})
    for argv in ([f"--{name}", json.dumps(kwargs)], [f"--{name}", str(json_file)], ["--config", recipe]):
        assert parse_args(argv) == plain, argv
    for bad, shown in (({"every_n_layers": 2}, "every_n_layers 2"), ({"use_reentrant": True}, "use_reentrant true")):
        with pytest.raises(ConfigError) as refused:
            parse_args([f"--{name}", json.dumps(bad)])
        assert str(refused.value).startswith(f"--{name} {shown}: shardtune recomputes every decoder layer"), refused


def test_model_revision_reads_that_snapshot_from_the_hugging_face_cache_offline(tiny_model, tmp_path, monkeypatch):
    """--model_revision (TRL's name too) resolves the hub id's revision to its snapshot folder before launch (here
    from a Hugging Face cache laid out as huggingface_hub writes it, offline), and the run reads that folder; a
    local --model_name, a revision the cache lacks and --dry_run / plan are one line each."""
    import shutil

    from shardtune.training.engine.checks import prepare
    from tests.conftest import main_in_process

    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--shardtune-tests--tiny"
    shutil.copytree(tiny_model, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "v2").write_text(commit)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("SHARDTUNE_CACHE", str(tmp_path / "cache"))
    cfg = parse_args(
        [
            "--model_name",
            "shardtune-tests/tiny",
            "--model_revision",
            "v2",
            "--output_dir",
            str(tmp_path / "run"),
            "--synthetic_dialogues.num_train",
            "64",
            "--synthetic_dialogues.num_validation",
            "4",
        ]
    )
    prepare(cfg, 1)
    assert Path(cfg.model.name) == repo / "snapshots" / commit and cfg.model.revision == ""
    assert parse_args(["--model_revision", "main"]).model.revision == ""  # TRL's default: the hub id as it is
    for argv, needle in (
        (["--model_name", str(tiny_model), "--model_revision", "v2"], "is local: drop"),
        (
            ["--model_name", "shardtune-tests/tiny", "--model_revision", "v3"],
            "--model_revision v3 could not be fetched",
        ),
    ):
        with pytest.raises(ConfigError, match=needle):
            prepare(parse_args([*argv, "--output_dir", str(tmp_path / "other")]), 1)
    for command in (["sft", "--dry_run"], ["plan"]):
        proc = main_in_process(*command, "--model_name", "shardtune-tests/tiny", "--model_revision", "v2")
        assert proc.returncode == 2 and "the plan reads the hub id's main config.json" in proc.stderr, proc.stderr


def test_sft_and_dpo_config_names_are_honoured_or_refused_in_one_line():
    """Every field of TRL 1.16's SFTConfig and DPOConfig beyond TrainingArguments' is a setting of ours (TRL's name
    and meaning) or refused in one line naming the flag; none is unknown, none accepted and ignored."""
    from dataclasses import fields as dataclass_fields

    from transformers import TrainingArguments
    from trl import DPOConfig, SFTConfig

    from shardtune.config.spellings import resolve

    trainer = {f.name for f in dataclass_fields(TrainingArguments)}
    for config in (SFTConfig, DPOConfig):
        for name in sorted({f.name for f in dataclass_fields(config)} - trainer):
            resolve(name)  # ours under TRL's name, or refused; raises "unknown flag" otherwise
    assert parse_args(["--disable_dropout", "true"]).peft.lora.dropout == 0
    assert parse_args(["--disable_dropout", "false"]).peft.lora.dropout == 0.05
    assert parse_args(["--precompute_ref_batch_size", "8"]).dpo.precompute_ref_batch_size == 8
    assert parse_args(["--shuffle_dataset", "false"]) == parse_args([])
    for name in ("ld_alpha", "use_weighting", "sync_ref_model", "pad_to_multiple_of", "eval_packing"):
        with pytest.raises(ConfigError, match=f"^--{name}: .*drop the") as error:
            parse_args([f"--{name}", "1"])
        assert "\n" not in str(error.value)


def test_how_settings_were_given_is_a_declared_field_and_not_a_setting():
    """The names a user typed and why the defaults are whose they are live in TrainConfig's declared provenance field:
    kept by copies and dataclasses.replace, not a setting (no flag, not in config.yaml or to_dict, not compared), and
    a written config.yaml reads back as before."""
    import dataclasses

    from shardtune.config.fields import flat_fields
    from shardtune.config.flags import from_dict, to_dict, to_yaml, with_settings

    cfg = parse_args(["--learning_rate", "3e-4", "--lora_r", "4"])
    assert "provenance" in {f.name for f in dataclasses.fields(TrainConfig)}
    assert not {"spelled", "defaults_reason"} & set(vars(cfg)), "undeclared attributes on the config"
    assert cfg.provenance.spelled == {"optim.lr": "learning_rate", "peft.lora.r": "lora_r"}
    assert cfg.provenance.defaults_reason == "--learning_rate is TRL's"
    assert dataclasses.replace(cfg).provenance == cfg.provenance
    assert with_settings(cfg, lr=1e-3).provenance.spelled == {"optim.lr": "lr", "peft.lora.r": "lora_r"}
    assert not any(key.startswith("provenance") for key in flat_fields())
    assert "provenance" not in to_dict(cfg) and "provenance" not in to_yaml(cfg)
    with pytest.raises(ConfigError, match="unknown flag --provenance.spelled"):
        parse_args(["--provenance.spelled", "x"])
    again = from_dict(yaml.safe_load(to_yaml(cfg)))
    assert again == cfg and again.provenance != cfg.provenance  # read back: every name is config.yaml's


def test_config_yaml_reads_back_to_the_same_config_and_an_earlier_releases_flat_file_too():
    """config.yaml (the canonical config, grouped) read back is the config written, for every field: sections whose
    name is also a flag (optim: and TRL's --optim) stay sections, a mapping-valued flag stays a mapping. A flat
    config.yaml of an earlier release (llama-cookbook's names) reads into the same canonical settings."""
    from shardtune.config.flags import flat_settings, from_dict, to_yaml

    cfg = parse_args(
        [
            "--defaults",  # TRL's names and the cookbook's, the defaults said
            "trl",
            "--learning_rate",
            "3e-4",
            "--optim",
            "adamw_torch_fused",
            "--max_grad_norm",
            "0.5",
            "--lr_scheduler_type",
            "cosine_with_min_lr",
            "--lr_scheduler_kwargs",
            '{"min_lr_rate": 0.1}',
            "--use_peft",
            "--lora_target_modules",
            "q_proj",
            "v_proj",
            "--report_to",
            "tensorboard",
            "--enable_fsdp",
            "--fsdp_config.pure_bf16",
            "--eval_on_start",
            "--save_steps",
            "0.25",
            "--synthetic_dialogues.num_train",
            "12",
            "--objective",
            "dpo",
            "--loss_type",
            "sigmoid",
            "sft",
        ]
    )
    again = from_dict(yaml.safe_load(to_yaml(cfg)))
    assert flat_settings(again) == flat_settings(cfg)
    earlier = {
        "lr": 3e-4,
        "gradient_clipping": True,
        "gradient_clipping_threshold": 0.5,
        "enable_fsdp": True,
        "fsdp_config": {"pure_bf16": True, "sharding_strategy": "SHARD_GRAD_OP"},
        "use_peft": False,
        "peft_method": "lora",
        "num_epochs": 2,
        "synthetic_dialogues": {"num_train": 12},
    }
    read = from_dict(earlier)
    assert (read.optim.lr, read.optim.max_grad_norm, read.parallel.strategy, read.train.precision) == (
        3e-4,
        0.5,
        "fsdp",
        "pure_bf16",
    )
    assert (read.parallel.sharding_strategy, read.peft.method, read.train.num_epochs) == ("SHARD_GRAD_OP", "", 2)
    assert read.data.synthetic_dialogues.num_train == 12


def test_save_strategy_decides_whatever_the_order_of_save_steps():
    """TRL's --save_strategy decides whether --save_steps counts, in either order (it wrote checkpoints with
    `--save_strategy no --save_steps 1`, none the other way round, and every 3 steps with `epoch --save_steps 3`)."""
    from shardtune.training.engine.checkpoint.checkpointer import checkpointing_enabled

    for order in (["--save_strategy", "no", "--save_steps", "1"], ["--save_steps", "1", "--save_strategy", "no"]):
        cfg = parse_args(order)
        assert not checkpointing_enabled(cfg) and cfg.checkpoint.save_steps == 0, order
    for order in (["--save_strategy", "epoch", "--save_steps", "3"], ["--save_steps", "3", "--save_strategy", "epoch"]):
        cfg = parse_args(order)
        assert checkpointing_enabled(cfg) and cfg.checkpoint.save_steps == 0, order  # at epoch ends only
    for order in (["--save_strategy", "steps", "--save_steps", "3"], ["--save_steps", "3", "--save_strategy", "steps"]):
        assert parse_args(order).checkpoint.save_steps == 3, order
    assert parse_args(["--save_strategy", "steps"]).checkpoint.save_steps == 500  # TRL's default --save_steps
    with pytest.raises(ConfigError, match="--save_strategy steps needs --save_steps N"):
        parse_args(["--defaults", "cookbook", "--save_strategy", "steps"])
    with pytest.raises(ConfigError, match="--save_strategy no writes no checkpoints, but --checkpoint_type"):
        parse_args(["--checkpoint_type", "FULL_STATE_DICT", "--save_strategy", "no"])


def test_space_separated_lists_as_peft_integration_md_writes_them():
    """TRL's parser takes a list flag's values one by one; --report_to's translation too."""
    args = split_argv(
        ["--use_peft", "--lora_target_modules", "q_proj", "v_proj", "--lora_modules_to_save", "lm_head"]
        + ["embed_tokens", "--report_to", "tensorboard", "wandb", "--lr", "1e-4"]
    )
    cfg = build_config(args.training, None, (), [])
    assert cfg.peft.lora.target_modules == ["q_proj", "v_proj"]
    assert cfg.peft.lora.modules_to_save == ["lm_head", "embed_tokens"]
    assert cfg.logging.report_to == ["tensorboard", "wandb"] and cfg.optim.lr == 1e-4


def test_an_objective_that_disagrees_with_the_verb_is_refused_naming_both(tmp_path):
    """shardtune dpo --objective sft trained DPO (an explicit sft looked like the default): the verb's objective and an
    --objective or a recipe's objective that differ are refused in one line naming both; the same one is fine."""
    assert build_config([("objective", "dpo")], None, (), [], objective="dpo").objective == "dpo"
    for verb, flag in (("dpo", "sft"), ("sft", "dpo"), ("grpo", "sft")):
        with pytest.raises(ConfigError) as refused:
            build_config([("objective", flag)], None, (), [], objective=verb)
        assert (
            str(refused.value)
            == f"--objective {flag}: this is shardtune {verb}; run shardtune {flag}, or drop the flag"
        )
    recipe = write(tmp_path, "sft.yaml", {"objective": "sft", "learning_rate": 1e-4})
    assert build_config([], recipe, (), [], objective="sft").objective == "sft"
    with pytest.raises(ConfigError) as refused:
        build_config([], recipe, (), [], objective="dpo")
    assert str(refused.value) == (
        f"--config {recipe} says objective: sft, but this is shardtune dpo: run shardtune sft --config {recipe}, or "
        "change the recipe's objective"
    )
    assert build_config([], recipe, (), []).objective == "sft"  # no verb (a worker, the Python face): the recipe's


def test_loss_type_is_sfts_nll_under_sft_and_dpos_losses_under_dpo():
    """A dumped SFTConfig says loss_type: nll (TRL's SFT default); dft is refused with its own reason; a DPO loss
    given to sft names shardtune dpo."""
    assert build_config([("loss_type", "nll")], None, (), [], objective="sft").dpo.loss_type == ["sigmoid"]
    with pytest.raises(ConfigError, match="--loss_type dft .*not built in shardtune sft"):
        build_config([("loss_type", "dft")], None, (), [], objective="sft")
    with pytest.raises(ConfigError, match="--loss_type sigmoid is not a loss of shardtune sft.*shardtune dpo"):
        build_config([("loss_type", "sigmoid")], None, (), [], objective="sft")
    dpo = split_argv(["--loss_type", "sigmoid", "sft", "--loss_weights", "1.0", "0.5"])
    assert build_config(dpo.training, None, (), [], objective="dpo").dpo.loss_type == ["sigmoid", "sft"]


@pytest.mark.parametrize("loss", ["cispo", "sapo", "luspo", "vespo"])
def test_a_grpo_loss_trl_has_and_shardtune_does_not_is_refused_saying_what_it_is(loss):
    """TRL 1.16's GRPO losses that are not built are refused at once, each with what it is (GRPO_LOSS_TYPES_NOT_BUILT)
    and the losses that are."""
    from shardtune.config.schema import GRPO_LOSS_TYPES, GRPO_LOSS_TYPES_NOT_BUILT

    with pytest.raises(ConfigError) as refused:
        build_config([("loss_type", loss)], None, (), [], objective="grpo")
    assert str(refused.value).startswith(
        f"--loss_type {loss} ({GRPO_LOSS_TYPES_NOT_BUILT[loss]}) is not built in shardtune grpo: "
    )
    assert all(name in str(refused.value) for name in GRPO_LOSS_TYPES)


@pytest.mark.parametrize(
    "loss, owner", [("sigmoid", "dpo"), ("ipo", "dpo"), ("dapo", "grpo"), ("dr_grpo", "grpo"), ("no_such_loss", "")]
)
def test_a_loss_of_another_objective_under_sft_names_the_objective_that_trains_it(loss, owner):
    """Under sft, a DPO loss names shardtune dpo and a GRPO loss shardtune grpo (GRPO's are not preference losses);
    a name no objective trains names none."""
    with pytest.raises(ConfigError) as refused:
        build_config([("loss_type", loss)], None, (), [], objective="sft")
    line = str(refused.value)
    assert line.startswith(f"--loss_type {loss} is not a loss of shardtune sft (TRL's loss_type there: nll)"), line
    others = {"dpo", "grpo"} - {owner}
    assert (f"but of shardtune {owner}" in line) == bool(owner), line
    assert not any(f"shardtune {other}" in line for other in others) and "preference" not in line, line
