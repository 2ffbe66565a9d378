"""What a script hands a trainer as objects, as the command line's inputs: in-memory datasets as data files, a PEFT
config as adapter settings, a tokenizer object as a tokenizer directory, GRPO's reward functions as --reward_funcs.

Files are content-addressed under the shardtune cache (``<cache>/inputs/<hash>/``): every rank of a run writes
the same bytes to a private temporary folder and renames it into place, so ranks need no coordination before the
process group exists, and the tokenised-data cache (keyed by the files' contents) tokenises the data once per run.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import os
import shutil
from pathlib import Path
from typing import Any, Callable

from shardtune.config.schema import ConfigError
from shardtune.data.stream_rows import register_in_process
from shardtune.model.loading import cache_dir
from shardtune.training.objectives.grpo import rewards

Pairs = list[tuple[str, Any]]


def _publish(write: Callable[[Path], None], kind: str) -> Path:
    """``write`` into a private folder, then the folder renamed to the hash of what it holds (kept if there)."""
    root = cache_dir() / "inputs"
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".tmp-{kind}-{os.getpid()}-{os.urandom(4).hex()}"
    tmp.mkdir()
    try:
        write(tmp)
        digest = hashlib.sha256()
        for path in sorted(p for p in tmp.rglob("*") if p.is_file()):
            digest.update(str(path.relative_to(tmp)).encode())
            digest.update(path.read_bytes())
        final = root / f"{kind}-{digest.hexdigest()[:24]}"
        if not final.exists():
            try:
                os.rename(tmp, final)
            except OSError:  # another rank renamed the same contents first
                if not final.exists():
                    raise
        return final
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _as_dataset(data: Any, name: str) -> Any:
    """A ``datasets.Dataset`` of ``data``: a Dataset, a list of dicts, or a one-split DatasetDict; one without a row
    is refused here, by its argument's name (written out, it would be a file of the cache the script never named)."""
    data = _dataset(data, name)
    import datasets

    if isinstance(data, datasets.Dataset) and not len(data):
        fix = "pass the rows to train on" if name == "train_dataset" else "pass rows to evaluate on, or leave it out"
        raise ConfigError(f"{name} is empty (a dataset of 0 rows): {fix}")
    return data


def _dataset(data: Any, name: str) -> Any:
    import datasets

    if isinstance(data, datasets.IterableDatasetDict):
        if len(data) != 1:
            raise ConfigError(
                f"{name}: an IterableDatasetDict of {len(data)} splits ({', '.join(map(str, data))}): pass one of them"
            )
        return next(iter(data.values()))
    if isinstance(data, datasets.IterableDataset):
        return data
    if isinstance(data, (datasets.DatasetDict, dict)) and not isinstance(data, datasets.Dataset):
        if len(data) != 1:
            raise ConfigError(
                f"{name}: a mapping of {len(data)} datasets ({', '.join(map(str, data))}): shardtune evaluates on one "
                "dataset; pass one of them"
            )
        data = next(iter(data.values()))
    if isinstance(data, list):
        if not all(isinstance(row, dict) for row in data):
            raise ConfigError(f"{name}: a list must hold the rows as dicts")
        return datasets.Dataset.from_list(data)
    if isinstance(data, datasets.Dataset):
        return data
    raise ConfigError(
        f"{name}: a {type(data).__name__} is not a dataset: pass a datasets.Dataset, a DatasetDict split or a list "
        "of dicts"
    )


def _formatted(data: Any, formatting_func: Callable[[dict], Any]) -> Any:
    """TRL's formatting_func: each row becomes language-modelling text (``{"text": formatting_func(row)}``)."""

    def text(row: dict) -> dict:
        value = formatting_func(row)
        if isinstance(value, list) and len(value) == 1:
            value = value[0]
        if not isinstance(value, str):
            raise ConfigError(
                f"formatting_func returned a {type(value).__name__} for a row: it must return the row's text (a str)"
            )
        return {"text": value}

    import datasets

    if isinstance(data, datasets.IterableDataset):  # lazily, as the stream is read
        return data.map(text, remove_columns=data.column_names)
    return data.map(text, remove_columns=data.column_names, load_from_cache_file=False)


def dataset_settings(train: Any, evaluation: Any, formatting_func: Callable[[dict], Any] | None = None) -> Pairs:
    """The data flags of in-memory datasets: one folder of train.parquet (and test.parquet), TRL's formats
    recognised as for ``--dataset_name`` (docs/data-formats.md); with ``formatting_func`` (TRL's) each row is first
    turned into its text."""
    if train is None:
        raise ConfigError("train_dataset is None: pass the training data (a datasets.Dataset or a list of dicts)")
    import datasets

    splits = {"train": _as_dataset(train, "train_dataset")}
    if evaluation is not None:
        splits["test"] = _as_dataset(evaluation, "eval_dataset")
    if formatting_func is not None:
        splits = {name: _formatted(data, formatting_func) for name, data in splits.items()}
    if isinstance(splits["train"], datasets.IterableDataset):  # streamed in this process (TRL: needs max_steps)
        return [
            ("dataset_name", register_in_process(splits)),
            ("dataset_train_split", "train"),
            ("dataset_test_split", "test"),
            ("dataset_streaming", True),
        ]
    if isinstance(splits.get("test"), datasets.IterableDataset):
        raise ConfigError(
            "eval_dataset: an IterableDataset beside a train_dataset that is not one: pass a datasets.Dataset to "
            "evaluate on (it is read whole)"
        )

    def write(folder: Path) -> None:
        from datasets.utils import logging as datasets_logging

        shown = datasets_logging.is_progress_bar_enabled()
        datasets_logging.disable_progress_bar()  # a bar per split for a file written in an instant
        try:
            for split, data in splits.items():
                name = "train_dataset" if split == "train" else "eval_dataset"
                _with_image_bytes(data, name).to_parquet(str(folder / f"{split}.parquet"))
        finally:
            if shown:
                datasets_logging.enable_progress_bar()

    folder = _publish(write, "dataset")
    return [("dataset_name", str(folder)), ("dataset_train_split", "train"), ("dataset_test_split", "test")]


def _with_image_bytes(data: Any, name: str) -> Any:
    """``data`` with its image columns (shardtune.data.vision.IMAGE_COLUMNS) holding each image's bytes: PIL images and
    ``datasets`` Image features are written as bytes by ``to_parquet`` already, but an image named by its path (a
    string, or an Image feature read from files) would be written as the path, which the run would read from the
    cache folder; read here instead, relative to the script's working directory, as TRL's processor opens them."""
    import datasets
    from datasets.table import embed_table_storage

    from shardtune.data.vision import IMAGE_COLUMNS

    for column in (c for c in IMAGE_COLUMNS if c in data.column_names):
        feature = data.features[column]
        inner = feature.feature if isinstance(feature, (datasets.List, datasets.Sequence)) else feature
        if not isinstance(inner, datasets.Value) or inner.dtype not in ("string", "large_string"):
            continue
        values = data[column] if inner is feature else [v for row in data[column] for v in row or []]
        url = next((v for v in values if isinstance(v, str) and "://" in v), None)
        if url is not None:
            raise ConfigError(f"{name}: image {url} is a URL: download the images and name local files")
        image = datasets.Image()
        data = data.cast_column(column, image if inner is feature else datasets.List(image))
    if not any(c in data.column_names for c in IMAGE_COLUMNS):
        return data
    try:
        return data.with_format("arrow").map(embed_table_storage, batched=True).with_format(None)
    except FileNotFoundError as e:
        raise ConfigError(
            f"{name}: image file {e.filename} does not exist (relative paths are read from the working directory "
            f"{Path.cwd()}): fix the path, or pass the image itself (a PIL image or its bytes)"
        ) from None


def refuse_image_rows(objective: str, model_name: str, **splits: Any) -> None:
    """A script's datasets with an image column, refused in the script's own words where the run could not train
    them (the run itself refuses them too, naming its data folder in the cache): images train with SFTTrainer on a
    vision-language model; TRL's vision DPO (and the other trainers' image rows) are not built."""
    from shardtune.config.objectives import registration
    from shardtune.data.vision import IMAGE_COLUMNS
    from shardtune.model.loading import is_vision_model, resolve_model_name

    for name, data in splits.items():
        column = next((c for c in IMAGE_COLUMNS if c in _column_names(data)), None)
        if column is None:
            continue
        if not registration(objective).vision_implementation:
            raise ConfigError(
                f"{name} has an {column!r} column: {objective.upper()} with images (TRL's vision {objective.upper()} "
                "rows) is not built, images train with SFTTrainer on a vision-language model (docs/vision.md): "
                "drop the column, or train with SFTTrainer"
            )
        if not is_vision_model(resolve_model_name(model_name)):
            raise ConfigError(
                f"{name} has an {column!r} column, but the model {model_name} is a text-only model (its config has "
                "no vision_config): pass a vision-language model (docs/vision.md), or drop the column"
            )


def _column_names(data: Any) -> list[str]:
    if isinstance(data, list):
        return list(data[0]) if data and isinstance(data[0], dict) else []
    if isinstance(data, dict) and not hasattr(data, "column_names"):
        return [c for split in data.values() for c in _column_names(split)]
    names = getattr(data, "column_names", None)
    if isinstance(names, dict):  # a DatasetDict: its splits' columns
        return [c for columns in names.values() for c in columns]
    return list(names or [])


def tokenizer_settings(tokenizer: Any) -> Pairs:
    """``processing_class``: a path or hub id, or a tokenizer object (saved, with its chat template)."""
    if tokenizer is None:
        return []
    if isinstance(tokenizer, (str, os.PathLike)):
        return [("model.tokenizer", str(tokenizer))]
    if not hasattr(tokenizer, "save_pretrained"):
        raise ConfigError(
            f"processing_class: a {type(tokenizer).__name__} is not a tokenizer: pass a transformers tokenizer or "
            "its path"
        )
    return [("model.tokenizer", str(_publish(tokenizer.save_pretrained, "tokenizer")))]


def model_settings(model: Any, name: str = "model", setting: str = "model_name_or_path") -> Pairs:
    """``model`` (DPO's ``ref_model`` too, with ``name`` and ``setting``): a local directory, a hub id or a preset
    name; or a transformers model object, saved (its weights as they are now, its config and generation config) to
    a content-addressed folder by every process alike: for a large model, pass its directory instead (each process
    writes a copy)."""
    if isinstance(model, (str, os.PathLike)):
        return [(setting, str(model))]
    if hasattr(model, "peft_config"):
        raise ConfigError(
            f"{name}: a PeftModel is not taken: pass the base model and the adapter's config as peft_config (to "
            "continue an adapter, pass its directory as --peft.from_checkpoint)"
        )
    if not hasattr(model, "save_pretrained") or not hasattr(model, "config"):
        raise ConfigError(
            f"{name}: a {type(model).__name__} is not a transformers model: pass a PreTrainedModel, or its "
            "directory or hub id"
        )
    return [(setting, str(_publish(lambda folder: model.save_pretrained(str(folder)), "model")))]


def _value(value: Any) -> Any:
    return value.value if isinstance(value, enum.Enum) else value


# fields a PEFT config fills in by itself, or that say nothing about the adapter trained
_BOOKKEEPING = {
    "peft_type",
    "auto_mapping",
    "peft_version",
    "base_model_name_or_path",
    "revision",
    "inference_mode",
    "runtime_config",
    "task_type",
}
_HONOURED = {
    "LoraConfig": {"r", "lora_alpha", "lora_dropout", "target_modules", "modules_to_save", "use_rslora", "use_dora"}
    | {"bias"},
    "PrefixTuningConfig": {"num_virtual_tokens"},
    "AdaptionPromptConfig": {"adapter_len", "adapter_layers"},
}


def peft_settings(peft_config: Any) -> Pairs:
    """``peft_config``: a peft LoraConfig (DoRA, rsLoRA), PrefixTuningConfig or AdaptionPromptConfig (llama-adapter)
    as adapter settings; a field set to something else than its default that shardtune does not build is refused."""
    if peft_config is None:
        return []
    kind = type(peft_config).__name__
    if kind not in _HONOURED:
        raise ConfigError(
            f"peft_config: {kind} is not built: pass a LoraConfig (LoRA, DoRA, rsLoRA), PrefixTuningConfig or "
            "AdaptionPromptConfig (llama-adapter)"
        )
    task = _value(getattr(peft_config, "task_type", None))
    if task not in (None, "CAUSAL_LM", "SEQ_CLS"):
        raise ConfigError(
            f"peft_config.task_type {task}: shardtune trains CAUSAL_LM adapters, and SEQ_CLS ones for reward models "
            "(RewardTrainer): pass one of those, or leave it unset"
        )
    task_pairs: Pairs = [("lora_task_type", task)] if task == "SEQ_CLS" else []  # settled as --lora_task_type
    default = type(peft_config)()
    for f in dataclasses.fields(peft_config):
        if f.name in _BOOKKEEPING or f.name in _HONOURED[kind]:
            continue
        if _value(getattr(peft_config, f.name)) != _value(getattr(default, f.name)):
            raise ConfigError(
                f"peft_config.{f.name} {getattr(peft_config, f.name)!r} is not built in shardtune ({kind}: "
                f"{', '.join(sorted(_HONOURED[kind]))}): leave it at its default"
            )
    c = peft_config
    if kind == "LoraConfig":
        modules = c.target_modules
        if modules is None:
            modules = ["q_proj", "v_proj"]  # peft's own default for Llama-family models
        elif isinstance(modules, str):
            if modules != "all-linear":
                raise ConfigError(
                    f"peft_config.target_modules {modules!r}: a regular expression is not built: pass a list of "
                    "module names, or all-linear"
                )
            modules = [modules]
        return task_pairs + [
            ("peft.method", "lora"),
            ("peft.lora.r", c.r),
            ("peft.lora.alpha", c.lora_alpha),
            ("peft.lora.dropout", c.lora_dropout),
            ("peft.lora.target_modules", sorted(modules)),
            ("peft.lora.modules_to_save", list(c.modules_to_save or [])),
            ("peft.lora.use_rslora", bool(c.use_rslora)),
            ("peft.lora.use_dora", bool(c.use_dora)),
            ("peft.lora.bias", c.bias),
        ]
    if kind == "PrefixTuningConfig":
        return (
            task_pairs
            + [("peft.method", "prefix")]
            + ([("peft.prefix.num_virtual_tokens", c.num_virtual_tokens)] if c.num_virtual_tokens else [])
        )
    pairs: Pairs = [*task_pairs, ("peft.method", "llama_adapter")]
    if c.adapter_len:
        pairs.append(("peft.llama_adapter.adapter_len", c.adapter_len))
    if c.adapter_layers:
        pairs.append(("peft.llama_adapter.adapter_layers", c.adapter_layers))
    return pairs


def reward_functions(reward_funcs: Any) -> tuple[list[str], list[Callable[..., Any]]]:
    """GRPO's ``reward_funcs`` (one, or a list): a string is a --reward_funcs entry as the command line takes it
    (path.py:function, package.module.function, a reward model's directory or hub id); a callable is the script's
    own, kept in this process (shardtune.training.objectives.grpo.rewards.register_in_process: every process of a run
    runs the
    script, and ``python train.py`` runs the run in the script's process). Returns (the entries in order, the
    callables)."""
    if reward_funcs is None:
        raise ConfigError(
            "reward_funcs is None: pass a reward function (a callable, path.py:function, package.module.function or "
            "a reward model's directory), or a list of them"
        )
    funcs = list(reward_funcs) if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]
    if not funcs:
        raise ConfigError("reward_funcs is empty: pass at least one reward function")
    from torch import nn

    callables: list[Callable[..., Any]] = []
    for func in funcs:
        if isinstance(func, nn.Module) or hasattr(func, "save_pretrained"):
            raise ConfigError(
                f"reward_funcs: a {type(func).__name__} object is not taken: pass the reward model's directory or hub "
                "id (a string), so that every process loads it on its own device"
            )
        if not isinstance(func, (str, os.PathLike)) and not callable(func):
            raise ConfigError(
                f"reward_funcs: a {type(func).__name__} is not a reward function: pass a callable, "
                "path.py:function, package.module.function or a reward model's directory"
            )
        if not isinstance(func, (str, os.PathLike)):
            callables.append(func)
    names = iter(rewards.register_in_process(callables))
    return [str(f) if isinstance(f, (str, os.PathLike)) else next(names) for f in funcs], callables


def model_source(given: Any, model: Any) -> str:
    """Where the run's tokenizer comes from when the script gives no ``processing_class``, as TRL's rule: a model
    given by name or path is its own tokenizer's source; a model object, the name or path it was loaded from
    (``model.config._name_or_path``). ``given``: the processing_class, or the model."""
    if isinstance(given, (str, os.PathLike)):
        return str(given)
    if hasattr(given, "save_pretrained") and not hasattr(given, "config"):  # a tokenizer object: saved by settings
        return str(getattr(given, "name_or_path", "") or "")
    config = getattr(given, "config", None)
    source = getattr(config, "_name_or_path", "") if config is not None else getattr(given, "name_or_path", "")
    if not source:
        raise ConfigError(
            f"model: this {type(model).__name__} names no path to load its tokenizer from (built from a config, not "
            "from_pretrained): pass processing_class (a tokenizer or its path)"
        )
    return str(source)


def quantization_settings(quantization_config: Any) -> Pairs:
    """TRL's ``quantization_config=`` (a transformers ``BitsAndBytesConfig``, or its dict): 4-bit (QLoRA) or 8-bit
    base weights as ``--load_in_4bit`` / ``--load_in_8bit`` take them. The compute dtype is the run's precision and
    the storage dtype is the one its strategy shards (FSDP: bf16); another field set away from its default is
    refused."""
    if quantization_config is None:
        return []
    if isinstance(quantization_config, dict):
        from transformers import BitsAndBytesConfig

        quantization_config = BitsAndBytesConfig(**quantization_config)
    if type(quantization_config).__name__ != "BitsAndBytesConfig":
        raise ConfigError(
            f"quantization_config: a {type(quantization_config).__name__} is not built: pass a BitsAndBytesConfig "
            "(4-bit: QLoRA, or 8-bit)"
        )
    q = quantization_config
    taken = {"load_in_4bit", "load_in_8bit", "bnb_4bit_quant_type", "bnb_4bit_use_double_quant"}
    taken |= {"bnb_4bit_compute_dtype", "bnb_4bit_quant_storage", "quant_method", "_load_in_4bit", "_load_in_8bit"}
    default = type(q)().to_dict()
    for key, value in q.to_dict().items():
        if key not in taken and value != default.get(key):
            raise ConfigError(
                f"quantization_config.{key} {value!r} is not built (shardtune takes load_in_4bit with "
                "bnb_4bit_quant_type and bnb_4bit_use_double_quant, or load_in_8bit): leave it at its default"
            )
    if q.load_in_4bit:
        return [
            ("load_in_4bit", True),
            ("bnb_4bit_quant_type", q.bnb_4bit_quant_type),
            ("use_bnb_nested_quant", bool(q.bnb_4bit_use_double_quant)),
        ]
    return [("load_in_8bit", True)] if q.load_in_8bit else []
