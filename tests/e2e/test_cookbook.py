"""What a llama-cookbook or TRL user brings works: every train_config flag of the cookbook, the multi-GPU lesson's
commands as written (scaled to CPU: 2 processes, the tiny preset, 2 steps, the lesson's flags kept, finetuning.py
replaced by `shardtune sft`), and Accelerate config files as TRL's guide launches with.

Four launches carry the lesson's commands; everything that needs no process group is checked in this process.
"""

from __future__ import annotations

import csv
import json
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from shardtune.config.flags import parse_args
from shardtune.config.schema import ConfigError
from shardtune.training.engine.checks import validate
from tests.conftest import cli_env, shardtune_argv
from tests.helpers import step_rows

# llama-cookbook's train_config and fsdp_config fields (src/llama_cookbook/configs/training.py and fsdp.py), each
# with a value a user might pass. Every one must be a known flag.
COOKBOOK_TRAIN_CONFIG = {
    "model_name": "m",
    "tokenizer_name": "t",
    "enable_fsdp": "true",
    "low_cpu_fsdp": "true",
    "run_validation": "true",
    "batch_size_training": "4",
    "batching_strategy": "packing",
    "context_length": "4096",
    "gradient_accumulation_steps": "1",
    "gradient_clipping": "false",
    "gradient_clipping_threshold": "1.0",
    "num_epochs": "3",
    "max_train_step": "0",
    "max_eval_step": "0",
    "num_workers_dataloader": "1",
    "lr": "1e-4",
    "weight_decay": "0.0",
    "gamma": "0.85",
    "seed": "42",
    "use_fp16": "false",
    "mixed_precision": "true",
    "val_batch_size": "1",
    "dataset": "samsum_dataset",
    "peft_method": "lora",
    "use_peft": "false",
    "from_peft_checkpoint": "",
    "output_dir": "out",
    "freeze_layers": "false",
    "num_freeze_layers": "1",
    "freeze_LLM_only": "false",
    "quantization": "4bit",
    "one_gpu": "false",
    "save_model": "true",
    "dist_checkpoint_root_folder": "model_checkpoints",
    "dist_checkpoint_folder": "fine-tuned",
    "save_optimizer": "false",
    "use_fast_kernels": "false",
    "use_wandb": "false",
    "save_metrics": "false",
    "flop_counter": "false",
    "flop_counter_start": "3",
    "use_profiler": "false",
    "profiler_dir": "prof",
    "enable_activation_checkpointing": "false",
    "activation_checkpointing_use_reentrant": "false",
    "enable_memory_monitoring": "false",
    "memory_monitoring_interval": "100",
}
COOKBOOK_FSDP_CONFIG = {
    "fsdp_config.mixed_precision": "true",
    "fsdp_config.use_fp16": "false",
    "fsdp_config.sharding_strategy": "FULL_SHARD",
    "fsdp_config.hsdp": "false",
    "fsdp_config.sharding_group_size": "0",
    "fsdp_config.replica_group_size": "0",
    "fsdp_config.checkpoint_type": "SHARDED_STATE_DICT",
    "fsdp_config.fsdp_activation_checkpointing": "true",
    "fsdp_config.fsdp_cpu_offload": "false",
    "fsdp_config.pure_bf16": "false",
    "fsdp_config.optimizer": "AdamW",
    "wandb_config.project": "p",
    "wandb_config.entity": "e",
    "wandb_config.job_type": "train",
    "wandb_config.tags": "a,b",
    "wandb_config.group": "g",
    "wandb_config.notes": "n",
    "wandb_config.mode": "offline",
}
# The tracker, profiler and FLOP-counter flags are built by the observability issue (another branch): until it is
# merged these, and only these, are unknown here (test_observability_flags_are_accepted fails for them).
OBSERVABILITY_FLAGS = frozenset(
    {
        "use_wandb",
        "flop_counter",
        "flop_counter_start",
        "use_profiler",
        "profiler_dir",
        "wandb_config.project",
        "wandb_config.entity",
        "wandb_config.job_type",
        "wandb_config.tags",
        "wandb_config.group",
        "wandb_config.notes",
        "wandb_config.mode",
    }
)
COOKBOOK_FLAGS = {**COOKBOOK_TRAIN_CONFIG, **COOKBOOK_FSDP_CONFIG}

STEPS = ("--max_train_step", 2, "--num_workers_dataloader", 0, "--context_length", 256, "--val_batch_size", 4)


def unknown(flag: str, value: str) -> bool:
    try:
        parse_args([f"--{flag}", value])
    except ConfigError as e:
        return str(e).startswith("unknown flag")
    return False


def test_every_cookbook_flag_is_accepted():
    rejected = [f for f, v in COOKBOOK_FLAGS.items() if f not in OBSERVABILITY_FLAGS and unknown(f, v)]
    assert rejected == []
    assert unknown("not_a_cookbook_flag", "1")  # control: an unknown flag is detected


@pytest.mark.parametrize("flag", sorted(OBSERVABILITY_FLAGS))
def test_observability_flags_are_accepted(flag):
    assert not unknown(flag, COOKBOOK_FLAGS[flag])


def test_cookbook_spellings_mean_what_they_mean_there():
    cfg = parse_args(
        [
            "--quantization",
            "int4",
            "--save_model",
            "--hsdp",
            "--sharding_group_size",
            "1",
            "--replica_group_size",
            "2",
            "--enable_activation_checkpointing",
            "true",
        ]
    )
    assert cfg.model.quantization == "4bit" and cfg.output.save_model
    assert parse_args(["--quantization", "int8"]).model.quantization == "8bit"
    p = cfg.parallel  # fsdp_config's keys, without their prefix too; hsdp selects hybrid sharding
    assert (p.sharding_strategy, p.sharding_group_size, p.replica_group_size) == ("HYBRID_SHARD", 1, 2)
    assert p.activation_checkpointing
    assert parse_args(["--fsdp_config.optimizer", "AdamW"]) == parse_args([])  # the one optimizer: nothing to set
    # the cookbook's two-flag knobs are one setting each, whatever the order
    both = [
        "--enable_fsdp",
        "--use_peft",
        "--peft_method",
        "prefix",
        "--use_fp16",
        "false",
        "--mixed_precision",
        "false",
        "--freeze_layers",
        "false",
        "--num_freeze_layers",
        "2",
    ]
    cfg = parse_args(both)
    assert (cfg.parallel.strategy, cfg.peft.method, cfg.train.precision, cfg.model.freeze_layers) == (
        "fsdp",
        "prefix",
        "fp32",
        0,
    )
    assert parse_args(["--peft_method", "prefix", "--use_peft", "--enable_fsdp", *both[4:]]).peft.method == "prefix"
    assert parse_args(["--use_peft", "--enable_fsdp", *both[4:]]).peft.method == "lora"  # the cookbook's default
    assert parse_args(["--num_freeze_layers", "2", "--freeze_layers"]).model.freeze_layers == 2


@pytest.mark.parametrize(
    "flags,world_size,message",
    [
        (["--fsdp_config.optimizer", "anyprecision"], 1, "--fsdp_config.optimizer anyprecision"),
        (["--enable_fsdp", "--enable_deepspeed"], 1, "--enable_fsdp and --enable_deepspeed are both set"),
        (["--one_gpu"], 2, "--one_gpu trains in one process"),
        (["--freeze_layers", "--use_peft"], 1, "--freeze_layers applies to full fine-tuning"),
        (["--activation_checkpointing_use_reentrant", "true"], 1, "--activation_checkpointing_use_reentrant"),
        (["--hsdp", "--enable_fsdp", "--fsdp_config.sharding_strategy", "NO_SHARD"], 2, "--fsdp_config.hsdp true"),
    ],
)
def test_flags_that_cannot_apply_are_refused_in_one_line(flags, world_size, message, tmp_path):
    with pytest.raises(ConfigError) as error:
        validate(parse_args([*flags, "--output_dir", str(tmp_path / "out")]), world_size)
    assert str(error.value).startswith(message) and "\n" not in str(error.value)


def test_freeze_llm_only_is_refused_on_a_text_model_and_freeze_layers_fit_the_model(tiny_model):
    """--freeze_LLM_only is the cookbook's vision flag (tests/unit/test_vision_freezing.py): on a text model, refused
    in one line before launch."""
    from shardtune.model.freezing import check_freeze_layers, check_vision_freezing

    with pytest.raises(ConfigError, match="--freeze_LLM_only applies to vision-language models"):
        check_vision_freezing(parse_args(["--freeze_LLM_only", "--model_name", str(tiny_model)]))
    check_vision_freezing(parse_args(["--freeze_LLM_only", "false", "--model_name", str(tiny_model)]))
    with pytest.raises(ConfigError, match="--num_freeze_layers 3 exceeds the 2 decoder layers"):
        check_freeze_layers(
            parse_args(["--freeze_layers", "--num_freeze_layers", "3", "--model_name", str(tiny_model)])
        )


def test_prefix_tuning_on_a_packed_row_equals_each_example_alone(tiny_model):
    """Each packed example attends to its own prefix copy and causally to itself: the logits of the row are those of
    every example run alone with the prefix (peft's padded path). Control: without boundaries they differ."""
    import peft

    from shardtune.model.attention import use_varlen_attention, varlen_kwargs
    from shardtune.model.loading import load_model

    model = load_model(str(tiny_model))
    use_varlen_attention(model)
    model = peft.get_peft_model(model, peft.PrefixTuningConfig(num_virtual_tokens=5, task_type="CAUSAL_LM")).eval()
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.normal_()
    lengths = [7, 4, 9]
    examples = [torch.randint(5, 1000, (n,)) for n in lengths]
    with torch.no_grad():
        alone = torch.cat(
            [
                model(input_ids=x[None], attention_mask=torch.ones(1, len(x), dtype=torch.long)).logits[0]
                for x in examples
            ]
        )
        row, positions = torch.cat(examples)[None], torch.cat([torch.arange(n) for n in lengths])[None]
        bounds = torch.tensor([0, 7, 11, 20], dtype=torch.int32)
        packed = model(
            input_ids=row, position_ids=positions, **varlen_kwargs({"cu_seq_lens": bounds, "max_length": 9})
        ).logits[0]
        one_sequence = model(input_ids=row).logits[0]
    assert (packed - alone).abs().max() < 1e-5
    assert (one_sequence - alone).abs().max() > 1e-2


# -- datasets ---------------------------------------------------------------------------------------------------


def write_grammar_csvs(folder: Path) -> tuple[Path, Path]:
    rows = [
        ("she go to school yesterday", "She went to school yesterday."),
        ("them is happy about it", "They are happy about it."),
        ("he have two cat", "He has two cats."),
        ("we was late for the bus", "We were late for the bus."),
    ]
    paths = folder / "gtrain_10k.csv", folder / "grammar_validation.csv"
    for path, repeat in zip(paths, (8, 1)):
        with path.open("w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["input", "target"])
            writer.writerows(rows * repeat)
    return paths


def test_grammar_dataset_prompts_like_the_cookbook_and_learns_the_target_only(tiny_model, tmp_path):
    from shardtune.data import load_examples
    from shardtune.model.loading import load_tokenizer

    train, validation = write_grammar_csvs(tmp_path)
    cfg = parse_args(
        [
            "--dataset",
            "grammar_dataset",
            "--grammar_dataset.train_split",
            str(train),
            "--grammar_dataset.test_split",
            str(validation),
        ]
    )
    tokenizer = load_tokenizer(str(tiny_model))
    examples, _ = load_examples(cfg, tokenizer, "train")
    first = examples[0]
    prompt = "Correct this to standard English: she go to school yesterday\n---\nCorrected: "
    learned = [t for t, label in zip(first["input_ids"], first["labels"]) if label != -100]
    assert tokenizer.decode(first["input_ids"][1:]).startswith(prompt)
    assert tokenizer.decode(learned) == "She went to school yesterday." + tokenizer.eos_token
    assert len(load_examples(cfg, tokenizer, "validation")[0]) == 4


# -- Accelerate config files, written with the keys of TRL's examples/accelerate_configs/ --------------------------

COMMON = {
    "compute_environment": "LOCAL_MACHINE",
    "debug": False,
    "downcast_bf16": "no",
    "machine_rank": 0,
    "main_training_function": "main",
    "num_machines": 1,
    "num_processes": 2,
    "rdzv_backend": "static",
    "same_network": True,
    "tpu_env": [],
    "tpu_use_cluster": False,
    "tpu_use_sudo": False,
    "use_cpu": False,
}
ACCELERATE_FILES = {
    "multi_gpu": {**COMMON, "distributed_type": "MULTI_GPU", "gpu_ids": "all", "mixed_precision": "no"},
    "deepspeed_zero1": {
        **COMMON,
        "distributed_type": "DEEPSPEED",
        "mixed_precision": "bf16",
        "deepspeed_config": {
            "deepspeed_multinode_launcher": "standard",
            "gradient_accumulation_steps": 1,
            "zero3_init_flag": False,
            "zero_stage": 1,
        },
    },
    "deepspeed_zero2": {
        **COMMON,
        "distributed_type": "DEEPSPEED",
        "mixed_precision": "bf16",
        "deepspeed_config": {
            "deepspeed_multinode_launcher": "standard",
            "offload_optimizer_device": "cpu",
            "offload_param_device": "none",
            "zero3_init_flag": False,
            "zero_stage": 2,
        },
    },
    "deepspeed_zero3": {
        **COMMON,
        "distributed_type": "DEEPSPEED",
        "mixed_precision": "fp16",
        "deepspeed_config": {
            "deepspeed_multinode_launcher": "standard",
            "offload_optimizer_device": "none",
            "offload_param_device": "cpu",
            "zero3_init_flag": True,
            "zero3_save_16bit_model": True,
            "zero_stage": 3,
        },
    },
    "fsdp1": {
        **COMMON,
        "distributed_type": "FSDP",
        "mixed_precision": "bf16",
        "fsdp_config": {
            "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
            "fsdp_backward_prefetch": "BACKWARD_PRE",
            "fsdp_cpu_ram_efficient_loading": True,
            "fsdp_forward_prefetch": False,
            "fsdp_offload_params": True,
            "fsdp_sharding_strategy": "SHARD_GRAD_OP",
            "fsdp_state_dict_type": "SHARDED_STATE_DICT",
            "fsdp_sync_module_states": True,
            "fsdp_use_orig_params": False,
        },
    },
    "fsdp2": {
        **COMMON,
        "distributed_type": "FSDP",
        "enable_cpu_affinity": False,
        "mixed_precision": "bf16",
        "fsdp_config": {
            "fsdp_activation_checkpointing": True,
            "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
            "fsdp_cpu_ram_efficient_loading": True,
            "fsdp_offload_params": False,
            "fsdp_reshard_after_forward": True,
            "fsdp_state_dict_type": "SHARDED_STATE_DICT",
            "fsdp_version": 2,
        },
    },
}
# (attribute path, expected value) per file
EXPECTED = {
    "multi_gpu": {"parallel.strategy": "ddp", "train.precision": "fp32"},
    "deepspeed_zero1": {"parallel.strategy": "deepspeed", "parallel.zero_stage": 1, "train.precision": "auto"},
    "deepspeed_zero2": {"parallel.zero_stage": 2, "parallel.offload_optimizer": True, "parallel.offload_param": False},
    "deepspeed_zero3": {"parallel.zero_stage": 3, "parallel.offload_param": True, "train.precision": "fp16"},
    "fsdp1": {
        "parallel.strategy": "fsdp",
        "parallel.sharding_strategy": "SHARD_GRAD_OP",
        "parallel.low_cpu_fsdp": True,
        "parallel.cpu_offload": True,
        "checkpoint.checkpoint_type": "SHARDED_STATE_DICT",
    },
    "fsdp2": {
        "parallel.strategy": "fsdp",
        "parallel.activation_checkpointing": True,
        "parallel.low_cpu_fsdp": True,
        "parallel.sharding_strategy": "FULL_SHARD",
    },
}


def write_accelerate_file(folder: Path, name: str, content: dict) -> Path:
    import yaml

    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(content))
    return path


def attribute(cfg, dotted: str):
    for part in dotted.split("."):
        cfg = getattr(cfg, part)
    return cfg


@pytest.mark.parametrize("name", list(ACCELERATE_FILES))
def test_accelerate_config_files_map_onto_shardtune_flags(name, tmp_path):
    from shardtune.config.argv import split_argv
    from shardtune.config.dialects.accelerate import read_accelerate
    from shardtune.config.flags import build_config

    path = write_accelerate_file(tmp_path, name, ACCELERATE_FILES[name])
    args = split_argv(["--accelerate_config", str(path), "--lr", "3e-4"])
    launch, train = read_accelerate(args.accelerate)
    assert launch == {"nproc_per_node": "2"} and args.training == [("lr", "3e-4")]
    cfg = build_config(args.training, accelerate=train)
    assert {k: attribute(cfg, k) for k in EXPECTED[name]} == EXPECTED[name]
    assert cfg.optim.lr == 3e-4


def test_accelerate_keys_that_cannot_be_mapped_are_named_in_one_line(tmp_path):
    from shardtune.config.dialects.accelerate import read_accelerate

    for key, value, named in [
        ("mixed_precision", "fp8", "mixed_precision 'fp8'"),
        (
            "fsdp_config",
            {"fsdp_auto_wrap_policy": "SIZE_BASED_WRAP"},
            "fsdp_config.fsdp_auto_wrap_policy 'SIZE_BASED_WRAP'",
        ),
        ("deepspeed_config", {"offload_param_device": "nvme"}, "deepspeed_config.offload_param_device 'nvme'"),
    ]:
        path = write_accelerate_file(tmp_path, key, {**ACCELERATE_FILES["multi_gpu"], key: value})
        with pytest.raises(ConfigError) as error:
            read_accelerate(str(path))
        assert named in str(error.value) and "\n" not in str(error.value)
    launch, _ = read_accelerate(
        str(
            write_accelerate_file(
                tmp_path,
                "two",
                {
                    **COMMON,
                    "num_machines": 2,
                    "num_processes": 16,
                    "machine_rank": 1,
                    "main_process_ip": "10.0.0.1",
                    "main_process_port": 29500,
                },
            )
        )
    )
    assert launch == {
        "nproc_per_node": "8",
        "nnodes": "2",
        "node_rank": "1",
        "master_addr": "10.0.0.1",
        "master_port": "29500",
    }


# -- the lesson's commands ------------------------------------------------------------------------------------------


def shardtune(cache_dir: Path, cwd: Path, *args, env: dict | None = None) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        shardtune_argv(*args),
        capture_output=True,
        text=True,
        env={**cli_env(cache_dir), **(env or {})},
        cwd=cwd,
        timeout=600,
    )
    assert proc.returncode == 0, f"{' '.join(map(str, args))}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc


def test_full_fine_tuning_low_cpu_and_slow_interconnect_commands(tiny_model, cache_dir, tmp_path):
    """The lesson's slow-interconnect command (which holds the low-CPU command's flags), with --use_fast_kernels of
    the full fine-tuning command, --freeze_layers and --save_optimizer false (the cookbook's default): hybrid
    sharding with the given groups, the checkpoint where the cookbook writes it, without optimizer state (so it
    is not resumable, and --resume says so), and `shardtune export` turning that folder into a Hugging Face model."""
    import torch.distributed.checkpoint as dcp

    proc = shardtune(
        cache_dir,
        tmp_path,
        "sft",
        "--nproc_per_node",
        2,
        "--enable_fsdp",
        "--low_cpu_fsdp",
        "--fsdp_config.pure_bf16",
        "--model_name",
        tiny_model,
        "--batch_size_training",
        1,
        "--dist_checkpoint_root_folder",
        "model_checkpoints",
        "--dist_checkpoint_folder",
        "fine-tuned",
        "--hsdp",
        "--sharding_group_size",
        1,
        "--replica_group_size",
        2,
        "--use_fast_kernels",
        "--freeze_layers",
        "--num_freeze_layers",
        1,
        "--save_optimizer",
        "false",
        "--output_dir",
        "out",
        *STEPS,
        "--synthetic_dialogues.num_train",
        16,
        "--synthetic_dialogues.num_validation",
        4,
    )
    assert "fsdp2 HYBRID_SHARD, world size 2, mesh (replicate 2 x shard 1)" in proc.stdout
    assert "low_cpu_fsdp" in proc.stdout
    folder = tmp_path / "model_checkpoints" / f"fine-tuned-{tiny_model}"
    assert (folder / "latest").read_text().strip() == "step-000002"
    saved = dcp.FileSystemReader(str(folder / "step-000002")).read_metadata().state_dict_metadata
    assert any(k.startswith("model.") for k in saved) and not any(k.startswith("optimizer.") for k in saved)
    with pytest.raises(ConfigError, match="--save_optimizer false and holds no optimizer state"):
        validate(parse_args(["--resume", str(folder), "--output_dir", str(tmp_path / "resumed")]), 2)
    shardtune(cache_dir, tmp_path, "export", folder, "exported")
    exported = load_file(tmp_path / "exported" / "model.safetensors")
    base = load_file(Path(tiny_model) / "model.safetensors")
    frozen, trained = "model.layers.0.self_attn.q_proj.weight", "model.layers.1.self_attn.q_proj.weight"
    assert torch.equal(exported[frozen].float(), base[frozen].float())  # --freeze_layers: layer 0 kept its weights
    assert not torch.equal(exported[trained].float(), base[trained].float())


def test_qlora_command_with_its_environment_and_samsum_files(tiny_model, cache_dir, tmp_path):
    """FSDP + QLoRA exactly as the lesson writes it, with its environment, on samsum files, --save_model bare:
    rank 0 alone loads and quantises, and the run equals one where every rank loads (losses, adapter)."""
    samsum = tmp_path / "samsum"
    samsum.mkdir()
    dialogues = [
        {"dialogue": f"Ann: lunch at {h}?\nBob: sure, see you at {h}", "summary": f"Lunch at {h}."}
        for h in range(1, 13)
    ]
    (samsum / "train.json").write_text(json.dumps(dialogues * 2))
    (samsum / "validation.json").write_text(json.dumps(dialogues[:4]))
    lesson = [
        "--enable_fsdp",
        "--quantization",
        "4bit",
        "--model_name",
        tiny_model,
        "--mixed_precision",
        "False",
        "--low_cpu_fsdp",
        "--use_peft",
        "--peft_method",
        "lora",
    ]
    data = [
        "--dataset",
        "samsum_dataset",
        "--samsum_dataset.data_path",
        samsum,
        "--save_model",
        *STEPS,
        "--batch_size_training",
        1,
        "--lora_config.lora_dropout",
        0,
        "--lr",
        1e-2,
    ]
    proc = shardtune(
        cache_dir,
        tmp_path,
        "sft",
        "--nproc_per_node",
        2,
        *lesson,
        "--output_dir",
        "qlora",
        *data,
        env={"FSDP_CPU_RAM_EFFICIENT_LOADING": "1", "ACCELERATE_USE_FSDP": "1"},
    )
    assert proc.stderr.count("ignoring ACCELERATE_USE_FSDP and FSDP_CPU_RAM_EFFICIENT_LOADING") == 1
    assert "low_cpu_fsdp" in proc.stdout
    every_rank = [f for f in lesson if f != "--low_cpu_fsdp"]
    shardtune(cache_dir, tmp_path, "sft", "--nproc_per_node", 2, *every_rank, "--output_dir", "reference", *data)
    rows, reference = step_rows(tmp_path / "qlora"), step_rows(tmp_path / "reference")
    assert len(rows) == 2 and [r["loss"] for r in rows] == pytest.approx([r["loss"] for r in reference], rel=1e-5)
    adapter = load_file(tmp_path / "qlora" / "adapter_model.safetensors")
    expected = load_file(tmp_path / "reference" / "adapter_model.safetensors")
    assert adapter.keys() == expected.keys()
    assert all(torch.allclose(adapter[k], expected[k], rtol=1e-5, atol=0) for k in adapter)


def test_other_datasets_command_with_prefix_tuning_on_the_grammar_dataset(tiny_model, cache_dir, tmp_path):
    """The lesson's "other datasets" command (its checkpoint folders and pure bf16 kept) with prefix tuning and the
    default (packed) batching: the adapter is written to --output_dir, its checkpoint to the cookbook's folder."""
    train, validation = write_grammar_csvs(tmp_path)
    shardtune(
        cache_dir,
        tmp_path,
        "sft",
        "--nproc_per_node",
        2,
        "--enable_fsdp",
        "--model_name",
        tiny_model,
        "--use_peft",
        "--peft_method",
        "prefix",
        "--dataset",
        "grammar_dataset",
        "--save_model",
        "--dist_checkpoint_root_folder",
        "model_checkpoints",
        "--dist_checkpoint_folder",
        "fine-tuned",
        "--fsdp_config.pure_bf16",
        "--output_dir",
        "prefix",
        "--grammar_dataset.train_split",
        train,
        "--grammar_dataset.test_split",
        validation,
        *STEPS,
        "--batch_size_training",
        1,
    )
    config = json.loads((tmp_path / "prefix" / "adapter_config.json").read_text())
    assert config["peft_type"] == "PREFIX_TUNING"
    assert all(row["loss"] > 0 for row in step_rows(tmp_path / "prefix"))
    checkpoint = tmp_path / "model_checkpoints" / f"fine-tuned-{tiny_model}" / "step-000002"
    assert json.loads((checkpoint / "trainer_state.json").read_text())["adapter_only"]


def test_llama_adapter_command_launched_from_a_trl_accelerate_file(tiny_model, cache_dir, tmp_path):
    """The lesson's llama-adapter command on alpaca data, its processes and FSDP taken from an fsdp2 file."""
    path = write_accelerate_file(tmp_path, "fsdp2", ACCELERATE_FILES["fsdp2"])
    alpaca = [{"instruction": f"Add {i} and {i}.", "input": "", "output": str(2 * i)} for i in range(40)]
    (tmp_path / "alpaca.json").write_text(json.dumps(alpaca))
    proc = shardtune(
        cache_dir,
        tmp_path,
        "sft",
        "--accelerate_config",
        path,
        "--model_name",
        tiny_model,
        "--use_peft",
        "--peft_method",
        "llama_adapter",
        "--output_dir",
        "adapter",
        "--dataset",
        "alpaca_dataset",
        "--alpaca_dataset.data_path",
        "alpaca.json",
        "--alpaca_dataset.validation_fraction",
        0.1,
        *STEPS,
    )
    assert "fsdp2 FULL_SHARD, world size 2" in proc.stdout and "activation checkpointing" in proc.stdout
    assert json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["peft_type"] == "ADAPTION_PROMPT"
