"""Every field of TRL 1.16's configs (SFTConfig, DPOConfig, GRPOConfig, ModelConfig, ScriptArguments, and the
TrainingArguments they inherit) is honoured or refused in one line naming it, and a config TRL dumps (``to_dict()``,
as YAML) loads as a recipe of shardtune sft / dpo / grpo. Nothing here launches."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest
import yaml
from transformers import TrainingArguments
from trl import DPOConfig, GRPOConfig, ModelConfig, ScriptArguments, SFTConfig

from shardtune.config.argv import split_argv
from shardtune.config.dialects import trl
from shardtune.config.fields import flat_fields
from shardtune.config.flags import build_config, parse_args
from shardtune.config.schema import ConfigError
from shardtune.config.spellings import resolve

CLASSES = (SFTConfig, DPOConfig, GRPOConfig, ModelConfig, ScriptArguments, TrainingArguments)
NAMES = sorted({f.name for cls in CLASSES for f in dataclasses.fields(cls)})
NOT_YET: tuple[str, ...] = ()  # names whose TRL default does not load yet: none
FIXES = ("drop", "use ", "set ", "pass ", "give ", "put ", "hide ", "write ", "choose ", "run ", "adapt ")


@pytest.fixture(autouse=True)
def environment_kept():
    """TRL's / transformers' configs write Accelerate's variables into os.environ (an FSDP config sets
    FSDP_CPU_RAM_EFFICIENT_LOADING): put it back, so that no later test in this process reads them."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


def trl_default(name: str):
    """TRL's default of field ``name`` (SFTConfig's first, as a dumped SFTConfig holds it)."""
    for cls in CLASSES:
        for f in dataclasses.fields(cls):
            if f.name == name and f.init:
                if f.default is not dataclasses.MISSING:
                    return f.default
                if f.default_factory is not dataclasses.MISSING:
                    return f.default_factory()
    return dataclasses.MISSING


def error_of(argv: list[str], objective: str | None = None) -> str:
    with pytest.raises(ConfigError) as error:
        build_config(split_argv(argv).training, objective=objective)
    message = str(error.value)
    assert "\n" not in message, message
    return message


def test_every_field_of_trls_configs_is_a_known_name():
    unknown = []
    for name in NAMES:
        try:
            resolve(name)
        except ConfigError as e:
            unknown.append(str(e))
    assert not unknown, unknown


def test_each_refused_name_is_refused_in_one_line_naming_it_and_ending_with_the_fix():
    refused = [name for name in NAMES if resolve(name).refuse]
    assert {"label_smoothing_factor", "neftune_noise_alpha", "eval_packing", "run_name"} <= set(refused)
    for name in refused:
        message = error_of([f"--{name}", "7"])
        assert message.startswith(f"--{name}: "), message
        assert any(fix in message.rsplit(":", 1)[1] for fix in FIXES), message
    assert build_config(split_argv(["--dataset_streaming", "true"]).training).data.streaming


def test_each_honoured_name_sets_settings_that_exist():
    for name in NAMES:
        spelling = resolve(name)
        if spelling.refuse or spelling.target == "-":
            continue
        targets = spelling.target.replace("/", " ").split()
        assert targets and all(t in flat_fields() for t in targets), (name, spelling.target)
        assert spelling.meaning or name not in trl.SPELLINGS, name


def test_names_accepted_as_what_shardtune_does_change_nothing_at_trls_default(tmp_path):
    """A name that sets nothing (its meaning says what shardtune does), or a refused one, given TRL's default in a
    recipe: the config is the one without it."""
    plain = parse_args([])
    recipe = tmp_path / "one.yaml"
    for name in NAMES:
        spelling = resolve(name)
        default = trl_default(name)
        if name in NOT_YET or spelling.target != "-" or default is dataclasses.MISSING:
            continue
        recipe.write_text(yaml.safe_dump({name: getattr(default, "value", default)}))
        assert parse_args(["--config", str(recipe)]) == plain, name


def test_honoured_names_mean_trainers_meaning(tmp_path):
    assert parse_args(["--ddp_timeout", "60"]).parallel.dist_timeout == 60
    assert parse_args(["--activation_checkpointing"]).parallel.activation_checkpointing
    assert not parse_args(["--activation_checkpointing", "false"]).parallel.activation_checkpointing
    assert parse_args(["--activation_checkpointing_kwargs", '{"use_reentrant": false}']) == parse_args([])
    assert parse_args(["--torch_compile_mode", "default"]).model.compile
    assert parse_args(["--torch_compile_backend", "inductor"]).model.compile
    assert parse_args(["--project", "mine"]).logging.wandb.project == "mine"
    assert parse_args(["--use_cpu", "false"]) == parse_args([])
    assert parse_args(["--data_seed", "7", "--seed", "7"]).train.seed == 7
    legacy = parse_args(["--fsdp", "full_shard offload auto_wrap"]).parallel
    assert (legacy.strategy, legacy.sharding_strategy, legacy.cpu_offload) == ("fsdp", "FULL_SHARD", True)
    assert parse_args(["--fsdp", "shard_grad_op"]).parallel.sharding_strategy == "SHARD_GRAD_OP"
    assert parse_args(["--fsdp", "hybrid_shard"]).parallel.sharding_strategy == "HYBRID_SHARD"
    fsdp_file = tmp_path / "fsdp.json"
    fsdp_file.write_text(json.dumps({"fsdp_cpu_ram_efficient_loading": True, "reshard_after_forward": False}))
    tuned = parse_args(["--fsdp", "--fsdp_config", str(fsdp_file)]).parallel
    assert (tuned.strategy, tuned.sharding_strategy, tuned.low_cpu_fsdp) == ("fsdp", "SHARD_GRAD_OP", True)
    ds_file = tmp_path / "ds.json"
    ds_file.write_text(json.dumps({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}}))
    zero3 = parse_args(["--deepspeed", str(ds_file)]).parallel
    assert (zero3.strategy, zero3.zero_stage, zero3.offload_param, zero3.offload_optimizer) == (
        "deepspeed",
        3,
        True,
        False,
    )
    assert zero3.deepspeed_config_file == str(ds_file)


def test_a_dumped_fsdp_config_reads_as_its_fsdp_settings(tmp_path):
    """TRL's to_dict() of an FSDP run: fsdp true, fsdp_config a mapping (with Trainer's filled-in keys)."""
    dumped = SFTConfig(
        output_dir="o",
        use_cpu=True,
        fsdp=True,
        fsdp_config={
            "reshard_after_forward": False,
            "fsdp_cpu_ram_efficient_loading": True,
            "transformer_layer_cls_to_wrap": "LlamaDecoderLayer",
            "state_dict_type": "FULL_STATE_DICT",
        },
    ).to_dict()
    recipe = tmp_path / "fsdp.yaml"
    recipe.write_text(yaml.safe_dump({k: dumped[k] for k in ("fsdp", "fsdp_config")}))
    cfg = parse_args(["--config", str(recipe)])
    p = cfg.parallel
    assert (p.strategy, p.sharding_strategy, p.low_cpu_fsdp) == ("fsdp", "SHARD_GRAD_OP", True)
    assert cfg.checkpoint.checkpoint_type == "FULL_STATE_DICT"


def test_values_that_ask_for_something_not_built_are_refused_naming_the_value():
    for argv, needle in [
        (["--label_smoothing_factor", "0.1"], "--label_smoothing_factor: "),
        (["--average_tokens_across_devices", "false"], "--average_tokens_across_devices false: "),
        (["--torch_compile_mode", "max-autotune"], "--torch_compile_mode max-autotune: "),
        (["--activation_checkpointing_kwargs", '{"use_reentrant": true}'], "use_reentrant true"),
        (["--fsdp", "hybrid_shard_zero2"], "--fsdp hybrid_shard_zero2 is not built"),
        (["--fsdp_config", '{"version": 1}'], "--fsdp_config.version 1: "),
        (["--fsdp_config.auto_wrap_policy", "SIZE_BASED_WRAP"], "TRANSFORMER_BASED_WRAP"),
        (["--deepspeed", '{"zero_optimization": {"stage": 3}}'], "write it to a JSON file"),
        (["--data_seed", "7"], "--data_seed 7: the data order is seeded by --seed (42)"),
        (["--logging_strategy", "epoch"], "--logging_strategy epoch: "),
        (["--logging_strategy", "no", "--report_to", "tensorboard"], "--logging_strategy no sends the trackers"),
        (["--log_level", "info"], "TRANSFORMERS_VERBOSITY"),
        (["--tf32", "true"], "--tf32 true: "),
        (["--accelerator_config", '{"split_batches": true}'], "--accelerator_config split_batches true: "),
        (["--train_sampling_strategy", "group_by_length"], "--train_sampling_strategy group_by_length: "),
    ]:
        assert needle in error_of(argv), (argv, error_of(argv))


def test_evaluation_prediction_names_mean_what_compute_metrics_gets():
    """compute_metrics exists (the Python face): each name of how Trainer gathers its predictions is accepted with
    the value that is what shardtune does and refused, with that meaning, otherwise; none says it is missing."""
    plain = parse_args([])
    assert parse_args(["--eval_do_concat_batches", "true", "--eval_accumulation_steps", "1"]) == plain
    assert parse_args(["--batch_eval_metrics", "false"]) == plain
    for argv, says in [
        (["--eval_do_concat_batches", "false"], "--eval_do_concat_batches false: compute_metrics gets whole arrays"),
        (["--eval_accumulation_steps", "4"], "--eval_accumulation_steps 4: each batch's predictions go to the host"),
        (["--include_for_metrics", "inputs"], "--include_for_metrics: compute_metrics gets predictions and label_ids"),
        (["--batch_eval_metrics", "true"], "--batch_eval_metrics: compute_metrics runs once on the whole split"),
    ]:
        assert error_of(argv).startswith(says), (argv, error_of(argv))
    for name in ("eval_do_concat_batches", "eval_accumulation_steps", "include_for_metrics", "batch_eval_metrics"):
        spelling = resolve(name)
        assert "no compute_metrics" not in spelling.meaning + spelling.refuse, name


def test_fsdp_and_deepspeed_together_are_refused(tmp_path):
    ds_file = tmp_path / "ds.json"
    ds_file.write_text("{}")
    assert "drop one of them" in error_of(["--fsdp", "--deepspeed", str(ds_file)])


def test_use_cpu_and_ddp_backend_follow_the_machine():
    """--use_cpu true is what shardtune does where no GPU is visible, and refused where GPUs are (with the fix)."""
    from shardtune.config.dialects.trl_trainer import gpus_visible

    if gpus_visible():
        assert "CUDA_VISIBLE_DEVICES=" in error_of(["--use_cpu", "true"])
        assert parse_args(["--ddp_backend", "nccl"]) == parse_args([])
        assert "nccl here" in error_of(["--ddp_backend", "gloo"])
    else:
        assert parse_args(["--use_cpu", "true"]) == parse_args([])
        assert parse_args(["--ddp_backend", "gloo"]) == parse_args([])
        assert "gloo here" in error_of(["--ddp_backend", "nccl"])


def dumped(cls, tmp_path: Path) -> str:
    """TRL's config dumps (``to_dict()``, ModelConfig's and ScriptArguments' fields) as one YAML recipe."""
    data = {
        **dataclasses.asdict(ModelConfig()),
        **dataclasses.asdict(ScriptArguments(dataset_name="trl-lib/Capybara")),
        **cls(output_dir=str(tmp_path / "out"), use_cpu=True).to_dict(),
    }
    path = tmp_path / f"{cls.__name__}.yaml"
    path.write_text(yaml.safe_dump({k: v for k, v in data.items() if k not in NOT_YET}))
    return str(path)


@pytest.mark.parametrize("cls,objective", [(SFTConfig, "sft"), (DPOConfig, "dpo"), (GRPOConfig, "grpo")])
def test_a_dumped_trl_config_loads_as_a_recipe(cls, objective, tmp_path):
    args = split_argv(["--config", dumped(cls, tmp_path)])
    cfg = build_config(args.training, args.recipe, objective=objective)  # what shardtune sft / dpo --config reads
    assert cfg.run.defaults == "trl"
    assert cfg.optim.lr == cls(output_dir="o", use_cpu=True).learning_rate
    assert cfg.parallel.activation_checkpointing and cfg.parallel.dist_timeout == 1800
    assert cfg.logging.wandb.project == "huggingface"  # TRL's project
    assert cfg.data.trl_dataset.eos_token == "" and cfg.output.hub_token == ""  # to_dict()'s "<EOS_TOKEN>" hides it
    assert cfg.run.debug is False  # TrainingArguments' debug: []


def test_trl_py_refusals_take_an_empty_value_as_no_change(tmp_path):
    recipe = tmp_path / "r.yaml"
    empty = {"dataset_num_proc": None, "eval_packing": None, "pad_to_multiple_of": None, "dataset_kwargs": None}
    recipe.write_text(yaml.safe_dump({**empty, "pad_token": "<PAD_TOKEN>", "learning_rate": 1e-4}))
    assert parse_args(["--config", str(recipe)]) == parse_args(["--learning_rate", "1e-4"])
    assert error_of(["--pad_to_multiple_of", "8"]).startswith("--pad_to_multiple_of: ")
    assert error_of(["--eval_packing"]).startswith("--eval_packing: ")  # a bare switch is true: asks for it


def test_a_suggestion_is_never_another_objectives_flag_nor_a_refused_one(tmp_path):
    sft = error_of(["--betta", "0.2"])
    assert "--beta" not in sft and "did you mean" not in sft, sft
    assert "did you mean --beta?" in error_of(["--betta", "0.2"], objective="dpo")
    assert "did you mean" not in error_of(["--neftune_noise_alph", "5"])  # the closest is refused: no suggestion
    smoothing = error_of(["--label_smoothing_factor", "0.1"])
    assert smoothing.startswith("--label_smoothing_factor: ") and "label_smoothing " not in smoothing
    assert "did you mean --label_smoothing?" in error_of(["--label_smothing", "0.1"], objective="dpo")
    assert "did you mean" not in error_of(["--label_smothing", "0.1"])
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump({"betta": 0.2}))
    with pytest.raises(ConfigError, match="did you mean --beta"):
        build_config([], str(recipe), objective="dpo")
    with pytest.raises(ConfigError) as error:
        build_config([], str(recipe), objective="sft")
    assert "--beta" not in str(error.value)
