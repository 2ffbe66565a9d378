"""``--no_X`` on the command line is ``--X false`` for every switch X of any dialect (TRL's names, llama-cookbook's,
the canonical dotted names), as transformers' HfArgumentParser (TRL's commands' parser) offers it; a name that takes
a value, or ``--no_X value``, is refused in one line naming the flag. Parsed by the real front door (split_argv,
build_config); TRL's side by trl 1.16's own parser. Nothing here launches."""

from __future__ import annotations

import dataclasses
import os
import types
import typing

import pytest

from shardtune.config.argv import split_argv
from shardtune.config.fields import flat_fields, get_value, optional
from shardtune.config.flags import build_config, to_dict
from shardtune.config.help import flag_table, help_text
from shardtune.config.objectives import OBJECTIVES
from shardtune.config.schema import ConfigError
from shardtune.config.spellings import SWITCHES_BY_NAME, is_switch, spellings, translates_a_boolean
from shardtune.runtime.distributed import local_gpu_count

NAMES = [*flat_fields(), *spellings()]
SWITCHES = [name for name in NAMES if is_switch(name)]


@pytest.fixture(autouse=True)
def environment_kept():
    """TRL's / transformers' configs write Accelerate's variables into os.environ: put it back."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


def outcome(argv: list[str], objective: str) -> tuple[str, object]:
    """What the front door makes of ``argv``: the whole canonical config (and whose defaults, and why), or the one-line
    refusal."""
    try:
        cfg = build_config(split_argv(argv).training, objective=objective)
    except ConfigError as e:
        assert "\n" not in str(e), e
        return "refused", str(e)
    return "config", (to_dict(cfg), cfg.provenance.defaults_reason)


@pytest.mark.parametrize("objective", list(OBJECTIVES))
def test_no_x_is_x_false_for_every_switch_of_every_dialect(objective):
    accepted = 0
    for name in SWITCHES:
        negated = outcome([f"--no_{name}"], objective)
        assert negated == outcome([f"--{name}", "false"], objective), name
        accepted += negated[0] == "config"
    assert accepted > 150, accepted  # most switches are honoured, not refused alike on both sides


def test_a_canonical_switch_is_false_after_no_and_true_bare():
    """The control: --no_X is not a no-op, and a later flag wins as with --X false."""
    booleans = [key for key, info in flat_fields().items() if optional(info.type)[0] is bool]
    assert len(booleans) > 30 and set(booleans) <= set(SWITCHES)
    for key in booleans:
        off = build_config(split_argv([f"--{key}", f"--no_{key}"]).training)
        on = build_config(split_argv([f"--no_{key}", f"--{key}"]).training)
        assert (get_value(off, key), get_value(on, key)) == (False, True), key
    packed = build_config(split_argv(["--no_packing", "--packing"]).training)
    padded = build_config(split_argv(["--packing", "--no-packing"]).training)
    assert (packed.data.batching, padded.data.batching) == ("packing", "padding")


def test_the_three_dialects_spellings_of_one_switch_turn_it_off():
    for argv in (
        ["--no_gradient_checkpointing"],  # TRL's
        ["--no_fsdp_config.fsdp_activation_checkpointing"],  # llama-cookbook's
        ["--no_parallel.activation_checkpointing"],  # canonical
        ["--no-gradient-checkpointing"],
    ):
        cfg = build_config(split_argv([*argv, "--defaults", "trl"]).training)  # TRL's default: on
        assert cfg.parallel.activation_checkpointing is False, argv
    assert build_config(split_argv(["--defaults", "trl"]).training).parallel.activation_checkpointing


def test_no_remove_unused_columns_means_what_remove_unused_columns_false_means():
    """TRL's documented --no_remove_unused_columns: accepted as Trainer's false is here (only the columns of the
    data's format are read), the same config as without it."""
    without = outcome(["--defaults", "trl"], "sft")
    assert outcome(["--no_remove_unused_columns", "--defaults", "trl"], "sft") == without
    assert outcome(["--remove_unused_columns", "false", "--defaults", "trl"], "sft") == without


def test_a_refused_switch_gets_the_refusal_of_x_false():
    for name, needle in (
        ("dataloader_in_order", "--dataloader_in_order false: batches come in the data order"),
        ("eval_packing", "--eval_packing: evaluation batches are built as training batches are"),
    ):
        kind, message = outcome([f"--no_{name}"], "sft")
        assert kind == "refused" and message.startswith(needle), message
    assert outcome(["--no_use_vllm"], "grpo") == outcome([], "grpo")  # TRL's default false asks for nothing


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--no_max_steps"], "--no_max_steps: --max_steps is not a switch (it takes a value, not true / false)"),
        (["--no_output_dir"], "--no_output_dir: --output_dir is not a switch"),
        (["--no_optim.lr"], "--no_optim.lr: --optim.lr is not a switch"),
        (["--no_loss_type"], "--no_loss_type: --loss_type is not a switch"),
        (["--no_packing", "true"], "--no_packing takes no value: drop 'true', or pass --packing true"),
        (["--no_packing=false"], "--no_packing takes no value: drop 'false', or pass --packing false"),
        (["--no_bf16", "off", "--lr", "1e-4"], "--no_bf16 takes no value: drop 'off'"),
        (["--no_such_switch"], "unknown flag --no_such_switch"),
    ],
)
def test_no_before_a_name_that_takes_a_value_or_with_a_value_is_refused_naming_the_flag(argv, message):
    with pytest.raises(ConfigError) as caught:
        build_config(split_argv(argv).training)
    assert str(caught.value).startswith(message) and "\n" not in str(caught.value), caught.value


def test_a_recipe_knows_no_no_x(tmp_path):
    """YAML recipes are unaffected: a key is a setting's name (as TRL's YAML files are read)."""
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("no_packing: true\n")
    with pytest.raises(ConfigError, match="unknown keys: no_packing"):
        build_config([], str(recipe))


def test_help_and_the_flag_table_say_switches_take_no():
    assert "--no_packing" in help_text() and "--no_gradient_checkpointing" in flag_table()


# -- TRL's own parser as the oracle ----------------------------------------------------------------------------------


def trl_classes():
    from transformers import TrainingArguments
    from trl import (
        DPOConfig,
        GRPOConfig,
        KTOConfig,
        ModelConfig,
        RewardConfig,
        RLOOConfig,
        ScriptArguments,
        SFTConfig,
    )

    configs = {"sft": SFTConfig, "dpo": DPOConfig, "grpo": GRPOConfig, "kto": KTOConfig, "rloo": RLOOConfig}
    configs["reward"] = RewardConfig
    return configs, (ModelConfig, ScriptArguments, TrainingArguments)


def takes_a_boolean(annotation) -> bool:
    """bool, bool | None, str | bool ...: a field TRL's parser reads true / false into."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        return bool in typing.get_args(annotation)
    return annotation is bool


def test_every_boolean_of_trls_configs_is_a_switch_here():
    configs, others = trl_classes()
    booleans = {
        f.name
        for cls in (*configs.values(), *others)
        for f in dataclasses.fields(cls)
        if f.init and takes_a_boolean(typing.get_type_hints(cls)[f.name])
    }
    assert {"remove_unused_columns", "gradient_checkpointing", "bf16", "use_peft", "packing"} <= booleans
    assert sorted(booleans - set(SWITCHES)) == []
    # every name listed by hand is one of TRL's booleans that its translation alone does not show
    assert set(SWITCHES_BY_NAME) <= booleans
    for name in SWITCHES_BY_NAME:
        spelling = spellings()[name]
        assert spelling.to is not None and not spelling.refuse, name
        # where GPUs are visible --use_cpu true is refused, so its translation does not show a boolean
        assert not translates_a_boolean(spelling) or (name == "use_cpu" and not local_gpu_count()), name


@pytest.mark.parametrize("objective", list(OBJECTIVES))
def test_trls_parser_reads_each_of_its_no_x_as_x_false_and_so_does_ours(objective):
    from transformers import HfArgumentParser

    configs, (model_config, script_arguments, _) = trl_classes()
    parser = HfArgumentParser((script_arguments, configs[objective], model_config))
    negations = sorted(option for option in parser._option_string_actions if option.startswith("--no_"))
    assert "--no_gradient_checkpointing" in negations and len(negations) >= 8, negations

    def trls(argv):
        parsed = parser.parse_args_into_dataclasses([*argv, "--use_cpu", "true", "--output_dir", "out"])
        return [dataclasses.asdict(one) for one in parsed]

    for option in negations:
        name = option.removeprefix("--no_")
        parsed = trls([option])
        assert parsed == trls([f"--{name}", "false"]), option
        assert [one[name] for one in parsed if name in one] == [False], option
        assert is_switch(name), name
        assert outcome([option], objective) == outcome([f"--{name}", "false"], objective), option
