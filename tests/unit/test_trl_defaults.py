"""A TRL command means what it means in TRL: the commands of TRL's docs (clis.md, sft_trainer.md, dpo_trainer.md,
peft_integration.md), parsed by trl 1.16's own parser and by shardtune's, resolve to the same settings field by
field; whose defaults a command gets is decided by one rule (shardtune.config.defaults), said in the start log, and
a mix of the two tools' names is refused in one line."""

from __future__ import annotations

import pytest

from shardtune.config.argv import split_argv
from shardtune.config.defaults import TRL_DEFAULTS, summary
from shardtune.config.flags import build_config, config_from
from shardtune.config.schema import ConfigError

pytest.importorskip("trl")

MODEL, DATA, OUT = "models/tiny", "data/text.jsonl", "out"
BASE = ["--model_name_or_path", MODEL, "--dataset_name", DATA, "--output_dir", OUT]

# the docs' commands (local paths for their hub ids)
SFT_COMMANDS = {
    "clis.md": BASE,
    "sft_trainer.md, LoRA": [
        *BASE,
        "--learning_rate",
        "2.0e-4",
        "--num_train_epochs",
        "1",
        "--packing",
        "--per_device_train_batch_size",
        "2",
        "--gradient_accumulation_steps",
        "8",
        "--eval_strategy",
        "steps",
        "--eval_steps",
        "100",
        "--use_peft",
        "--lora_r",
        "32",
        "--lora_alpha",
        "16",
    ],
    "peft_integration.md": [*BASE, "--use_peft", "--lora_r", "64", "--lora_alpha", "16", "--max_length", "512"],
    "max_steps, warmup, cosine": [
        *BASE,
        "--max_steps",
        "5",
        "--warmup_steps",
        "0.1",
        "--lr_scheduler_type",
        "cosine",
        "--save_strategy",
        "epoch",
        "--logging_steps",
        "2",
    ],
}
DPO_COMMANDS = {
    "dpo_trainer.md": BASE,
    "dpo_trainer.md, LoRA": [*BASE, "--use_peft", "--lora_r", "32", "--lora_alpha", "16", "--beta", "0.2"],
}
GRPO_COMMANDS = {
    "grpo_trainer.md": [*BASE, "--reward_funcs", "accuracy_reward"],
    "grpo_trainer.md, GSPO": [
        *BASE,
        "--reward_funcs",
        "accuracy_reward",
        "--importance_sampling_level",
        "sequence",
        "--loss_type",
        "grpo",
        "--beta",
        "0.04",
        "--epsilon",
        "3e-4",
        "--epsilon_high",
        "4e-4",
        "--steps_per_generation",
        "4",
        "--gradient_accumulation_steps",
        "2",
        "--num_generations",
        "4",
        "--scale_rewards",
        "batch",
    ],
}
GRPO_FIELDS = (
    "num_generations",
    "max_completion_length",
    "temperature",
    "top_p",
    "top_k",
    "beta",
    "epsilon",
    "loss_type",
    "scale_rewards",
    "num_iterations",
    "steps_per_generation",
    "importance_sampling_level",
    "mask_truncated_completions",
    "multi_objective_aggregation",
    "use_bias_correction_kl",
)


def trl_parsed(argv: list[str], objective: str):
    """trl's own reading of a command line (its CLI's dataclasses); on this CPU bf16 is off (TRL refuses it here)."""
    from transformers import HfArgumentParser
    from trl import DPOConfig, GRPOConfig, ModelConfig, ScriptArguments, SFTConfig

    config = {"sft": SFTConfig, "dpo": DPOConfig, "grpo": GRPOConfig}[objective]
    script = ScriptArguments
    if objective == "grpo":  # trl grpo's script arguments: --reward_funcs, --reward_model_name_or_path
        from trl.scripts.grpo import GRPOScriptArguments as script
    parser = HfArgumentParser((script, config, ModelConfig))
    script_args, args, model = parser.parse_args_into_dataclasses([*argv, "--use_cpu", "true"])
    args.reward_funcs = getattr(script_args, "reward_funcs", None)
    return args, model


def settings_of_trl(args, model, objective: str) -> dict:
    """TRL's resolved values, in shardtune's canonical terms."""
    value = lambda v: getattr(v, "value", v)  # noqa: E731 (Trainer's enums)
    save = value(args.save_strategy)
    dropout = 0.0 if getattr(args, "disable_dropout", False) else model.lora_dropout  # TRL zeroes every dropout
    out = {
        "optim.lr": args.learning_rate,
        "optim.lr_scheduler": value(args.lr_scheduler_type),
        "optim.warmup_steps": args.warmup_steps,  # transformers 5: a float below 1 is a ratio
        "optim.max_grad_norm": args.max_grad_norm or None,
        "optim.optimizer": value(args.optim),
        "optim.weight_decay": args.weight_decay,
        "optim.adam_beta1": args.adam_beta1,
        "optim.adam_beta2": args.adam_beta2,
        "optim.adam_epsilon": args.adam_epsilon,
        "train.num_epochs": args.num_train_epochs,
        "train.max_steps": max(args.max_steps, 0),
        "train.batch_size": args.per_device_train_batch_size,
        "train.gradient_accumulation_steps": args.gradient_accumulation_steps,
        "train.seed": args.seed,
        "eval.batch_size": args.per_device_eval_batch_size,
        "eval.enabled": value(args.eval_strategy) != "no",
        "checkpoint.save_steps": args.save_steps if save == "steps" else 0.0,
        "logging.steps": args.logging_steps,
        "parallel.activation_checkpointing": args.gradient_checkpointing,
        "data.num_workers": args.dataloader_num_workers,
        "peft.method": "lora" if model.use_peft else "",
    }
    if value(args.eval_strategy) == "steps":
        out["eval.steps"] = args.eval_steps or args.logging_steps
    if objective == "grpo":  # TRL's None: shardtune's 0 (epsilon_high: epsilon)
        out |= {f"grpo.{name}": getattr(args, name) for name in GRPO_FIELDS}
        out["grpo.epsilon_high"] = args.epsilon_high or 0.0
        if args.steps_per_generation == args.gradient_accumulation_steps:  # TRL's None resolved: shardtune's 0
            out["grpo.steps_per_generation"] = 0
        out["grpo.reward_funcs"] = list(args.reward_funcs or [])
    if objective == "sft":
        out["data.batching"] = "packing" if args.packing else "padding"
        out["data.packing_strategy"] = args.packing_strategy
        out["data.context_length"] = args.max_length
    if model.use_peft:
        out |= {
            "peft.lora.r": model.lora_r,
            "peft.lora.alpha": model.lora_alpha,
            "peft.lora.dropout": dropout,
            "peft.lora.target_modules": model.lora_target_modules or ["q_proj", "v_proj"],  # peft's for Llama
        }
    return out


def ours(argv: list[str], objective: str | None = None):
    args = split_argv(argv)
    return build_config(args.training, args.recipe, (), None, objective)


@pytest.mark.parametrize(
    "objective,name,argv",
    [("sft", name, argv) for name, argv in SFT_COMMANDS.items()]
    + [("dpo", name, argv) for name, argv in DPO_COMMANDS.items()]
    + [("grpo", name, argv) for name, argv in GRPO_COMMANDS.items()],
)
def test_the_docs_commands_resolve_to_trls_settings_field_by_field(objective, name, argv):
    from shardtune.config.fields import get_value

    expected = settings_of_trl(*trl_parsed(argv, objective), objective)
    cfg = ours(argv, objective)
    got = {key: get_value(cfg, key) for key in expected}
    assert got == expected, name  # the same numbers, parsed from the same text
    assert cfg.run.defaults == "trl"


def test_the_table_of_trls_defaults_is_trls():
    """Every entry of TRL_DEFAULTS is what trl's dataclasses default to (so the table cannot drift from trl)."""
    for objective in ("sft", "dpo", "grpo"):
        expected = settings_of_trl(*trl_parsed(["--use_peft", "true"], objective), objective)
        for key, value in TRL_DEFAULTS[objective].items():
            assert expected.get(key, value) == value, (objective, key)
    assert set(TRL_DEFAULTS["sft"]) <= set(settings_of_trl(*trl_parsed(["--use_peft", "true"], "sft"), "sft")) | {
        "data.batching",
        "data.context_length",
    }


def test_whose_defaults_one_rule_said_in_the_start_log():
    cookbook = ours(["--model_name", MODEL, "--lr", "1e-4"])
    assert cookbook.run.defaults == "cookbook" and cookbook.optim.lr_scheduler == "step"
    assert ours([]).run.defaults == "cookbook"  # shardtune sft alone: the lesson's defaults, as always
    assert ours([], "dpo").run.defaults == "trl" and ours([], "dpo").optim.lr == 1e-6  # DPO is TRL's
    assert ours(["--lr", "1e-4"], "dpo").run.defaults == "cookbook"
    said = ours(["--defaults", "trl", "--lr", "3e-4", "--batch_size_training", "2"])  # a mix, whose said
    assert (said.run.defaults, said.optim.lr, said.train.batch_size, said.optim.max_grad_norm) == ("trl", 3e-4, 2, 1.0)
    with pytest.raises(ConfigError, match=r"--learning_rate is TRL's name and --batch_size_training llama-cookb"):
        ours(["--learning_rate", "1e-4", "--batch_size_training", "2"])
    with pytest.raises(ConfigError, match="choose"):
        ours(["--defaults", "axolotl"])
    line = summary(ours([*BASE, "--use_peft"]))
    assert line == (
        "defaults: TRL's (--model_name_or_path is TRL's): lr 2e-05, linear schedule, warmup 0 steps, "
        "max_grad_norm 1, 3 epochs, batch 8, checkpoints every 500 steps, padding, LoRA r 16 / alpha 32 / "
        "dropout 0.05"
    )
    assert summary(ours([])).startswith("defaults: llama-cookbook's (shardtune sft's when the names do not say): ")
    # code building a config gets the cookbook's unless it says (the Python API says trl)
    assert config_from({"learning_rate": 1e-3}).run.defaults == "cookbook"
    assert config_from({"defaults": "trl"}).train.num_epochs == 3


def test_a_trl_yaml_gets_trls_defaults_and_the_command_line_may_not_mix(tmp_path):
    recipe = tmp_path / "sft.yaml"
    recipe.write_text(f"model_name_or_path: {MODEL}\ndataset_name: {DATA}\nlearning_rate: 1.0e-4\n")
    cfg = ours(["--config", str(recipe)])
    assert (cfg.run.defaults, cfg.train.batch_size, cfg.optim.lr) == ("trl", 8, 1e-4)
    with pytest.raises(ConfigError, match="--run_validation"):
        ours(["--config", str(recipe), "--run_validation", "false"])


def test_eval_strategy_steps_without_eval_steps_evaluates_every_logging_steps_as_trainer():
    assert ours(["--eval_strategy", "steps"]).eval.steps == 10  # TRL's logging_steps
    assert ours(["--eval_strategy", "steps", "--logging_steps", "4"]).eval.steps == 4


def test_clis_md_command_trains_the_steps_trl_trains(tiny_model, tmp_path):
    """clis.md's command (local model and data, the learning rate raised so that steps differ) under trl 1.16's
    SFTTrainer and under shardtune (one gloo rank in this process): TRL's defaults on both sides (batch 8, 3 epochs,
    linear from the lr, clipping at 1, fused AdamW, gradient checkpointing, padding), 8 rows: one step an epoch of
    every row, so the data order does not matter; the three steps' losses agree."""
    import json

    import torch
    import torch.distributed as dist
    from datasets import load_dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTTrainer

    from shardtune.runtime.distributed import DistEnv
    from shardtune.training.engine.worker import fine_tune
    from tests.helpers import step_rows

    data = tmp_path / "text.jsonl"
    words = "the cat sat on a mat while two dogs ran far away from home at night".split()
    rows = [{"text": " ".join(words[i : i + 5 + i])} for i in range(8)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    argv = ["--model_name_or_path", str(tiny_model), "--dataset_name", str(data), "--learning_rate", "1e-3"]
    argv += ["--logging_steps", "1", "--bf16", "false", "--report_to", "none", "--save_strategy", "no"]

    args, _ = trl_parsed([*argv, "--output_dir", str(tmp_path / "trl")], "sft")
    trainer = SFTTrainer(
        model=AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32),
        args=args,
        train_dataset=load_dataset("json", data_files=str(data), split="train"),
        processing_class=AutoTokenizer.from_pretrained(tiny_model),
    )
    trainer.train()
    theirs = [r["loss"] for r in trainer.state.log_history if "loss" in r]

    cfg = ours([*argv, "--output_dir", str(tmp_path / "ours"), "--save_plots", "false"])
    assert (cfg.train.batch_size, cfg.train.num_epochs, cfg.optim.optimizer) == (8, 3, "adamw_torch_fused")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        fine_tune(cfg, DistEnv(0, 0, 1, 1, torch.device("cpu"), "gloo"))
    finally:
        dist.destroy_process_group()
    mine = [r["loss"] for r in step_rows(tmp_path / "ours")]
    assert len(mine) == len(theirs) == 3
    assert mine == pytest.approx(theirs, abs=1e-5), (mine, theirs)
