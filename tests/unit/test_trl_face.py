"""TRL's public face in shardtune's namespace, checked against trl 1.16 itself without a launch: every public name of
``trl`` is here or refused at import with its reason; the configs are dataclasses with TRL's fields, types and
defaults; TrlParser parses TRL's documented commands and ``--config`` files into the same values as trl's; the
script helpers (get_dataset, get_peft_config, get_quantization_config) return what trl's return; the trainer's
script surface (accelerator, metrics files, state, callbacks, model card) behaves as transformers' Trainer's. The
runs of TRL's own scripts: tests/e2e/test_trl_scripts.py."""

from __future__ import annotations

import dataclasses
import inspect
import json
import pathlib
import re
import shlex
import typing

import pytest
import torch

import shardtune
from shardtune.config.schema import ConfigError

ROWS = [{"prompt": f"say {i}", "completion": f" {i}"} for i in range(6)]


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDTUNE_CACHE", str(tmp_path / "cache"))


def _trl():
    import trl

    return trl


def test_every_public_name_of_trl_is_here_or_refused_at_import_with_its_reason():
    trl = _trl()
    names = {n for n in dir(trl) if not n.startswith("_") and not inspect.ismodule(getattr(trl, n))}
    assert names <= set(shardtune.__all__) | set(shardtune.REFUSED), names - set(shardtune.__all__)
    for name in sorted(names & set(shardtune.__all__)):
        assert getattr(shardtune, name) is not None
    for name, why in shardtune.REFUSED.items():
        with pytest.raises(ImportError, match=re.escape(why)):
            exec(f"from shardtune import {name}")
    with pytest.raises(AttributeError):  # a name trl does not have either stays an AttributeError
        shardtune.NoSuchTrainer  # noqa: B018
    import importlib

    theirs_module = importlib.import_module("trl.data_utils")
    ours_module = importlib.import_module("shardtune.data_utils")  # trl.data_utils's path, for scripts importing it
    wanted = set(ours_module.__all__)
    assert wanted <= set(dir(theirs_module)) and all(callable(getattr(ours_module, n)) for n in wanted)


def _field_defaults(cls: type) -> dict[str, typing.Any]:
    out = {}
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            out[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            out[f.name] = f.default_factory()
        else:
            out[f.name] = dataclasses.MISSING
    return out


def _pairs():
    trl = _trl()
    from trl.scripts.utils import DatasetConfig

    return [
        (trl.SFTConfig, shardtune.SFTConfig),
        (trl.DPOConfig, shardtune.DPOConfig),
        (trl.GRPOConfig, shardtune.GRPOConfig),
        (trl.RewardConfig, shardtune.RewardConfig),
        (trl.KTOConfig, shardtune.KTOConfig),
        (trl.RLOOConfig, shardtune.RLOOConfig),
        (trl.ModelConfig, shardtune.ModelConfig),
        (trl.ScriptArguments, shardtune.ScriptArguments),
        (trl.DatasetMixtureConfig, shardtune.DatasetMixtureConfig),
        (DatasetConfig, shardtune.DatasetConfig),
    ]


# fields shardtune's configs add to TRL's: RLOO samples with tools as GRPO does (GRPOConfig's field)
EXTRA_FIELDS = {"RLOOConfig": {"max_tool_calling_iterations"}}


def test_configs_are_dataclasses_with_trls_fields_types_and_defaults():
    for theirs, ours in _pairs():
        assert dataclasses.is_dataclass(ours)
        their_types, our_types = typing.get_type_hints(theirs), typing.get_type_hints(ours)
        their_fields = [f.name for f in dataclasses.fields(theirs)]
        extra = EXTRA_FIELDS.get(ours.__name__, set())  # shardtune's, beyond TRL's, named here
        assert sorted(their_fields) == sorted(f.name for f in dataclasses.fields(ours) if f.name not in extra), ours
        for name in their_fields:
            if name != "datasets":  # list[DatasetConfig]: each its own class
                assert their_types[name] == our_types[name], (ours.__name__, name)
        their_defaults, our_defaults = _field_defaults(theirs), _field_defaults(ours)
        for name in their_fields:  # field by field (a shared base class may declare them in another order)
            assert repr(their_defaults[name]) == repr(our_defaults[name]).replace("shardtune.api.script_args", ""), (
                ours.__name__,
                name,
            )
    # the help is shardtune's meaning of the field (what --help shows), or why it is refused
    helps = {f.name: f.metadata["help"] for f in dataclasses.fields(shardtune.GRPOConfig)}
    assert "not built" in helps["use_vllm"] and "completions sampled per prompt" in helps["num_generations"]


def test_a_config_reads_trls_defaults_and_works_with_replace_and_to_dict():
    args = shardtune.SFTConfig(output_dir="out")
    assert args.eval_strategy == "no" and args.push_to_hub is False and args.resume_from_checkpoint is None
    assert args.model_init_kwargs is None and args.dataset_text_field == "text" and args.packing_strategy == "bfd"
    assert args.bf16 is True  # TRL's rule: unset bf16 is true unless fp16 (here: bf16 where the device has it)
    changed = dataclasses.replace(args, learning_rate=1e-3)
    assert changed.learning_rate == 1e-3 and args.learning_rate == 2e-5
    assert args.to_dict()["logging_steps"] == 10 and json.loads(args.to_json_string())["output_dir"] == "out"
    grpo = shardtune.GRPOConfig(output_dir="g", per_device_train_batch_size=4, gradient_accumulation_steps=2)
    assert (grpo.steps_per_generation, grpo.generation_batch_size) == (2, 8)  # derived as TRL derives them
    assert shardtune.DPOConfig(output_dir="d", loss_type="ipo").loss_type == ["ipo"]
    # making a config starts no process group, and reads who this process is from torchrun's environment
    assert not torch.distributed.is_initialized()
    assert (args.world_size, args.process_index, args.local_process_index) == (1, 0, 0)
    assert args.device.type == ("cuda" if torch.cuda.is_available() else "cpu")


def test_a_field_shardtune_cannot_honour_is_refused_when_set_in_one_line():
    with pytest.raises(ConfigError, match="--use_vllm") as error:
        shardtune.GRPOConfig(output_dir="g", use_vllm=True)
    assert "\n" not in str(error.value)
    shardtune.GRPOConfig(output_dir="g", use_vllm=False)  # its default asks for nothing
    # TRL's scripts pass ModelConfig's unset fields in model_init_kwargs: None is the default
    kwargs = {"revision": "main", "trust_remote_code": False, "attn_implementation": None, "dtype": None}
    shardtune.SFTConfig(output_dir="x", model_init_kwargs=kwargs)
    shardtune.SFTConfig(output_dir="x", model_init_kwargs={"device_map": "auto", "use_cache": False})
    with pytest.raises(ConfigError, match="device_map"):
        shardtune.SFTConfig(output_dir="x", model_init_kwargs={"device_map": {"": 3}})
    with pytest.raises(ConfigError, match="--model_init_kwargs low_cpu_mem_usage is not built"):
        shardtune.SFTConfig(output_dir="x", model_init_kwargs={"low_cpu_mem_usage": True})


def _documented_commands(script: str) -> list[list[str]]:
    import trl.scripts

    text = (pathlib.Path(trl.scripts.__file__).parent / f"{script}.py").read_text()
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        argv = shlex.split(block.replace("\\\n", " "))
        commands.append(argv[next(i for i, a in enumerate(argv) if a.endswith(".py")) + 1 :])
    return commands


def _parsed(parser_class: type, classes: tuple, argv: list[str]) -> list[dict]:
    return [dataclasses.asdict(x) for x in parser_class(classes).parse_args_and_config(argv)]


def test_trl_parser_parses_trls_documented_commands_as_trls_parser_does(tmp_path, monkeypatch):
    trl = _trl()
    ours = (shardtune.ScriptArguments, None, shardtune.ModelConfig, shardtune.DatasetMixtureConfig)
    theirs = (trl.ScriptArguments, None, trl.ModelConfig, trl.DatasetMixtureConfig)
    checked = 0
    for script, ours_config, their_config in (("sft", "SFTConfig", "SFTConfig"), ("dpo", "DPOConfig", "DPOConfig")):
        mine = (ours[0], getattr(shardtune, ours_config), *ours[2:])
        their = (theirs[0], getattr(trl, their_config), *theirs[2:])
        for argv in _documented_commands(script):
            argv = [*argv, "--bf16", "false"]  # trl's TrainingArguments refuses bf16 on a machine without a GPU
            assert str(_parsed(shardtune.TrlParser, mine, argv)) == str(_parsed(trl.TrlParser, their, argv))
            checked += 1
    assert checked == 4
    # a --config file: its values are defaults the command line overrides; its env section is set first
    config = tmp_path / "sft.yaml"
    config.write_text(
        "env:\n  SHARDTUNE_TEST_VAR: seven\nlearning_rate: 3.0e-4\nlora_r: 8\nmax_length: 77\n"
        "datasets:\n  - path: data/a.jsonl\n    fraction: 0.5\n  - path: data/b.jsonl\n    fraction: 0.5\n"
    )
    argv = ["--config", str(config), "--output_dir", "o", "--max_length", "99", "--no_gradient_checkpointing"]
    argv += ["--bf16", "false"]
    monkeypatch.delenv("SHARDTUNE_TEST_VAR", raising=False)
    mine = _parsed(
        shardtune.TrlParser, (shardtune.SFTConfig, shardtune.ModelConfig, shardtune.DatasetMixtureConfig), argv
    )
    assert __import__("os").environ["SHARDTUNE_TEST_VAR"] == "seven"
    their = _parsed(trl.TrlParser, (trl.SFTConfig, trl.ModelConfig, trl.DatasetMixtureConfig), argv)
    assert str(mine) == str(their)
    assert (mine[0]["learning_rate"], mine[0]["max_length"], mine[0]["gradient_checkpointing"]) == (3e-4, 99, False)
    # keys no dataclass has: refused, returned, or dropped, as trl's parser does
    config.write_text("learning_rate: 3.0e-4\nno_such_key: 1\n")
    with pytest.raises(ConfigError, match="no_such_key"):
        shardtune.TrlParser(shardtune.SFTConfig).parse_args_and_config(["--config", str(config), "--bf16", "false"])
    *_, remaining = shardtune.TrlParser(shardtune.SFTConfig).parse_args_and_config(
        ["--config", str(config), "--bf16", "false"], return_remaining_strings=True
    )
    assert remaining == ["--no_such_key", "1"]


def test_get_dataset_gives_trls_mixture(tmp_path):
    trl = _trl()
    from trl.scripts.utils import DatasetConfig as TheirEntry

    for name, count in (("a", 10), ("b", 6)):
        with open(tmp_path / f"{name}.jsonl", "w") as f:
            for i in range(count):
                f.write(json.dumps({"prompt": f"{name}{i}", "completion": "x", "extra": i}) + "\n")
    entries = [
        dict(path="json", data_files=str(tmp_path / "a.jsonl"), columns=["prompt", "completion"], fraction=0.7),
        dict(path="json", data_files=str(tmp_path / "b.jsonl"), columns=["prompt", "completion"], fraction=0.3),
    ]
    ours = shardtune.get_dataset(shardtune.DatasetMixtureConfig(datasets=entries))
    theirs = trl.get_dataset(trl.DatasetMixtureConfig(datasets=[TheirEntry(**e) for e in entries]))
    assert ours["train"].to_list() == theirs["train"].to_list() and len(ours["train"]) == 14  # 10 + 4: none repeated
    split = shardtune.DatasetMixtureConfig(datasets=entries, test_split_size=0.25)
    first, again = shardtune.get_dataset(split), shardtune.get_dataset(split)
    assert first["test"].to_list() == again["test"].to_list()  # seeded: every process holds the same split
    assert sorted(r["prompt"] for r in first["train"].to_list() + first["test"].to_list()) == sorted(
        r["prompt"] for r in ours["train"].to_list()
    )
    with pytest.raises(ConfigError, match="names no dataset"):
        shardtune.get_dataset(shardtune.DatasetMixtureConfig())


def test_peft_and_quantization_helpers_return_what_trls_return():
    trl = _trl()
    fields = dict(use_peft=True, lora_r=8, lora_alpha=16, lora_target_modules=["q_proj", "v_proj"], use_dora=True)
    assert shardtune.get_peft_config(shardtune.ModelConfig(**fields)).to_dict() == (
        trl.get_peft_config(trl.ModelConfig(**fields)).to_dict()
    )
    assert shardtune.get_peft_config(shardtune.ModelConfig()) is None
    assert shardtune.ModelConfig(lora_target_modules=["all-linear"]).lora_target_modules == "all-linear"
    for fields in (dict(load_in_4bit=True, use_bnb_nested_quant=True), dict(load_in_8bit=True), {}):
        ours = shardtune.get_quantization_config(shardtune.ModelConfig(**fields))
        theirs = trl.get_quantization_config(trl.ModelConfig(**fields))
        assert (ours.to_dict() if ours else None) == (theirs.to_dict() if theirs else None)
    with pytest.raises(ConfigError, match="load_in_8bit and load_in_4bit"):
        shardtune.ModelConfig(load_in_4bit=True, load_in_8bit=True)
    assert shardtune.get_kbit_device_map() == ({"": 0} if torch.cuda.is_available() else None)


def test_the_trainer_takes_quantization_config_and_the_tokenizer_of_a_model_object(tiny_model):
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from shardtune.model.loading import load_model

    q = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True)
    cfg = shardtune.SFTTrainer(model=str(tiny_model), train_dataset=ROWS, quantization_config=q).config
    assert (cfg.model.quantization, cfg.model.quant_type, cfg.model.double_quant) == ("4bit", "nf4", True)
    with pytest.raises(ConfigError, match="quantization_config.llm_int8_threshold"):
        shardtune.SFTTrainer(
            model=str(tiny_model),
            train_dataset=ROWS,
            quantization_config=BitsAndBytesConfig(load_in_8bit=True, llm_int8_threshold=3.0),
        )
    # a model object without processing_class: the tokenizer of the path it was loaded from (TRL's rule)
    trainer = shardtune.SFTTrainer(model=load_model(str(tiny_model), dtype=torch.float32), train_dataset=ROWS)
    assert trainer.config.model.tokenizer == str(tiny_model)
    assert trainer.processing_class.pad_token is not None
    built = AutoModelForCausalLM.from_config(load_model(str(tiny_model), dtype=torch.float32).config)
    built.config._name_or_path = ""
    with pytest.raises(ConfigError, match="pass processing_class"):
        shardtune.SFTTrainer(model=built, train_dataset=ROWS)


def test_the_script_accelerator_on_one_process(capsys):
    trainer_accelerator = shardtune.SFTTrainer.accelerator.fget(None)
    assert (trainer_accelerator.process_index, trainer_accelerator.num_processes) == (0, 1)
    assert trainer_accelerator.is_main_process and trainer_accelerator.is_local_main_process
    trainer_accelerator.print("once")
    assert capsys.readouterr().out == "once\n"
    values = {"a": torch.tensor([1.0, 2.0]), "b": [torch.tensor(3.0)]}
    gathered = trainer_accelerator.gather(values)
    assert torch.equal(gathered["a"], values["a"]) and torch.equal(gathered["b"][0], torch.tensor([3.0]))
    assert trainer_accelerator.gather_for_metrics(["x", "y"]) == ["x", "y"]
    assert torch.equal(trainer_accelerator.reduce(torch.tensor([2.0]), "mean", scale=3.0), torch.tensor([6.0]))
    with trainer_accelerator.main_process_first():
        trainer_accelerator.wait_for_everyone()
    assert trainer_accelerator.on_main_process(lambda: 7)() == 7
    assert not torch.distributed.is_initialized()


def test_metrics_files_and_state_are_trainers(tiny_model, tmp_path, capsys):
    from transformers import TrainerCallback, TrainerState
    from transformers.trainer_pt_utils import save_metrics

    args = shardtune.SFTConfig(output_dir=str(tmp_path / "ours"))
    trainer = shardtune.SFTTrainer(model=str(tiny_model), args=args, train_dataset=ROWS)
    metrics = {"train_loss": 1.2345678, "epoch": 2.0, "train_runtime": 12.5, "total_flos": 123456789}
    trainer.log_metrics("train", metrics)
    printed = capsys.readouterr().out.splitlines()
    assert printed[0] == "***** train metrics *****"  # Trainer's format: runtimes as h:mm:ss, FLOs in GF
    rows = {line.split("=")[0].strip(): line.split("=")[1].strip() for line in printed[1:]}
    assert rows == {"epoch": "2.0", "total_flos": "0GF", "train_loss": "1.2346", "train_runtime": "0:00:12.50"}
    trainer.save_metrics("train", metrics)
    trainer.save_metrics("eval", {"eval_loss": 0.5})
    ours = {p.name: json.loads(p.read_text()) for p in trainer.output_dir.glob("*.json")}

    theirs_args = dataclasses.replace(args, output_dir=str(tmp_path / "theirs"))

    class Oracle:  # what save_metrics reads of a Trainer
        args = theirs_args

        def is_world_process_zero(self):
            return True

    pathlib.Path(Oracle.args.output_dir).mkdir()
    save_metrics(Oracle(), "train", metrics)
    save_metrics(Oracle(), "eval", {"eval_loss": 0.5})
    theirs = {p.name: json.loads(p.read_text()) for p in pathlib.Path(Oracle.args.output_dir).glob("*.json")}
    assert ours == theirs and set(ours) == {"train_results.json", "eval_results.json", "all_results.json"}
    trainer.save_state()
    assert TrainerState.load_from_json(str(trainer.output_dir / "trainer_state.json")).global_step == 0

    class One(TrainerCallback):
        pass

    trainer.add_callback(One)
    assert isinstance(trainer.callbacks[-1], One) and trainer.pop_callback(One) is not None
    trainer.add_callback(One())
    trainer.remove_callback(One)
    assert trainer.callbacks == [] and trainer.is_world_process_zero()
    with pytest.raises(ConfigError, match="push_to_hub\\(\\): nothing trained yet"):
        trainer.push_to_hub()
    assert trainer.hub_model_id == "ours"  # output_dir's folder name, as Trainer's


def test_the_model_card_says_what_was_trained(tiny_model, tmp_path):
    from peft import LoraConfig

    trainer = shardtune.SFTTrainer(
        model=str(tiny_model),
        args=shardtune.SFTConfig(output_dir=str(tmp_path / "card")),
        train_dataset=ROWS,
        peft_config=LoraConfig(r=4, lora_alpha=8),
    )
    trainer.output_dir.mkdir()
    trainer.state.log_history = [{"loss": 2.5, "step": 3}, {"eval_loss": 2.25, "step": 3}]
    trainer.create_model_card(dataset_name="org/data", tags=["mine"])
    card = (trainer.output_dir / "README.md").read_text()
    header = card.split("---")[1]
    assert "library_name: peft" in header and "- org/data" in header and "- mine" in header
    assert f"base_model: {tiny_model}" in header and "AutoPeftModelForCausalLM" in card
    assert "training loss at step 3: 2.5000" in card and "evaluation loss at step 3: 2.2500" in card
