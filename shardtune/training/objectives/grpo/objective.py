"""The GRPO objective (TRL 1.16's GRPOTrainer) on the one engine: prompts, completions sampled with the weights being
trained (grpo_generate), scored by reward functions (rewards), group-normalised advantages, the clipped policy loss
(grpo_loss), with TRL's metrics.

A step's batches are made when the loop asks for them, after the previous step (:meth:`GRPO.batches`): a round's
completions are sampled, each rank sampling those of its own micro-batches (grpo_batches: which completions every
rank holds is defined globally and each completion's randomness is keyed by what it is), their rewards all-reduced
so that every rank computes the same advantages over the whole round, then the old policy's and the reference's
log-probabilities computed where the loss needs them. So 1 x 4, 2 x 2 and 1 x 1 x 4 (processes x batch x
accumulation) sample the same completions and train the same steps.
"""

from __future__ import annotations

import copy
import json
import math
from dataclasses import astuple, dataclass, field
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch import nn
from torch.profiler import record_function

from shardtune.accounting.flops import ModelShape, micro_batch_flops, num_input_tokens, palm_micro_batch_flops
from shardtune.config.schema import ConfigError
from shardtune.data.batching import EXAMPLE_IDS, EXAMPLE_LENGTHS
from shardtune.data.prompts import check_prompt_data, prompt_rows
from shardtune.data.shared_prompt import shared_layout
from shardtune.model.peft import adapter_disabled
from shardtune.model.shared_prompt import computed_rows
from shardtune.model.speed import apply_speed_features
from shardtune.runtime.distributed import all_reduce_sum, print0, warn0
from shardtune.training.engine.building import build_model
from shardtune.training.engine.intervals import planned_steps
from shardtune.training.engine.objective import COUNTS, Objective
from shardtune.training.objectives.grpo.advantages import (
    COMPLETION_METRICS,
    METRICS,
    advantages_of,
    completion_metrics,
)
from shardtune.training.objectives.grpo.batches import epoch_steps, prompt_order, round_plan, sampling_seed
from shardtune.training.objectives.grpo.evaluation import grpo_evaluate
from shardtune.training.objectives.grpo.generate import sample
from shardtune.training.objectives.grpo.loss import (
    REDUCTIONS,
    STATS,
    completion_targets,
    micro_batch_terms,
    token_logps,
)
from shardtune.training.objectives.grpo.rewards import load_rewards, score
from shardtune.training.objectives.grpo.rollouts import Rollouts, roll_out
from shardtune.training.objectives.grpo.tools import Toolbox, check_tokenizer, load_tools, toolbox

LOSS_METRICS = (
    "kl",
    "entropy",
    "clip_ratio/low_mean",
    "clip_ratio/low_min",
    "clip_ratio/high_mean",
    "clip_ratio/high_max",
    "clip_ratio/region_mean",
)
TOOL_METRICS = ("tools/call_frequency", "tools/failure_frequency")
TAIL = 4  # score_rows' columns after the rewards: the model's tokens, truncated, tool calls, failed calls


@dataclass
class Round:
    """A generation's micro-batches (this rank's, [slice][micro-batch]) and its metrics."""

    slices: list[list[dict]]
    metrics: dict[str, float] = field(default_factory=dict)


class GRPO(Objective):
    name = "grpo"
    count_names = (*COUNTS, "completions")  # normaliser: the loss type's N; label_tokens: scored completion tokens
    stat_names = STATS
    stat_reductions = REDUCTIONS
    step_metric_names = (*METRICS, *COMPLETION_METRICS, *LOSS_METRICS)
    eval_metric_names = tuple(f"eval_{k}" for k in ("loss", *METRICS, *COMPLETION_METRICS, "kl", "entropy"))
    kept: tuple[dict, Round] | None = None  # the round a checkpoint after the current step keeps (state_to_save)
    saved_round: dict | None = None  # the round the checkpoint resumed from kept
    steps_done = 0  # optimizer steps done once the current one is (an evaluation's global_step for rewards)
    toolbox: Toolbox | None = None  # with --tools: what sampling runs them with (attach)
    tools: list = []  # the tools' callables (load_data)
    model: nn.Module | None = None  # the trained model (attach)

    # -- before launch --------------------------------------------------------------------------------------------
    @classmethod
    def check(cls, cfg, world_size: int) -> None:
        """What shardtune grpo supports: DDP, FSDP and DeepSpeed ZeRO (with or without PEFT / QLoRA), generation with
        the trained model, padded micro-batches (docs/grpo.md)."""
        g = cfg.grpo
        if g.reward_weights and len(g.reward_weights) != len(g.reward_funcs):
            raise ConfigError(
                f"--reward_weights gives {len(g.reward_weights)} weights for {len(g.reward_funcs)} reward functions: "
                "give one per function"
            )
        refusals = (
            (cfg.data.streaming, "--dataset_streaming: prompts are read whole (they are small); drop the flag"),
            (cfg.data.padding_free, "--padding_free: GRPO's rows are padded per micro-batch; drop the flag"),
            (
                cfg.parallel.sequence_parallel_size > 1 or cfg.parallel.context_parallel_size > 1,
                "--sp_size / --cp_size: completions are sampled whole on each rank; drop the flag",
            ),
            (cfg.eval.log_samples, "--log_eval_samples: use --log_completions true; drop the flag"),
        )
        for refused, line in refusals:
            if refused:
                raise ConfigError(line)

    @classmethod
    def prepare_data(cls, cfg, tokenizer, dp_size: int) -> None:
        check_prompt_data(cfg)
        tools = load_tools(cfg.grpo.tools)
        if tools:
            check_tokenizer(tokenizer)
        for split in ("train", "validation") if cfg.eval.enabled else ("train",):
            rows, report = prompt_rows(cfg, tokenizer, split, tools)
            print(f"shardtune: data ({split}): {report.summary()}", flush=True)
        load_rewards(cfg.grpo.reward_funcs, load_models=False)
        epoch_steps(cfg, len(rows), dp_size)

    # -- in the worker --------------------------------------------------------------------------------------------
    def load_data(self) -> tuple[list, list]:
        """The training split's prompts, and the test split's when evaluating."""
        loaded = {}
        self.tools = load_tools(self.cfg.grpo.tools)
        for split in ("train", "validation") if self.cfg.eval.enabled else ("train",):
            loaded[split], report = prompt_rows(self.cfg, self.tokenizer, split, self.tools)
            print0(f"data ({split}): {report.summary()}")
        return loaded["train"], loaded.get("validation", [])

    def attach(self, model: nn.Module, units: list, eval_items: list) -> None:
        cfg, env = self.cfg, self.env
        self.model, self.eval_rows = model, eval_items
        self.plan = round_plan(cfg, self.strategy.dims.dp_size)
        self.rewards = load_rewards(cfg.grpo.reward_funcs, True, env.device)
        self.reward_names = [r.name for r in self.rewards]
        self.weights = torch.tensor(cfg.grpo.reward_weights or [1.0] * len(self.rewards), dtype=torch.float64)
        self.eos_ids = {self.tokenizer.eos_token_id}
        generation_eos = getattr(getattr(self.strategy.unwrap(model), "generation_config", None), "eos_token_id", None)
        self.eos_ids |= set(generation_eos if isinstance(generation_eos, list) else [generation_eos]) - {None}
        self.pending: dict[str, float] = {}
        context = getattr(self.strategy.unwrap(model).config, "max_position_embeddings", None) or 2**62
        self.toolbox = toolbox(cfg, self.tokenizer, self.tools, context)
        self.ref_model = self.peft_model = None
        if cfg.grpo.beta > 0:
            if bool(cfg.peft.method):
                self.peft_model = self.strategy.unwrap(model)
            else:
                frozen = build_model(copy.deepcopy(cfg), env).eval().requires_grad_(False)
                apply_speed_features(frozen, cfg, env.device, say=False)
                self.ref_model = self.strategy.place_frozen(frozen)
        self.step_metric_names = (
            *METRICS,
            *(f"rewards/{name}/{s}" for name in self.reward_names for s in ("mean", "std")),
            *COMPLETION_METRICS,
            *(TOOL_METRICS if self.toolbox is not None else ()),
            *(m for m in LOSS_METRICS if m != "kl" or cfg.grpo.beta != 0.0),
        )

    def batches(self, units: list, epoch: int, first: int, dp_rank: int, dp_size: int, row_slice=None):
        """Each step's micro-batches, a round's completions sampled when the round begins; a run resumed inside a
        round trains on the round its checkpoint kept (state_to_save), as the uninterrupted run does."""
        steps = epoch_steps(self.cfg, len(units), dp_size)
        order = prompt_order(len(units), self.cfg.train.seed, epoch)
        plan, current, made = self.plan, None, None
        total = planned_steps(self.cfg, units, dp_size)
        for s in range(first, steps):
            if epoch * steps + s >= total:  # the run's last step is done: no generation for a step never trained
                return
            r, w = divmod(s, plan.round_steps)
            if r != current:
                key = {"epoch": epoch, "round": r, "layout": [dp_rank, *astuple(plan)], "seed": self.cfg.train.seed}
                made = self.resumed_round(key, w) or self.make_round(
                    units, order, epoch, r, dp_rank, epoch * steps + s + 1
                )
                current = r
            self.pending, self.steps_done = made.metrics, epoch * steps + s + 1
            # a checkpoint after this step keeps the round when the next step trains on it too
            self.kept = (key, made) if s + 1 < steps and (s + 1) // plan.round_steps == r else None
            yield made.slices[w % plan.steps_per_generation]

    def state_to_save(self) -> dict | None:
        """The round the next step trains on, when a checkpoint falls inside it (num_iterations / generations of
        several steps): this rank's micro-batches with the old policy's and the reference's log-probabilities,
        sampled with weights a resumed run no longer has."""
        if self.kept is None:
            return None
        key, made = self.kept
        return {"key": key, "slices": made.slices, "metrics": made.metrics}

    def restore_state(self, state: dict | None) -> None:
        self.saved_round = state

    def resumed_round(self, key: dict, w: int) -> Round | None:
        """The round the checkpoint kept, for a run resumed inside it (step ``w`` of the round, w > 0) on the
        layout that saved it; else None (sampled again). Every rank decides alike (sampling is collective)."""
        saved, self.saved_round = self.saved_round, None
        if w == 0:
            return None
        fits = saved is not None and saved["key"] == key
        if all_reduce_sum(torch.tensor([0.0 if fits else 1.0], dtype=torch.float64), self.env.device)[0] == 0:
            return Round(saved["slices"], saved["metrics"])
        warn0(
            f"resumed at step {w + 1} of a generation the checkpoint did not keep for this layout (processes, batch, "
            "accumulation, seed): it is sampled again with the resumed weights, so the run differs from an "
            "uninterrupted one"
        )
        return None

    def make_round(self, units: list, order: list[int], epoch: int, r: int, dp_rank: int, step: int) -> Round:
        cfg, g, plan, device = self.cfg, self.cfg.grpo, self.plan, self.env.device
        prompts = order[r * plan.prompts_per_round : (r + 1) * plan.prompts_per_round]
        mine = plan.rank_completions(dp_rank)
        flat = [c for micro in mine for c in micro]
        rows = [units[prompts[c // plan.generations]] for c in flat]
        seeds = [
            sampling_seed(cfg.train.seed, epoch, r, row["index"], c % plan.generations) for row, c in zip(rows, flat)
        ]
        with record_function("grpo.sample"):
            sampled = self.sample_rows(self.model, rows, seeds, g)
        state = SimpleNamespace(global_step=step - 1, epoch=epoch)  # what TRL's trainer_state gives reward functions
        with record_function("grpo.score"):
            texts, local = self.score_rows(rows, sampled, state)
        total = plan.steps_per_generation * plan.completions_per_step
        truncated = local[:, len(self.rewards) + 1].tolist()
        counted = [not (g.mask_truncated_completions and t) for t in truncated]
        slices: list[list[dict]] = []
        at = 0
        for j in range(plan.steps_per_generation):
            micro_batches = []
            for m in range(plan.accumulation):
                part = range(at, at + len(mine[j * plan.accumulation + m]))
                batch = self.collate(
                    [rows[i]["prompt_ids"] for i in part],
                    [sampled.ids[i] for i in part],
                    [counted[i] for i in part],
                    torch.zeros(len(part)),  # the advantages, once the whole generation is scored (below)
                    [r * total + flat[i] for i in part],
                    None if sampled.masks is None else [sampled.masks[i] for i in part],
                )
                batch["completion_index"] = torch.tensor([flat[i] for i in part])
                batch["normaliser"] = self.normaliser(batch)
                micro_batches.append(batch)
                at += len(part)
            slices.append(micro_batches)
        with record_function("grpo.policy_logps"):
            self.add_policy_logps(slices)
            local = torch.cat([local, self.round_columns(slices)], dim=1)
        shared = torch.zeros(total, local.size(1), dtype=torch.float64)
        shared[torch.tensor(flat)] = local
        shared = all_reduce_sum(shared, device).cpu()  # every rank: the whole round's rewards, lengths, truncations
        advantages, metrics = self.generation_metrics(shared, g)
        for batch in (b for micro in slices for b in micro):
            batch["advantages"] = advantages[batch.pop("completion_index")].float()
        if g.log_completions or g.num_completions_to_print:
            self.log_completions(step, rows, texts, local[:, : len(self.rewards)])
        return Round(slices, metrics)

    def sample_rows(self, model: nn.Module, rows: list[dict], seeds: list[int], g) -> Rollouts:
        """One completion of each row's prompt, row i's from a generator seeded ``seeds[i]``, with ``g``'s sampling
        settings; with tools, the model's calls run and their results appended, turn by turn (rollouts.roll_out).
        Collective: every rank calls it alike."""

        def turn(prompts: list[list[int]], keys: list[int], budgets: list[int] | None = None) -> list[list[int]]:
            return sample(
                model,
                self.strategy,
                prompts,
                keys,
                max_new_tokens=g.max_completion_length,
                eos_ids=self.eos_ids,
                pad_id=self.pad_id,
                temperature=g.temperature,
                top_k=g.top_k,
                top_p=g.top_p,
                min_p=g.min_p,
                repetition_penalty=g.repetition_penalty,
                device=self.env.device,
                gather_whole=g.ds3_gather_for_generation,
                budgets=budgets,
            )

        first = turn([row["prompt_ids"] for row in rows], seeds)
        if self.toolbox is None:
            return Rollouts(first)
        return roll_out(self.toolbox, rows, first, seeds, turn, self.env.device)

    def score_rows(self, rows: list[dict], sampled: Rollouts, state) -> tuple[list[str], torch.Tensor]:
        """(the completions' texts, this rank's table: per completion its rewards (NaN: not scored), then TAIL: the
        model's tokens, 1.0 where it was cut at max_completion_length (no eos), its tool calls and failed calls),
        the reward functions called as TRL calls them."""
        ids = sampled.ids
        texts = self.tokenizer.batch_decode(ids, skip_special_tokens=True)
        conversational = isinstance(rows[0]["prompt"], list)
        completions: list = texts
        if sampled.messages is not None:
            completions = sampled.messages
        elif conversational:
            completions = [[{"role": "assistant", "content": t}] for t in texts]
        extras = {key: [row["extras"][key] for row in rows] for key in rows[0]["extras"]}
        device = self.env.device
        rewards = score(self.rewards, [row["prompt"] for row in rows], completions, ids, extras, state, device)
        ended = self.eos_ids | {self.pad_id}
        tokens = [len(x) for x in ids] if sampled.masks is None else [sum(m) for m in sampled.masks]
        tail = [
            [n, float(not x or x[-1] not in ended), calls, failures]
            for n, x, calls, failures in zip(tokens, ids, sampled.calls, sampled.failures)
        ]
        return texts, torch.cat([rewards, torch.tensor(tail, dtype=torch.float64).view(len(ids), TAIL)], dim=1)

    def generation_metrics(self, shared: torch.Tensor, g) -> tuple[torch.Tensor, dict[str, float]]:
        """The advantages and TRL's reward, completion and tool metrics of a whole generation's table (score_rows'
        tables of all ranks, with round_columns'), the rewards named by function."""
        n = len(self.rewards)
        advantages, metrics = advantages_of(shared[:, :n], self.weights, g)
        self.name_rewards(metrics)
        metrics.update(self.tail_metrics(shared[:, n : n + TAIL]))
        return advantages, metrics

    def name_rewards(self, metrics: dict[str, float]) -> None:
        """rewards/<index>/mean|std as rewards/<function's name>/mean|std."""
        for i, name in enumerate(self.reward_names):
            metrics[f"rewards/{name}/mean"] = metrics.pop(f"rewards/{i}/mean")
            metrics[f"rewards/{name}/std"] = metrics.pop(f"rewards/{i}/std")

    def tail_metrics(self, tail: torch.Tensor) -> dict[str, float]:
        """TRL's completions/* and, with tools, tools/call_frequency (calls per completion) and
        tools/failure_frequency (failed calls per call) of a generation."""
        metrics = completion_metrics(tail[:, 0], tail[:, 1])
        if self.toolbox is not None:
            calls = tail[:, 2].sum().item()
            metrics["tools/call_frequency"] = calls / tail.size(0)
            metrics["tools/failure_frequency"] = tail[:, 3].sum().item() / calls if calls else 0.0
        return metrics

    def round_columns(self, slices: list[list[dict]]) -> torch.Tensor:
        """Per completion of this rank (slices' order), what the generation's advantages need beyond its rewards,
        after the policy's and the reference's log-probabilities are in the batches (GRPO: nothing)."""
        rows = sum(b["input_ids"].size(0) for micro in slices for b in micro)
        return torch.zeros(rows, 0, dtype=torch.float64)

    def collate(self, prompts, completions, counted, advantages, ids, masks=None) -> dict:
        """Right-padded rows [prompt | completion | pad]: positions from 0, each row independent of the others;
        ``masks`` (tools): 0 where a completion's token is a tool result's, which carries no loss. Rows that share a
        prompt also come as one row per prompt (shardtune.model.shared_prompt: the model computes on it where it
        can)."""
        width = max(len(p) + len(c) for p, c in zip(prompts, completions))
        rows = len(prompts)
        input_ids = torch.full((rows, width), self.pad_id, dtype=torch.long)
        attention = torch.zeros((rows, width), dtype=torch.long)
        completion = torch.zeros((rows, width), dtype=torch.long)
        example_ids = torch.full((rows, width), -1, dtype=torch.long)
        lengths = torch.zeros((rows, width), dtype=torch.long)
        for i, (p, c) in enumerate(zip(prompts, completions)):
            n = len(p) + len(c)
            input_ids[i, :n] = torch.tensor(p + c)
            attention[i, :n] = 1
            if counted[i]:
                completion[i, len(p) : n] = 1 if masks is None else torch.tensor(masks[i], dtype=torch.long)
            example_ids[i, :n], lengths[i, :n] = ids[i], n
        return {
            "input_ids": input_ids,
            "attention_mask": attention,
            "position_ids": torch.arange(width).expand(rows, width).clone(),
            "completion_mask": completion,
            "advantages": advantages.float(),
            EXAMPLE_IDS: example_ids,
            EXAMPLE_LENGTHS: lengths,
            **shared_layout(prompts, completions, completion, self.pad_id),  # one copy of each shared prompt
        }

    def normaliser(self, batch: dict, round_tokens: int = 0) -> float:
        """This micro-batch's share of the step's N (shardtune.training.objectives.grpo.loss): summed over the step's
        micro-batches of all ranks it is N."""
        g = self.cfg.grpo
        if g.loss_type in ("dapo", "bnpo"):  # its tokens (dapo: spread over the round by spread_normalisers)
            return float(batch["completion_mask"].sum())
        rows = batch["input_ids"].size(0)
        return float(rows) if g.loss_type == "grpo" else float(rows * g.max_completion_length)

    def spread_normalisers(self, everything: list[dict]) -> None:
        """dapo: each micro-batch's N is the round's tokens of this rank / (k x its micro-batches)."""
        if self.cfg.grpo.loss_type == "dapo":
            tokens = sum(b["normaliser"] for b in everything)
            for b in everything:
                b["normaliser"] = tokens / len(everything)

    @torch.no_grad()
    def add_policy_logps(self, slices: list[list[dict]]) -> None:
        """The old policy's log-probabilities where the round's later steps need them (k x mu > 1: the weights move
        before its last step), and the reference's with beta > 0; the dapo normaliser spread over the round."""
        g, device = self.cfg.grpo, self.env.device
        everything = [b for micro in slices for b in micro]
        self.spread_normalisers(everything)
        if self.plan.round_steps > 1:
            for b in everything:
                with self.strategy.autocast():
                    b["old_logps"] = token_logps(self.model, b, device, g.temperature, False)[0].cpu()
        if g.beta > 0:
            for b in everything:
                self.add_reference(b)

    @torch.no_grad()
    def add_reference(self, batch: dict) -> None:
        """The reference's log-probabilities of the batch's completions (beta > 0): the frozen copy's, or the PEFT
        model's with its adapter off."""
        g, device = self.cfg.grpo, self.env.device
        with self.strategy.autocast():
            if self.ref_model is not None:
                ref = token_logps(self.ref_model, batch, device, g.temperature, False)[0]
            else:
                with adapter_disabled(self.peft_model):
                    ref = token_logps(self.model, batch, device, g.temperature, False)[0]
        batch["ref_logps"] = ref.cpu()

    def log_completions(self, step: int, rows: list[dict], texts: list[str], rewards: torch.Tensor) -> None:
        """The round's completions, all ranks', into completions.jsonl (rank 0) and the trackers, as eval samples
        go; the first num_completions_to_print printed."""
        mine = [
            {
                "prompt": row["prompt"] if isinstance(row["prompt"], str) else json.dumps(row["prompt"]),
                "prediction": text,
                "reference": json.dumps(dict(zip(self.reward_names, values))),
            }
            for row, text, values in zip(rows, texts, rewards.tolist())
        ]
        gathered = [None] * dist.get_world_size() if dist.is_initialized() else [mine]
        if dist.is_initialized():
            dist.all_gather_object(gathered, mine)
        samples = [s for part in gathered for s in part]
        if self.env.is_main and self.cfg.grpo.log_completions and self.writer is not None:
            self.writer.write_samples(samples, step, "completions.jsonl")
        for sample_row in samples[: self.cfg.grpo.num_completions_to_print]:
            print0(
                f"step {step}: {sample_row['prompt'][-80:]!r} -> {sample_row['prediction']!r} {sample_row['reference']}"
            )

    # -- the step -------------------------------------------------------------------------------------------------
    def counts(self, micro_batches: list[dict], shape: ModelShape | None) -> list[float]:
        """The loss type's N, scored tokens, input tokens, the training FLOPs (the sampling's forwards are not in
        mfu: it measures the training step's work), completions."""
        scored = [float((completion_targets(mb) != -100).sum()) for mb in micro_batches]
        flops = palm = 0
        if shape is not None:
            flops = sum(  # as computed: on the shared layout where the model takes it
                micro_batch_flops(shape, computed_rows(self.model, mb), int(n)) for mb, n in zip(micro_batches, scored)
            )
            palm = sum(palm_micro_batch_flops(shape, mb) for mb in micro_batches)
        return [
            sum(mb["normaliser"] for mb in micro_batches),
            sum(scored),
            sum(num_input_tokens(mb) for mb in micro_batches),
            flops,
            palm,
            sum(mb["input_ids"].size(0) for mb in micro_batches),
        ]

    def loss(self, model: nn.Module, batch: dict, totals: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        g, device = self.cfg.grpo, self.env.device
        logps, entropies = token_logps(model, batch, device, g.temperature, True)
        return self.terms(logps, entropies, batch, g)

    def terms(self, logps: torch.Tensor, entropies: torch.Tensor, batch: dict, g) -> tuple[torch.Tensor, torch.Tensor]:
        """(the micro-batch's loss sum, its STATS) from the policy's log-probabilities (training and evaluation)."""
        return micro_batch_terms(logps, entropies, batch, g, self.env.device)

    def step_metrics(self, totals: dict[str, float], stats: list[float]) -> dict[str, float]:
        g = self.cfg.grpo
        tokens, rows = max(totals["label_tokens"], 1.0), max(totals["completions"], 1.0)
        clip_over = rows if g.importance_sampling_level == "sequence" else tokens
        low, high = stats[6], stats[7]  # the step's minimum / maximum over all micro-batches and ranks
        out = {"loss": stats[0] / max(totals["normaliser"], 1e-12), **self.pending}
        if g.beta != 0.0:
            out["kl"] = stats[1] / tokens
        out["entropy"] = stats[2] / tokens
        out["clip_ratio/low_mean"] = stats[3] / clip_over
        out["clip_ratio/low_min"] = low if math.isfinite(low) else math.nan
        out["clip_ratio/high_mean"] = stats[4] / clip_over
        out["clip_ratio/high_max"] = high if math.isfinite(high) else math.nan
        out["clip_ratio/region_mean"] = stats[5] / clip_over
        return out

    def evaluate(self, model: nn.Module) -> tuple[dict[str, float], list[dict]]:
        """The test split's rewards and loss (shardtune.training.objectives.grpo.evaluation)."""
        return grpo_evaluate(self, model, self.eval_rows, self.steps_done), []

    def describe_eval(self, row: dict[str, float]) -> str:
        return f"eval reward {row['eval_reward']:.4f}, eval loss {row['eval_loss']:.4f}"

    def report_eval(self, row: dict[str, float]) -> str:
        return f", reward {row['eval_reward']:.4f}"
