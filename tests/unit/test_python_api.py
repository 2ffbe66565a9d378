"""The Python face's inputs, without a launch (the runs: tests/e2e/test_python_scripts.py): TRL's config objects and
ours mean the same canonical config; what cannot be honoured is refused in one line when the trainer or config is
made; a script's objects (datasets, tokenizer, PEFT config) become the command line's inputs."""

from __future__ import annotations

import pytest
from datasets import Dataset

from shardtune import DPOConfig, SFTConfig, SFTTrainer
from shardtune.api.inputs import dataset_settings
from shardtune.config.flags import to_yaml
from shardtune.config.schema import ConfigError

ROWS = [{"prompt": f"say {i}", "completion": f" {i}"} for i in range(6)]


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDTUNE_CACHE", str(tmp_path / "cache"))


def canonical(trainer: SFTTrainer) -> str:
    text = to_yaml(trainer.config)
    return "\n".join(line for line in text.splitlines() if "dataset_name" not in line)


def test_trls_own_sftconfig_object_means_what_ours_means(tiny_model, tmp_path):
    import trl

    fields = dict(
        output_dir=str(tmp_path / "out"),
        learning_rate=3e-4,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=3,
        num_train_epochs=2,
        lr_scheduler_type="cosine",
        warmup_steps=0.1,
        logging_steps=5,
        save_steps=20,
        max_length=256,
        seed=7,
    )
    theirs = SFTTrainer(model=str(tiny_model), args=trl.SFTConfig(use_cpu=True, **fields), train_dataset=ROWS)
    ours = SFTTrainer(model=str(tiny_model), args=SFTConfig(use_cpu=True, **fields), train_dataset=ROWS)
    assert canonical(theirs) == canonical(ours)
    cfg = ours.config
    assert (cfg.optim.lr, cfg.train.batch_size, cfg.train.gradient_accumulation_steps, cfg.train.num_epochs) == (
        3e-4,
        2,
        3,
        2,
    )
    assert (cfg.optim.lr_scheduler, cfg.data.context_length, cfg.checkpoint.save_steps) == ("cosine", 256, 20)
    # what the fields leave out is TRL's: max_grad_norm 1, padding, gradient checkpointing
    assert cfg.optim.max_grad_norm == 1.0 and cfg.data.batching == "padding" and cfg.parallel.activation_checkpointing
    default = SFTTrainer(model=str(tiny_model), train_dataset=ROWS).config  # no args: TRL's <model>-SFT
    assert default.output.dir == f"{tiny_model.name}-SFT" and default.optim.lr == 2e-5 and default.train.num_epochs == 3


def test_a_config_refuses_at_once_in_one_line(tiny_model):
    from shardtune.api.configs import fields_of

    with pytest.raises(TypeError, match="learnin_rate"):  # a dataclass: an unknown field is TRL's TypeError
        SFTConfig(learnin_rate=1e-4)
    with pytest.raises(ConfigError, match="--loss_type dft") as error:
        SFTConfig(loss_type="dft")
    assert "\n" not in str(error.value)
    args = SFTConfig(learning_rate=1e-4)
    # bf16 reads as given (TRL's None becomes true): shardtune's meaning, bf16 where the device has it
    assert fields_of(args) == {"output_dir": "trainer_output", "learning_rate": 1e-4, "bf16": True}
    args.lr_scheduler_type = "inverse_sqrt"  # a field set after construction: refused when the trainer is made
    with pytest.raises(ConfigError, match="--lr_scheduler_type inverse_sqrt is not built"):
        SFTTrainer(model=str(tiny_model), args=args, train_dataset=ROWS)
    args.lr_scheduler_type = "cosine"
    args.num_train_epochs = 2
    trainer = SFTTrainer(model=str(tiny_model), args=args, train_dataset=ROWS)
    assert (trainer.config.optim.lr_scheduler, trainer.config.train.num_epochs) == ("cosine", 2)
    assert args.output_dir == "trainer_output" and args.eval_strategy == "no"  # unset fields read TRL's defaults
    assert DPOConfig(beta=0.3).canonical().dpo.beta == 0.3
    with pytest.raises(ConfigError, match="--beta is a flag of shardtune dpo"):
        from shardtune.training.engine.objective import check_objective

        check_objective(SFTConfig().canonical([("beta", 0.3)]), 1)


def test_trainer_arguments_shardtune_cannot_honour_are_refused(tiny_model):
    import torch

    from shardtune.model.loading import load_model

    cases = [
        (dict(callbacks=[object()]), "callbacks: a object is not a transformers TrainerCallback"),
        (dict(data_collator=len), "data_collator: not taken"),
    ]
    for extra, named in cases:
        with pytest.raises(ConfigError, match=named):
            SFTTrainer(model=str(tiny_model), train_dataset=ROWS, **extra)
    model = load_model(str(tiny_model), dtype=torch.float32)
    with torch.no_grad():
        model.lm_head.weight.mul_(0.5)  # a model changed in the script: its weights as they are now are trained
    saved = SFTTrainer(model=model, train_dataset=ROWS).config.model.name
    again = SFTTrainer(model=model, train_dataset=ROWS).config.model.name
    assert saved == again  # content-addressed: every rank's copy is one folder
    reloaded = load_model(saved, dtype=torch.float32)
    assert torch.equal(reloaded.lm_head.weight, model.lm_head.weight)
    with pytest.raises(ConfigError, match="model: a int is not a transformers model"):
        SFTTrainer(model=3, train_dataset=ROWS)
    with pytest.raises(ConfigError, match="train_dataset is None"):
        SFTTrainer(model=str(tiny_model))


def test_peft_configs_become_adapter_settings(tiny_model):
    from peft import AdaptionPromptConfig, LoraConfig, PrefixTuningConfig

    lora = SFTTrainer(
        model=str(tiny_model),
        train_dataset=ROWS,
        peft_config=LoraConfig(r=4, lora_alpha=8, lora_dropout=0.1, target_modules={"v_proj", "q_proj"}, use_dora=True),
    ).config.peft
    assert (lora.method, lora.lora.r, lora.lora.alpha, lora.lora.dropout, lora.lora.use_dora) == (
        "lora",
        4,
        8,
        0.1,
        True,
    )
    assert lora.lora.target_modules == ["q_proj", "v_proj"]
    prefix = SFTTrainer(
        model=str(tiny_model), train_dataset=ROWS, peft_config=PrefixTuningConfig(num_virtual_tokens=7)
    ).config.peft
    assert (prefix.method, prefix.prefix.num_virtual_tokens) == ("prefix", 7)
    adapter = SFTTrainer(
        model=str(tiny_model), train_dataset=ROWS, peft_config=AdaptionPromptConfig(adapter_len=4, adapter_layers=1)
    ).config.peft
    assert (adapter.method, adapter.llama_adapter.adapter_len, adapter.llama_adapter.adapter_layers) == (
        "llama_adapter",
        4,
        1,
    )
    for config, named in [
        (LoraConfig(layers_to_transform=[0]), "peft_config.layers_to_transform"),
        (LoraConfig(target_modules=".*proj"), "regular expression"),
        (LoraConfig(task_type="SEQ_CLS"), "task_type SEQ_CLS"),
    ]:
        with pytest.raises(ConfigError, match=named):
            SFTTrainer(model=str(tiny_model), train_dataset=ROWS, peft_config=config)


def test_in_memory_data_is_one_content_addressed_folder_whatever_its_container():
    from datasets import DatasetDict, IterableDataset

    as_list = dict(dataset_settings(ROWS, None))["dataset_name"]
    as_dataset = dict(dataset_settings(Dataset.from_list(ROWS), None))["dataset_name"]
    as_dict = dict(dataset_settings(DatasetDict(train=Dataset.from_list(ROWS)), None))["dataset_name"]
    assert as_list == as_dataset == as_dict  # the same rows: the same files, so one tokenisation for every rank
    with_eval = dict(dataset_settings(ROWS, ROWS[:2]))["dataset_name"]
    assert with_eval != as_list
    streamed = dict(dataset_settings(IterableDataset.from_generator(lambda: iter(ROWS)), ROWS[:2]))
    assert streamed["dataset_streaming"] is True  # streamed in the process, as TRL takes an IterableDataset
    with pytest.raises(ConfigError, match="eval_dataset: an IterableDataset beside"):
        dataset_settings(ROWS, IterableDataset.from_generator(lambda: iter(ROWS)))
    with pytest.raises(ConfigError, match="eval_dataset: a mapping of 2 datasets"):
        dataset_settings(ROWS, {"a": ROWS, "b": ROWS})


def test_train_refuses_what_the_command_line_refuses_as_an_exception(tiny_model, tmp_path):
    """A run into an output_dir that a live run holds: the command line's one line, raised where the script calls
    train() (nothing is launched, nothing of the live run moves; an ended run there would move into previous/)."""
    from shardtune.runtime.run_lock import RunLock

    out = tmp_path / "out"
    out.mkdir()
    (out / "metrics.jsonl").write_text("{}\n")
    live = RunLock(out)
    live.acquire()
    try:
        trainer = SFTTrainer(model=str(tiny_model), args=SFTConfig(output_dir=str(out)), train_dataset=ROWS * 2)
        with pytest.raises(ConfigError, match="another run") as error:
            trainer.train()
        assert "\n" not in str(error.value)
    finally:
        live.release()
    assert (out / "metrics.jsonl").read_text() == "{}\n" and not (out / "previous").exists()


def test_dpo_trainer_takes_preference_rows_with_dpos_defaults(tiny_model):
    from shardtune import DPOTrainer

    pairs = [{"prompt": f"pick {i}", "chosen": f" {i}", "rejected": f" {i + 1}"} for i in range(4)]
    cfg = DPOTrainer(
        model=str(tiny_model), args=DPOConfig(beta=0.2, loss_type=["sigmoid", "sft"]), train_dataset=pairs
    ).config
    assert (cfg.objective, cfg.optim.lr, cfg.dpo.beta, cfg.dpo.loss_type) == ("dpo", 1e-6, 0.2, ["sigmoid", "sft"])
    with pytest.raises(ConfigError, match="ref_model: a object is not a transformers model"):
        DPOTrainer(model=str(tiny_model), ref_model=object(), train_dataset=pairs)
    with_ref = DPOTrainer(model=str(tiny_model), ref_model=str(tiny_model), train_dataset=pairs).config
    assert with_ref.dpo.ref_model == str(tiny_model)


def test_shardtune_run_splits_launcher_flags_script_and_its_arguments(tmp_path):
    from shardtune.commands.run import split

    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    assert split(["--nproc_per_node", "2", "--standalone", str(script), "--lr", "3", "x"]) == (
        {"nproc_per_node": "2", "standalone": None},
        str(script),
        ["--lr", "3", "x"],
    )
    assert split(["--num_processes=4", str(script)])[0] == {"nproc_per_node": "4"}  # Accelerate's name
    for argv, named in [
        (["--learning_rate", "1", str(script)], "--learning_rate is not a launcher flag"),
        (["--nproc_per_node", "2"], "no script given"),
        ([str(tmp_path / "nope.py")], "no such Python script"),
    ]:
        with pytest.raises(ConfigError, match=named):
            split(argv)


def test_under_accelerate_launch_the_strategy_is_what_its_file_set(tiny_model, monkeypatch):
    """accelerate launch --config_file fsdp2.yaml train.py exports the file's keys to the script's processes."""
    from shardtune.config.dialects.accelerate import environment_settings

    fsdp = {
        "ACCELERATE_USE_FSDP": "true",
        "FSDP_VERSION": "2",
        "FSDP_RESHARD_AFTER_FORWARD": "false",
        "FSDP_OFFLOAD_PARAMS": "false",
        "FSDP_AUTO_WRAP_POLICY": "TRANSFORMER_BASED_WRAP",
        "FSDP_STATE_DICT_TYPE": "SHARDED_STATE_DICT",
        "ACCELERATE_MIXED_PRECISION": "no",
    }
    for key, value in fsdp.items():
        monkeypatch.setenv(key, value)
    parallel = SFTTrainer(model=str(tiny_model), train_dataset=ROWS).config.parallel
    assert (parallel.strategy, parallel.sharding_strategy, parallel.cpu_offload) == ("fsdp", "SHARD_GRAD_OP", False)
    zero3 = {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "3"}
    assert dict(environment_settings(zero3)) == {"parallel.strategy": "deepspeed", "parallel.zero_stage": 3}
    assert environment_settings({"ACCELERATE_MIXED_PRECISION": "no"}) == []  # nothing said: the script decides
    with pytest.raises(ConfigError, match="fsdp_auto_wrap_policy 'SIZE_BASED_WRAP'"):
        environment_settings({"ACCELERATE_USE_FSDP": "true", "FSDP_AUTO_WRAP_POLICY": "SIZE_BASED_WRAP"})


def test_every_constructor_argument_of_trls_trainers_is_ours_too():
    """Each argument of TRL 1.16's SFTTrainer / DPOTrainer / GRPOTrainer is a parameter here, in the same order:
    honoured, or refused in one line naming it when given (the refusals: each trainer's ``refusals``)."""
    import inspect

    import trl

    from shardtune import DPOTrainer, GRPOTrainer

    for theirs, ours in ((trl.SFTTrainer, SFTTrainer), (trl.DPOTrainer, DPOTrainer), (trl.GRPOTrainer, GRPOTrainer)):
        names = list(inspect.signature(theirs.__init__).parameters)
        assert names == list(inspect.signature(ours.__init__).parameters)
        honoured = {"self", "model", "args", "train_dataset", "eval_dataset", "processing_class", "peft_config"}
        honoured |= {"callbacks", "formatting_func", "ref_model", "reward_funcs", "quantization_config", "tools"}
        honoured |= {"compute_metrics", "preprocess_logits_for_metrics"}
        assert set(names) - honoured <= set(ours.refusals), set(names) - honoured - set(ours.refusals)


def test_formatting_func_turns_each_row_into_its_text_as_in_trl():
    from datasets import load_dataset

    folder = dict(dataset_settings(ROWS, None, lambda row: f"Q: {row['prompt']} A:{row['completion']}"))["dataset_name"]
    train = load_dataset("parquet", data_files=f"{folder}/train.parquet", split="train")
    assert train.column_names == ["text"] and train[0]["text"] == "Q: say 0 A: 0"
    with pytest.raises(ConfigError, match="formatting_func returned a int"):
        dataset_settings(ROWS, None, lambda row: 3)


PROMPTS = [{"prompt": f"count from {i}:", "target": str(i + 1)} for i in range(8)]


def shorter(completions, **kwargs):
    return [-len(c) for c in completions]


def test_grpo_trainer_takes_trls_grpo_fields_and_the_scripts_reward_functions(tiny_model, tmp_path):
    """GRPOConfig's names as shardtune grpo's settings (TRL's GRPOConfig object alike, the generation batch it derives
    left to the run); callables are kept in this process under the names --reward_funcs carries, strings as the
    command line takes them, in the script's order."""
    import trl

    from shardtune import GRPOConfig, GRPOTrainer
    from shardtune.training.objectives.grpo.rewards import resolve

    fields = dict(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=8,
        beta=0.04,
        epsilon_high=0.28,
        loss_type="grpo",
        scale_rewards="batch",
        reward_weights=[1.0, 0.5],
    )
    rewards_file = tmp_path / "rewards.py"
    rewards_file.write_text("def longer(completions, **kwargs):\n    return [len(c) for c in completions]\n")
    funcs = [shorter, f"{rewards_file}:longer"]
    ours = GRPOTrainer(
        model=str(tiny_model), reward_funcs=funcs, args=GRPOConfig(use_cpu=True, **fields), train_dataset=PROMPTS
    )
    theirs = GRPOTrainer(
        model=str(tiny_model), reward_funcs=funcs, args=trl.GRPOConfig(use_cpu=True, **fields), train_dataset=PROMPTS
    )
    assert canonical(theirs) == canonical(ours)
    g = ours.config.grpo
    assert (ours.config.objective, g.num_generations, g.max_completion_length, g.beta) == ("grpo", 4, 8, 0.04)
    assert (g.epsilon_high, g.loss_type, g.scale_rewards, g.reward_weights) == (0.28, "grpo", "batch", [1.0, 0.5])
    assert (g.steps_per_generation, g.generation_batch_size) == (0, 0)  # derived by the run, as TRL derives them
    assert ours.config.optim.lr == 1e-6  # TRL's GRPO default
    script_func, from_file = g.reward_funcs
    assert from_file == f"{rewards_file}:longer"
    assert resolve(script_func, load_models=False).func is shorter and resolve(from_file, False).name == "longer"
    one = GRPOTrainer(model=str(tiny_model), reward_funcs=shorter, train_dataset=PROMPTS).config.grpo
    assert len(one.reward_funcs) == 1 and one.reward_funcs[0].endswith("shorter>")


def test_grpo_trainer_refuses_what_it_cannot_honour_in_one_line(tiny_model):
    from datasets import IterableDataset

    from shardtune import GRPOTrainer
    from shardtune.model.loading import load_model

    model_object = load_model(str(tiny_model))
    cases = [
        (
            dict(reward_funcs=model_object),
            "reward_funcs: a LlamaForCausalLM object is not taken: pass the reward model",
        ),
        (dict(reward_funcs=None), "reward_funcs is None"),
        (dict(reward_funcs=[]), "reward_funcs is empty"),
        (dict(reward_funcs=[3]), "reward_funcs: a int is not a reward function"),
        (dict(reward_processing_classes=object()), "reward_processing_classes: not taken"),
        (dict(tools=[3]), "tools: 3 is not callable: pass Python functions"),
        (dict(rollout_func=len), "rollout_func: not taken"),
        (dict(optimizers=(object(), None)), "optimizers: not taken"),
        (
            dict(train_dataset=IterableDataset.from_generator(lambda: iter(PROMPTS))),
            "train_dataset: an IterableDataset is not streamed for GRPO",
        ),
    ]
    for extra, named in cases:
        arguments = {"model": str(tiny_model), "reward_funcs": shorter, "train_dataset": PROMPTS, **extra}
        with pytest.raises(ConfigError, match=named) as error:
            GRPOTrainer(**arguments)
        assert "\n" not in str(error.value)
    with pytest.raises(ConfigError, match="--use_vllm"):
        from shardtune import GRPOConfig

        GRPOConfig(use_vllm=True)
