"""The registry of training objectives: each objective the engine trains is one entry (a verb of its own for the
built-ins: ``shardtune sft``, ``shardtune dpo``, ``shardtune grpo``).

An objective is a plug-in of the engine: an Objective subclass (shardtune.training.engine.objective) and its
Registration here, which says -- without importing torch or the model libraries -- everything objective-specific the
rest of the package needs: its one-line help, its settings section, whose defaults it takes and its own, its planner
terms, its Python face's classes. Nothing else names an objective. A plug-in outside the package registers its own
(:func:`register`), or is named where it lives, ``module:attribute`` (``--objective my_pkg.objectives:WEIGHTED``): a
Registration importable in every process of the run, registered under that name on first use (:func:`registration`).
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Callable

from shardtune.config.setting import ConfigError


def no_reference(cfg: Any) -> bool:
    return False


def grpo_reference(cfg: Any) -> bool:
    """GRPO's reference (beta > 0) is a frozen copy of the starting weights for full fine-tuning (with PEFT: the
    base, adapter off)."""
    return cfg.grpo.beta > 0 and not cfg.peft.method


def no_sampling(cfg: Any, world_size: int) -> int:
    return 0


def grpo_sampling_rows(cfg: Any, world_size: int) -> int:
    """The completions a GRPO process samples at once: one generation's share
    (shardtune.training.objectives.grpo.batches: k
    optimizer steps of its micro-batches)."""
    g, batch = cfg.grpo, cfg.train.batch_size
    if g.steps_per_generation:
        return g.steps_per_generation * batch
    if g.generation_batch_size:
        dp = world_size // (cfg.parallel.sequence_parallel_size * cfg.parallel.context_parallel_size)
        return max(1, g.generation_batch_size // dp)
    return cfg.train.gradient_accumulation_steps * batch


def dpo_reference(cfg: Any) -> bool:
    """DPO's reference is a frozen copy of the model for full fine-tuning (with PEFT: the base, adapter off), unless
    its log-probabilities are precomputed."""
    return not cfg.peft.method and not cfg.dpo.precompute_ref_log_probs


def no_scored_rows(cfg: Any) -> int:
    return 0


def kto_kl_rows(cfg: Any) -> int:
    """KTO's KL rows (each prompt with another row's completion), scored by the policy and the reference without a
    graph for the step's KL estimate: one per row with loss_type kto, none with apo_zero_unpaired."""
    return 1 if cfg.kto.loss_type == "kto" else 0


def no_whole_gather(cfg: Any) -> bool:
    return False


def grpo_gathers_whole(cfg: Any) -> bool:
    return bool(cfg.grpo.ds3_gather_for_generation)


@dataclass(frozen=True)
class Registration:
    help: str  # its line in `shardtune --help`
    implementation: str  # "module:Class" of its Objective
    settings: str = ""  # the config section of its own flags (given to another objective: refused)
    # the sections of other objectives whose settings it reads too, under their names and meanings (RLOO: GRPO's
    # sampling, rewards and clipping); theirs that it does not honour its check refuses
    shares: tuple[str, ...] = ()
    rows_per_unit: int = 1  # planner: rows the model computes per unit of batch
    # planner: rows per unit the model scores without a graph before the step's first backward (KTO's KL rows)
    scored_rows_per_unit: Callable[[Any], int] = no_scored_rows
    frozen_reference: Callable[[Any], bool] = no_reference  # planner: a frozen copy of the model beside it
    sampling_rows: Callable[[Any, int], int] = no_sampling  # planner: rows a process samples at once between steps
    streams: bool = False  # trains on --dataset_streaming data (rows read as the steps need them)
    packs: bool = True  # packs rows into blocks when asked (--packing); False: rows padded per micro-batch, always
    pooled_tokenising: bool = True  # tokenises its data into the cache in --dataset_num_proc processes
    # TRL's --shuffle_dataset value it honours: SFT's / DPO's false (no shuffle before tokenising; the seeded sampler
    # shuffles every epoch), GRPO's true (its sampler's shuffle: the seeded prompt order of every epoch)
    trl_shuffle_dataset: bool = False
    reference_setting: str = ""  # the canonical key naming its reference model ("": the starting weights, or none)
    # TRL's --loss_type for an objective whose section has no loss_type setting: the names it trains (the first is
    # TRL's default), and those TRL has that it does not, with why
    loss_types: tuple[str, ...] = ()
    loss_types_not_built: tuple[tuple[str, str], ...] = ()
    # "module:function" (cfg, number of units, data-parallel size) -> optimizer steps per epoch, where an epoch is
    # not the units over the effective batch (GRPO: prompts, each sampled num_generations times); "": that
    epoch_steps: str = ""
    # whose defaults the settings its command leaves out take when the names used do not say (cookbook or trl), and
    # its own defaults per profile where they differ from that profile's shared ones (shardtune.config.defaults)
    home: str = "cookbook"
    defaults: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    # planner: ZeRO-3 gathers the whole model to sample (GRPO's ds3_gather_for_generation), else layer by layer
    sampling_gathers_whole: Callable[[Any], bool] = no_whole_gather
    # the Python face: "module:Class" of its TRL-shaped config (the dataclass a trainer without args makes); "": SFT's
    # its verb also trains a plug-in named there (shardtune sft --objective module:attribute)
    hosts_plugins: bool = False
    api_config: str = ""
    # what predict() returns (shardtune.api.prediction): "arrays", Trainer's predictions and label_ids (its
    # evaluation keeps them: Objective.predicts); "loss", the metrics alone (TRL's prediction_step returns the loss);
    # with prediction_refusal, neither: why (predict() and compute_metrics refused in one line)
    predictions: str = "arrays"
    prediction_refusal: str = ""
    # the head the model is trained with (shardtune.model.loading.MODEL_HEADS): "causal_lm", the output layer over the
    # vocabulary; "score", a sequence-classification head of one label built on the causal LM's weights (one scalar per
    # sequence, read at its last non-pad token: a reward model), written as AutoModelForSequenceClassification
    model_head: str = "causal_lm"
    # "module:Class" of the objective that trains it on a vision-language model (rows with images); "": the objective
    # trains text-only models, and a vision-language model is refused before launch
    vision_implementation: str = ""


OBJECTIVES = {
    "sft": Registration(
        "fine-tune a model (launches torchrun; see shardtune sft --help)",
        "shardtune.training.objectives.sft.objective:SFT",
        vision_implementation="shardtune.training.objectives.sft.vision:VisionSFT",
        hosts_plugins=True,
        streams=True,
        loss_types=("nll",),
        loss_types_not_built=(("dft", "Dynamic Fine-Tuning: each token's loss weighted by its probability"),),
        api_config="shardtune.api.configs:SFTConfig",
    ),
    "dpo": Registration(
        "preference training (DPO) on chosen / rejected pairs, same launcher and flags as sft (docs/dpo.md)",
        "shardtune.training.objectives.dpo.objective:DPO",
        settings="dpo",
        rows_per_unit=2,
        packs=False,  # a micro-batch's pairs are padded rows (or one padding-free row with --padding_free)
        frozen_reference=dpo_reference,
        reference_setting="dpo.ref_model",
        prediction_refusal="TRL 1.16's DPO predictions are each eval batch's chosen rows then its rejected rows "
        "(deprecated for TRL 2.0), an order set by the batch size and the number of processes, so metrics of them "
        "would differ by layout: not built; use evaluate() (rewards/*, logps/*, the same on any layout)",
        home="trl",
        defaults={"trl": {"optim.lr": 1e-6, "peft.lora.dropout": 0.0}},  # TRL's DPOConfig: disable_dropout true
        api_config="shardtune.api.configs:DPOConfig",
    ),
    "grpo": Registration(
        "online RL (GRPO): sample completions, score them with reward functions, same launcher (docs/grpo.md)",
        "shardtune.training.objectives.grpo.objective:GRPO",
        settings="grpo",
        packs=False,  # prompts and their sampled completions are padded per micro-batch
        frozen_reference=grpo_reference,
        sampling_rows=grpo_sampling_rows,
        pooled_tokenising=False,  # its prompts are tokenised whole, in each process: they are small
        trl_shuffle_dataset=True,
        epoch_steps="shardtune.training.objectives.grpo.batches:epoch_steps",
        sampling_gathers_whole=grpo_gathers_whole,
        predictions="loss",
        home="trl",
        # TRL's GRPOConfig (per_device_train_batch_size counts completions); under the cookbook's names it evaluates
        # only when asked (the cookbook's run_validation is on): sampling the test split is not a cheap default
        defaults={"trl": {"optim.lr": 1e-6}, "cookbook": {"eval.enabled": False}},
        api_config="shardtune.api.configs:GRPOConfig",
    ),
    "reward": Registration(
        "train a reward model (a one-label score head) on chosen / rejected pairs, same launcher (docs/reward.md)",
        "shardtune.training.objectives.reward.objective:Reward",
        settings="reward",
        rows_per_unit=2,  # a pair's chosen and rejected sequences; no reference model
        packs=False,  # a micro-batch's pairs are padded rows: the score is read at each row's last non-pad token
        prediction_refusal="TRL 1.16's reward predictions are each eval batch's chosen scores then its rejected "
        "scores, an order set by the batch size and the number of processes, so metrics of them would differ by "
        "layout: not built; use evaluate() (eval_accuracy, eval_margin, eval_*_reward: the same on any layout)",
        home="trl",
        # TRL's RewardConfig: learning_rate 1e-4, disable_dropout true
        defaults={"trl": {"optim.lr": 1e-4, "peft.lora.dropout": 0.0}},
        api_config="shardtune.api.reward:RewardConfig",
        model_head="score",
    ),
    "rloo": Registration(
        "online RL with the leave-one-out baseline (RLOO): GRPO's sampling and rewards, same launcher (docs/rloo.md)",
        "shardtune.training.objectives.grpo.rloo:RLOO",
        settings="rloo",
        shares=("grpo",),
        packs=False,
        frozen_reference=grpo_reference,
        sampling_rows=grpo_sampling_rows,
        pooled_tokenising=False,
        trl_shuffle_dataset=True,
        epoch_steps="shardtune.training.objectives.grpo.batches:epoch_steps",
        sampling_gathers_whole=grpo_gathers_whole,
        predictions="loss",
        home="trl",
        # TRL's RLOOConfig: num_generations 2 and beta 0.05 (GRPOConfig's: 8 and 0), under either defaults' names
        defaults={
            "trl": {"optim.lr": 1e-6, "grpo.num_generations": 2, "grpo.beta": 0.05},
            "cookbook": {"eval.enabled": False, "grpo.num_generations": 2, "grpo.beta": 0.05},
        },
        api_config="shardtune.api.rloo:RLOOConfig",
    ),
    "kto": Registration(
        "preference training on unpaired desirable / undesirable completions (KTO), same launcher (docs/kto.md)",
        "shardtune.training.objectives.kto.objective:KTO",
        settings="kto",
        shares=("dpo",),  # beta and the reference settings: DPO's names and meanings
        packs=False,  # a micro-batch's rows (and their KL rows) are padded rows
        frozen_reference=dpo_reference,
        scored_rows_per_unit=kto_kl_rows,
        reference_setting="dpo.ref_model",
        prediction_refusal="TRL 1.16's KTO predictions are logits recomputed by an extra forward (deprecated for "
        "TRL 2.0): not built; use evaluate() (eval_rewards/*, eval_logps/*, eval_kl: the same on any layout)",
        home="trl",
        # TRL's KTOConfig: learning_rate 1e-6, disable_dropout true, train_sampling_strategy sequential
        defaults={"trl": {"optim.lr": 1e-6, "peft.lora.dropout": 0.0, "data.sampling": "sequential"}},
        api_config="shardtune.api.kto:KTOConfig",
    ),
}


class ObjectiveError(ConfigError):
    """An objective name that is neither registered nor an importable ``module:attribute`` Registration."""


def register(name: str, registration: Registration) -> None:
    """Make ``registration`` the objective ``name`` in this process (a plug-in's own registry entry)."""
    if not isinstance(registration, Registration):
        raise ObjectiveError(f"objective {name}: a {type(registration).__name__} is not a Registration")
    OBJECTIVES[name] = registration


def registration(name: str) -> Registration:
    """The objective ``name``: a built-in or registered one, or a plug-in named ``module:attribute`` (a Registration
    importable in every process of the run: the launcher passes the name on to its workers), registered under that
    name on first use."""
    found = OBJECTIVES.get(name)
    if found is not None:
        return found
    module, colon, attribute = name.partition(":")
    if not colon or not module or not attribute:
        raise ObjectiveError(
            f"objective {name!r} is not known: choose one of {', '.join(OBJECTIVES)}, or name a plug-in's "
            "Registration as module:attribute"
        )
    try:
        found = getattr(importlib.import_module(module), attribute)
    except (ImportError, AttributeError) as e:
        raise ObjectiveError(
            f"objective {name}: {type(e).__name__}: {e}: make {module} importable (installed, or on PYTHONPATH in "
            f"every process) with a Registration named {attribute}"
        ) from None
    register(name, found)
    return found
