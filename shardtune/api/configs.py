"""``SFTConfig`` / ``DPOConfig`` / ``GRPOConfig``: TRL 1.16's configs, as real dataclasses on transformers'
``TrainingArguments``, with TRL's fields, types and defaults.

They are what TRL's are to a script: ``HfArgumentParser`` / :class:`shardtune.TrlParser` parse them, ``dataclasses.
replace`` and ``to_dict`` work, an unset field reads TRL's default (``SFTConfig(output_dir="x").eval_strategy`` is
``"no"``). What they mean is not a second copy: the fields a config sets differently from its class's defaults are
TRL spellings, turned into the canonical config by the command line's builder (shardtune.config.dialects.trl), in
``__post_init__`` and again when a trainer is made (a script may set a field after construction). A field shardtune
cannot honour keeps its place and is refused in one line only when set to a value that would change the run.

Two things differ from TRL's on purpose:

- making a config starts no process group (TrainingArguments' device set-up builds accelerate's ``PartialState``,
  which joins one under torchrun): the run joins its own group in ``train()``. ``device``, ``world_size``,
  ``process_index``, ``local_process_index``, ``parallel_mode`` and ``main_process_first`` read torchrun's
  environment and shardtune's runtime instead.
- the help of a TRL field is shardtune's meaning of it (what ``shardtune sft --help`` says).

A TRL ``SFTConfig`` / ``DPOConfig`` / ``GRPOConfig`` / ``TrainingArguments`` object is read the same way
(:func:`fields_of`).
"""

import contextlib
import dataclasses
import enum
import functools
import os
import types
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, ClassVar, Iterator, Sequence

from transformers import TrainingArguments
from transformers.training_args import ParallelMode

from shardtune.api.accelerator import ScriptAccelerator
from shardtune.config.flags import build_config
from shardtune.config.schema import ConfigError, TrainConfig

# transformers' TrainingArguments default: where a script that names no output_dir writes
DEFAULT_OUTPUT_DIR = "trainer_output"


def help_of(name: str) -> str:
    """A TRL field's help: shardtune's meaning of the name (the dialect's table), or why it is refused."""
    from shardtune.config.spellings import resolve

    try:
        spelling = resolve(name)
    except ConfigError:
        return "TRL's field"
    if spelling.refuse:
        return f"not built in shardtune: {spelling.refuse}"
    return spelling.meaning or f"sets {spelling.target}"


def with_help(cls: type) -> type:
    """Fill in the help of the fields ``cls`` declares without one (what HfArgumentParser shows in --help)."""
    for f in dataclasses.fields(cls):
        if "help" not in f.metadata:
            f.metadata = types.MappingProxyType({**f.metadata, "help": help_of(f.name)})
    return cls


def _list(*items: Any) -> Any:
    return field(default_factory=lambda: list(items))


# -- where the script runs: torchrun's environment, no process group -------------------------------------------------


def _bf16_gpu() -> bool:
    from transformers.utils import is_torch_bf16_gpu_available

    return is_torch_bf16_gpu_available()


_building_default = False  # a config made to read its class's defaults: no validation (no recursion)


@dataclass
class _TrlArguments(TrainingArguments):
    """TRL's ``_BaseConfig``: TrainingArguments with TRL's overrides, validated as shardtune settings."""

    objective: ClassVar[str] = "sft"

    logging_steps: float = field(default=10, metadata={"help": help_of("logging_steps")})
    gradient_checkpointing: bool = field(default=True, metadata={"help": help_of("gradient_checkpointing")})
    # TRL's override of TrainingArguments' bool: None (unset) reads as "not fp16"
    bf16: bool | None = field(  # type: ignore[assignment]
        default=None, metadata={"help": help_of("bf16") + "; unset: true unless fp16"}
    )
    lr_scheduler_kwargs: dict | str | None = field(default=None, metadata={"help": help_of("lr_scheduler_kwargs")})
    use_liger_kernel: bool = field(default=False, metadata={"help": help_of("use_liger_kernel")})
    torch_empty_cache_steps: int | None = field(default=None, metadata={"help": help_of("torch_empty_cache_steps")})

    def __post_init__(self) -> None:
        self.bf16 = not self.fp16 if self.bf16 is None else self.bf16  # TRL's rule
        bf16 = self.bf16
        if bf16 and not self.use_cpu and not _bf16_gpu():
            # shardtune's bf16 is bf16 compute where the device has it, fp32 elsewhere (TrainingArguments refuses it
            # on a machine without such a GPU: TRL's SFTConfig() fails on a CPU-only machine)
            self.bf16 = False
        super().__post_init__()
        self.bf16 = bf16
        self._trl_post_init()
        if not _building_default:
            self.canonical()  # a refused field or value: now, where the script builds its config

    def _trl_post_init(self) -> None:
        """What TRL's own ``__post_init__`` fills in, so that an unset field reads what it reads in TRL."""
        value = getattr(self, "pad_to_multiple_of", None)  # the configs that have it declare it
        if value is not None:
            if isinstance(value, str) and value != "auto":
                value = None if value.lower() in ("none", "null") else int(value)
            self.pad_to_multiple_of = None if value == "auto" else value

    def canonical(self, more: Sequence[tuple[str, Any]] = ()) -> TrainConfig:
        """The canonical config of the fields this config sets and ``more``; TRL's defaults for the rest."""
        pairs = [("defaults", "trl"), *fields_of(self).items(), *more]
        return build_config(pairs, None, (), [], self.objective)

    # -- the device and the ranks, from torchrun's environment (no accelerate PartialState) ---------------------------

    @cached_property
    def _setup_devices(self) -> Any:
        self.distributed_state = None
        device = ScriptAccelerator().device  # torchrun's LOCAL_RANK GPU, else the CPU
        self._n_gpu = 1 if device.type == "cuda" else 0
        return device

    @property
    def world_size(self) -> int:
        return ScriptAccelerator().num_processes

    @property
    def process_index(self) -> int:
        return ScriptAccelerator().process_index

    @property
    def local_process_index(self) -> int:
        return ScriptAccelerator().local_process_index

    @property
    def parallel_mode(self) -> ParallelMode:
        return ParallelMode.DISTRIBUTED if self.world_size > 1 else ParallelMode.NOT_PARALLEL

    @contextlib.contextmanager
    def main_process_first(self, local: bool = True, desc: str = "work") -> Iterator[None]:
        """The main process (of the node with ``local``) runs the block first, the others after it (a barrier)."""
        with ScriptAccelerator().main_process_first(local=local):
            yield


@with_help
@dataclass
class _TrlModelArguments(_TrlArguments):
    """The model fields every TRL trainer config has."""

    model_init_kwargs: dict[str, Any] | str | None = None
    trust_remote_code: bool = False
    router_aux_loss_coef: float | None = None


@with_help
@dataclass
class SFTConfig(_TrlModelArguments):
    """TRL 1.16's ``SFTConfig`` for :class:`shardtune.SFTTrainer`."""

    objective: ClassVar[str] = "sft"

    learning_rate: float = field(default=2e-5, metadata={"help": help_of("learning_rate")})
    chat_template_path: str | None = None
    dataset_text_field: str = "text"
    dataset_kwargs: dict[str, Any] | str | None = None
    dataset_num_proc: int | None = None
    eos_token: str | None = None
    max_length: int | None = 1024
    truncation_mode: str = "keep_start"
    shuffle_dataset: bool = False
    packing: bool = False
    packing_strategy: str = "bfd"
    padding_free: bool = False
    pad_to_multiple_of: int | str | None = "auto"
    eval_packing: bool | None = None
    completion_only_loss: bool | None = None
    assistant_only_loss: bool = False
    loss_type: str = "nll"
    activation_offloading: bool = False
    pad_token: str | None = None

    def _trl_post_init(self) -> None:
        super()._trl_post_init()
        if self.packing_strategy == "bfd-requeue":  # TRL's older name
            self.packing_strategy = "bfd_split"
        if self.loss_type == "chunked_nll":  # TRL: the same loss as nll
            self.loss_type = "nll"


@with_help
@dataclass
class DPOConfig(_TrlModelArguments):
    """TRL 1.16's ``DPOConfig`` for :class:`shardtune.DPOTrainer`."""

    objective: ClassVar[str] = "dpo"

    learning_rate: float = field(default=1e-6, metadata={"help": help_of("learning_rate")})
    disable_dropout: bool = True
    dataset_num_proc: int | None = None
    max_length: int | None = 1024
    truncation_mode: str = "keep_start"
    padding_free: bool = False
    pad_to_multiple_of: int | str | None = "auto"
    precompute_ref_log_probs: bool = False
    precompute_ref_batch_size: int | None = None
    loss_type: list[str] = _list("sigmoid")
    loss_weights: list[float] | None = None
    ld_alpha: float | None = None
    f_divergence_type: str = "reverse_kl"
    f_alpha_divergence_coef: float = 0.5
    label_smoothing: float = 0.0
    beta: float = 0.1
    use_weighting: bool = False
    discopop_tau: float = 0.05
    activation_offloading: bool = False
    sync_ref_model: bool = False
    ref_model_mixup_alpha: float = 0.6
    ref_model_sync_steps: int = 512
    pad_token: str | None = None

    def _trl_post_init(self) -> None:
        if isinstance(self.loss_type, str):
            self.loss_type = [self.loss_type]
        super()._trl_post_init()


@with_help
@dataclass
class _SamplingArguments(_TrlModelArguments):
    """What TRL's GRPOConfig and RLOOConfig share (the same names, types and defaults): sampling, the clipped ratio,
    vLLM, the logging of completions; and the generation sizes TRL derives from the batch."""

    learning_rate: float = field(default=1e-6, metadata={"help": help_of("learning_rate")})
    # TRL's override of TrainingArguments' bool
    remove_unused_columns: bool | None = field(  # type: ignore[assignment]
        default=False, metadata={"help": help_of("remove_unused_columns")}
    )
    disable_dropout: bool = False
    num_generations_eval: int | None = None
    max_completion_length: int | None = 512
    ds3_gather_for_generation: bool = True
    shuffle_dataset: bool | None = True
    pad_to_multiple_of: int | str | None = "auto"
    generation_batch_size: int | None = None
    steps_per_generation: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float | None = None
    generation_kwargs: dict | str | None = None
    chat_template_kwargs: dict | str | None = None
    repetition_penalty: float = 1.0
    cache_implementation: str | None = None
    use_vllm: bool = False
    vllm_mode: str = "colocate"
    vllm_model_impl: str = "vllm"
    vllm_enable_sleep_mode: bool = False
    vllm_structured_outputs_regex: str | None = None
    vllm_server_base_url: str | None = None
    vllm_server_host: str = "0.0.0.0"
    vllm_server_port: int = 8000
    vllm_server_timeout: float = 240.0
    vllm_group_port: int = 51216
    vllm_gpu_memory_utilization: float = 0.3
    vllm_max_model_length: int | None = None
    vllm_tensor_parallel_size: int = 1
    num_iterations: int = 1
    epsilon: float = 0.2
    epsilon_high: float | None = None
    reward_weights: list[float] | None = None
    mask_truncated_completions: bool = False
    sync_ref_model: bool = False
    ref_model_mixup_alpha: float = 0.6
    ref_model_sync_steps: int = 512
    log_completions: bool = False
    log_multimodal: bool = True
    num_completions_to_print: int | None = None
    log_unique_prompts: bool = False
    use_transformers_continuous_batching: bool = False
    transformers_continuous_batching_config: dict | str | None = None
    use_transformers_paged: bool = False

    def _trl_post_init(self) -> None:
        super()._trl_post_init()
        per_step = self.per_device_train_batch_size * self.world_size  # TRL's derived generation sizes
        size, steps = self.generation_batch_size, self.steps_per_generation
        if size is None and steps is None:
            self.steps_per_generation = self.gradient_accumulation_steps
            self.generation_batch_size = per_step * self.steps_per_generation
        elif size is not None and steps is None and size % per_step == 0:
            self.steps_per_generation = size // per_step
        elif size is None and steps is not None:
            self.generation_batch_size = per_step * steps


@with_help
@dataclass
class GRPOConfig(_SamplingArguments):
    """TRL 1.16's ``GRPOConfig`` for :class:`shardtune.GRPOTrainer`."""

    objective: ClassVar[str] = "grpo"

    cast_lm_head_to_fp32: bool = False
    num_generations: int | None = 8
    beta: float = 0.0
    delta: float | None = None
    sapo_temperature_neg: float = 1.05
    sapo_temperature_pos: float = 1.0
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0
    importance_sampling_level: str = "token"
    multi_objective_aggregation: str = "sum_then_normalize"
    scale_rewards: str = "group"
    loss_type: str = "dapo"
    top_entropy_quantile: float = 1.0
    entropy_coef: float = 0.0
    use_adaptive_entropy: bool = False
    entropy_coef_min: float = 0.0
    entropy_coef_max: float = 1.0
    entropy_coef_delta: float = 0.005
    entropy_target: float = 0.2
    max_tool_calling_iterations: int | None = None
    vllm_importance_sampling_correction: bool = True
    vllm_importance_sampling_mode: str = "sequence_mask"
    vllm_importance_sampling_clip_max: float | None = 3.0
    vllm_importance_sampling_clip_min: float | None = None
    off_policy_mask_threshold: float | None = None
    use_bias_correction_kl: bool = True
    log_completions_hub_repo: str | None = None
    vllm_importance_sampling_cap: float | None = None

    def _trl_post_init(self) -> None:
        super()._trl_post_init()
        if isinstance(self.scale_rewards, bool):  # TRL's older True / False
            self.scale_rewards = "group" if self.scale_rewards else "none"


def config_class(objective: str) -> type[_TrlArguments]:
    """The TRL-shaped config of ``objective`` in the Python face: its registration's ``api_config``, else SFT's."""
    import importlib

    from shardtune.config.objectives import registration

    module, _, name = (registration(objective).api_config or "shardtune.api.configs:SFTConfig").partition(":")
    return getattr(importlib.import_module(module), name)


# -- what a config object sets ----------------------------------------------------------------------------------------


def _plain(value: Any) -> Any:
    """A field's value as a config value: enums by their value."""
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


_KEPT = ("output_dir", "use_cpu", "bf16", "fp16")  # what a default instance shares with the config it is compared to


@functools.lru_cache(maxsize=64)
def _default_of(cls: type, kept: tuple[tuple[str, Any], ...], world: tuple[str, ...]) -> Any:
    """``cls``'s defaults as a constructed instance (its ``__post_init__`` applied as to the config compared), or None
    for a class that needs more to construct; ``world``: the environment its derived fields read (the cache key)."""
    global _building_default
    _building_default = True
    try:
        return cls(**dict(kept))
    except Exception:  # noqa: BLE001 - a class that needs more to construct: compare with the fields' own defaults
        return None
    finally:
        _building_default = False


def fields_of(args: Any) -> dict[str, Any]:
    """The fields a TRL / transformers arguments object (shardtune's own configs included) sets differently from its
    class's defaults (its ``__post_init__`` applied to both alike), by name."""
    if not dataclasses.is_dataclass(args) or isinstance(args, type):
        raise ConfigError(
            f"args {type(args).__name__}: pass shardtune's SFTConfig / DPOConfig / GRPOConfig, or TRL's SFTConfig / "
            "DPOConfig / GRPOConfig / transformers' TrainingArguments"
        )
    keep = tuple((k, _hashable(getattr(args, k))) for k in _KEPT if hasattr(args, k))
    world = tuple(os.environ.get(k, "") for k in ("WORLD_SIZE", "LOCAL_RANK", "RANK"))
    default = _default_of(type(args), keep, world)
    given: dict[str, Any] = {"output_dir": getattr(args, "output_dir", None) or DEFAULT_OUTPUT_DIR}
    for f in dataclasses.fields(args):
        if not f.init or f.name.startswith("_"):
            continue
        value = getattr(args, f.name)
        if default is not None:
            base = getattr(default, f.name)
        elif f.default is not dataclasses.MISSING:
            base = f.default
        elif f.default_factory is not dataclasses.MISSING:
            base = f.default_factory()
        else:
            base = dataclasses.MISSING
        if _plain(value) != _plain(base):
            given[f.name] = _plain(value)
        elif f.name in dict(keep) and value is not None and value != f.default:  # kept alike in the default instance
            given[f.name] = value
    return _without_derived_generation(args, given)


def _hashable(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value


def _without_derived_generation(args: Any, given: dict[str, Any]) -> dict[str, Any]:
    """TRL's GRPOConfig fills in steps_per_generation / generation_batch_size from the batch and the world size when
    the script leaves them out: such values are not the script's (shardtune derives the same from its own 0s)."""
    if "generation_batch_size" not in given and "steps_per_generation" not in given:
        return given
    steps = getattr(args, "steps_per_generation", None)
    per_step = getattr(args, "per_device_train_batch_size", 0) * getattr(args, "world_size", 1)
    if steps and given.get("generation_batch_size") == per_step * steps:
        given.pop("generation_batch_size")
    if steps and steps == getattr(args, "gradient_accumulation_steps", None):
        given.pop("steps_per_generation", None)
    return given
