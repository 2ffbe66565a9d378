"""What a TRL script parses besides its trainer's config, and the helpers that turn it into trainer arguments:
``ScriptArguments``, ``ModelConfig``, ``DatasetMixtureConfig`` (``DatasetConfig`` entries) with ``get_dataset``,
``get_peft_config``, ``get_quantization_config`` and ``get_kbit_device_map`` — TRL 1.16's fields, types and defaults,
so that ``TrlParser((ScriptArguments, SFTConfig, ModelConfig, DatasetMixtureConfig))`` parses TRL's documented
commands as TRL does.

The objects these helpers return are the ones TRL's return (a peft ``LoraConfig``, a transformers
``BitsAndBytesConfig``, a ``datasets.DatasetDict``): the trainers read them as they read a script's own.
"""

from dataclasses import dataclass, field
from typing import Any

from shardtune.api.configs import with_help
from shardtune.config.schema import ConfigError


@with_help
@dataclass
class ScriptArguments:
    """TRL's ``ScriptArguments``: which dataset a script loads."""

    dataset_name: str | None = None
    dataset_config: str | None = None
    dataset_train_split: str = "train"
    dataset_test_split: str = "test"
    dataset_streaming: bool = False
    ignore_bias_buffers: bool = field(
        default=False,
        metadata={
            "help": "TRL's DDP workaround for boolean buffers (the script sets it on trainer.model); shardtune's "
            "DDP does not broadcast buffers that no parameter needs, so it changes nothing"
        },
    )


@with_help
@dataclass
class ModelConfig:
    """TRL's ``ModelConfig``: the model, its adapter and its quantisation, as a script's command line gives them."""

    model_name_or_path: str | None = None
    model_revision: str = "main"
    dtype: str | None = "float32"
    attn_implementation: str | None = None
    use_peft: bool = False
    lora_r: int = 16
    lora_alpha: int = 32
    lora_dropout: float = 0.05
    lora_target_modules: list[str] | None = None
    lora_target_parameters: list[str] | None = None
    lora_modules_to_save: list[str] | None = None
    lora_task_type: str = "CAUSAL_LM"
    use_rslora: bool = False
    use_dora: bool = False
    load_in_8bit: bool = False
    load_in_4bit: bool = False
    bnb_4bit_quant_type: str = "nf4"
    use_bnb_nested_quant: bool = False
    bnb_4bit_quant_storage: str | None = None

    def __post_init__(self) -> None:
        if self.load_in_8bit and self.load_in_4bit:
            raise ConfigError("load_in_8bit and load_in_4bit are both set: choose one (4-bit is QLoRA)")
        modules = self.lora_target_modules
        if isinstance(modules, (list, tuple)) and len(modules) == 1:
            # TRL's: ["all-linear"] reads as "all-linear" (the field stays typed as the list the parser fills)
            self.lora_target_modules = modules[0]  # type: ignore[assignment]


MIXTURE_SPLIT_SEED = 0  # TRL splits without a seed: each process would hold another split


@dataclass
class DatasetConfig:
    """One dataset of a mixture, as ``datasets.load_dataset`` takes it (TRL's ``DatasetConfig``)."""

    path: str
    name: str | None = None
    data_dir: str | None = None
    data_files: str | list[str] | dict[str, str] | None = None
    split: str = "train"
    columns: list[str] | None = None
    fraction: float | None = None


@dataclass
class DatasetMixtureConfig:
    """TRL's ``DatasetMixtureConfig``: several datasets in one run (a YAML ``datasets:`` list), read by
    :func:`get_dataset`."""

    datasets: list[DatasetConfig] = field(
        default_factory=list, metadata={"help": "the datasets of the mixture (a YAML list of mappings)"}
    )
    streaming: bool = field(default=False, metadata={"help": "stream the datasets (IterableDatasets)"})
    test_split_size: float | None = field(
        default=None,
        metadata={
            "help": "hold out this share (or number) of the mixture's rows as its test split, drawn with seed "
            f"{MIXTURE_SPLIT_SEED} so that every process holds the same split"
        },
    )

    def __post_init__(self) -> None:
        entries = []
        for i, entry in enumerate(self.datasets):
            if isinstance(entry, dict):
                entry = DatasetConfig(**entry)
            if not isinstance(entry, DatasetConfig):
                raise ConfigError(f"datasets entry {i}: a {type(entry).__name__} is not a DatasetConfig or a mapping")
            entries.append(entry)
        self.datasets = entries


def get_dataset(mixture_config: DatasetMixtureConfig) -> Any:
    """The mixture as a ``datasets.DatasetDict`` (``train``, and ``test`` with ``test_split_size``), as TRL's
    ``get_dataset``: each entry loaded with ``datasets.load_dataset``, its columns kept, TRL's ``fraction`` rule (the
    first rows of each, no row repeated: shardtune.data.mixture.composition), then concatenated. The test split is
    drawn with a fixed seed, so that every process of a run holds the same one (TRL draws it unseeded)."""
    import dataclasses

    import datasets

    from shardtune.config.mixture import mixture_entries
    from shardtune.data.mixture import composition, load_entry

    if not mixture_config.datasets:
        raise ConfigError("get_dataset: the mixture names no dataset: give datasets (a list of path / split entries)")
    entries = mixture_entries("datasets", [dataclasses.asdict(entry) for entry in mixture_config.datasets])
    if mixture_config.streaming:
        if entries[0]["fraction"] is not None:
            raise ConfigError("datasets: fraction needs the rows counted: it does not stream (drop streaming)")
        loaded = [_streamed(entry) for entry in entries]
    else:
        loaded = [load_entry(entry) for entry in entries]
        counts = composition([len(d) for d in loaded], entries)
        loaded = [d.select(range(count)) if count != len(d) else d for d, count in zip(loaded, counts)]
    combined = datasets.concatenate_datasets(loaded)
    if mixture_config.test_split_size is None:
        return datasets.DatasetDict({"train": combined})
    if mixture_config.streaming:
        raise ConfigError("datasets: test_split_size needs the rows counted: it does not stream (drop streaming)")
    return combined.train_test_split(test_size=mixture_config.test_split_size, seed=MIXTURE_SPLIT_SEED)


def _streamed(entry: dict[str, Any]) -> Any:
    import datasets

    dataset = datasets.load_dataset(
        entry["path"],
        name=entry["name"],
        data_dir=entry["data_dir"],
        data_files=entry["data_files"],
        split=entry["split"],
        streaming=True,
    )
    return dataset.select_columns(entry["columns"]) if entry["columns"] is not None else dataset


def get_peft_config(model_args: ModelConfig) -> Any:
    """The ``LoraConfig`` of ``--use_peft`` and the ``lora_*`` fields (None without ``--use_peft``), as TRL's."""
    if not model_args.use_peft:
        return None
    from peft import LoraConfig

    extra: dict[str, Any] = (
        {} if model_args.lora_target_parameters is None else {"target_parameters": model_args.lora_target_parameters}
    )
    return LoraConfig(
        task_type=model_args.lora_task_type,
        r=model_args.lora_r,
        target_modules=model_args.lora_target_modules,
        lora_alpha=model_args.lora_alpha,
        lora_dropout=model_args.lora_dropout,
        bias="none",
        use_rslora=model_args.use_rslora,
        use_dora=model_args.use_dora,
        modules_to_save=model_args.lora_modules_to_save,
        **extra,
    )


def get_quantization_config(model_args: ModelConfig) -> Any:
    """The ``BitsAndBytesConfig`` of ``--load_in_4bit`` / ``--load_in_8bit`` (None without), as TRL's: 4-bit with
    the model's dtype as the compute dtype."""
    from transformers import BitsAndBytesConfig

    if model_args.load_in_4bit:
        return BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_compute_dtype=model_args.dtype,
            bnb_4bit_quant_type=model_args.bnb_4bit_quant_type,
            bnb_4bit_use_double_quant=model_args.use_bnb_nested_quant,
            bnb_4bit_quant_storage=model_args.bnb_4bit_quant_storage,
        )
    if model_args.load_in_8bit:
        return BitsAndBytesConfig(load_in_8bit=True)
    return None


def get_kbit_device_map() -> dict[str, int] | None:
    """Earlier TRL's ``device_map`` for a quantised model: this process's GPU (``{"": local rank}``), None on CPU.
    shardtune places every model by its strategy; a script that passes this map asks for that same placement."""
    import os

    import torch

    return {"": int(os.environ.get("LOCAL_RANK", 0))} if torch.cuda.is_available() else None
