"""The torchrun worker of ``shardtune sft``: one process of the run. It joins the process group, checks the
nodes, loads data and model, wraps them in the strategy, trains, and writes the outputs; any failure becomes one
line (the launcher prints the first failing rank's)."""

from __future__ import annotations

import json
import math
import os
import sys
import time
import traceback
from pathlib import Path

import torch
from torch.distributed.checkpoint.api import CheckpointException

from shardtune import data
from shardtune.accounting.memory import cross_node_summary
from shardtune.config.flags import to_yaml
from shardtune.config.schema import ConfigError, TrainConfig, effective_batch_size
from shardtune.data.chat import mirror_eos_token
from shardtune.model.freezing import apply_freezing
from shardtune.model.loading import count_parameters, load_tokenizer, model_head, name_pad_token
from shardtune.model.longseq import apply_memory_levers
from shardtune.model.loss import hf_model
from shardtune.model.peft import apply_peft, save_adapter
from shardtune.model.speed import apply_speed_features
from shardtune.parallel import make_strategy
from shardtune.parallel.dims import ParallelDims
from shardtune.parallel.sequence import SequenceGroups, use_sequence_attention
from shardtune.publishing.hub import HubUploadError, hub_repo_id, push_model
from shardtune.publishing.saving import save_hf_model
from shardtune.runtime import startup
from shardtune.runtime.distributed import (
    DistEnv,
    all_reduce_sum,
    barrier,
    broadcast_from_main,
    init_distributed,
    print0,
    seed_everything,
    shutdown,
)
from shardtune.runtime.errors import CheckpointError, TrainingStopped, fail
from shardtune.runtime.files import remove_stale_staging, write_text_atomic
from shardtune.runtime.preemption import (
    Preempted,
    install_worker_handlers,
    report_stopped,
)
from shardtune.runtime.run_lock import RunLock, RunLocked
from shardtune.training.engine.building import build_model
from shardtune.training.engine.checkpoint.checkpointer import Checkpointer, failure_reason
from shardtune.training.engine.checks import prepare
from shardtune.training.engine.intervals import every, planned_steps
from shardtune.training.engine.loop import TrainResult, train
from shardtune.training.engine.metrics import MetricsWriter
from shardtune.training.engine.objective import objective_class
from shardtune.training.engine.plots import import_in_background, write_run_plots
from shardtune.training.engine.preflight import PreflightError, run_preflight
from shardtune.training.engine.previous_run import set_previous_run_aside
from shardtune.training.engine.trackers import open_trackers


def check_finite_weights(
    state: dict[str, torch.Tensor] | None, env: DistEnv, cfg: TrainConfig, result: TrainResult
) -> None:
    """Collective: a model with a NaN / Inf weight is not published (an overflowing last step leaves a finite loss
    behind it, and --nan_policy skip carries on past non-finite steps). ``state`` is the gathered state dict on
    global rank 0 and None elsewhere (rank 0 judges; every rank joins the all-reduce)."""
    finite = state is None or all(bool(torch.isfinite(t).all()) for t in state.values() if t.is_floating_point())
    if int(all_reduce_sum(torch.tensor([0.0 if finite else 1.0]), env.device)[0]) == 0:
        return
    bad = next((i + 1 for i, loss in enumerate(result.losses) if not math.isfinite(loss)), None)
    when = (
        f"the loss became non-finite at step {bad}"
        if bad is not None
        else f"the loss was finite at every step (1-{result.steps}): an update overflowed, or a weight the data "
        "never reaches was not finite in the base model already"
    )
    raise TrainingStopped(
        f"the trained weights are not all finite, so no model was written to {cfg.output.dir}: "
        f"{when}; lower --lr (now {cfg.optim.lr}) or enable --gradient_clipping"
    )


def save_outputs(
    cfg: TrainConfig, env: DistEnv, strategy, model: torch.nn.Module, tokenizer, result: TrainResult
) -> list[str]:
    """Rank 0 writes the final model; the state is gathered by the strategy (nobody else materialises it). Returns
    the names of the model's files (on rank 0; [] elsewhere)."""
    written: list[str] = []
    if bool(cfg.peft.method):  # the adapter only: frozen base weights are neither gathered nor written
        adapter_state = strategy.trainable_state_dict(model)
        check_finite_weights(adapter_state, env, cfg, result)
        if env.is_main:
            written = save_adapter(
                strategy.unwrap(model), adapter_state, cfg.model.name, tokenizer, Path(cfg.output.dir)
            )
        barrier()
        return written
    state_dict = strategy.full_state_dict(model)
    check_finite_weights(state_dict, env, cfg, result)
    if env.is_main:
        written = save_hf_model(strategy.unwrap(model), state_dict, tokenizer, Path(cfg.output.dir))
    barrier()
    return written


def hold_output_dir(cfg: TrainConfig, env: DistEnv) -> RunLock | None:
    """Rank 0 takes output_dir's run lock (shardtune/runtime/run_lock.py) for the run's lifetime; every rank raises
    RunLocked when another run holds it."""
    lock = RunLock(Path(cfg.output.dir)) if env.is_main else None
    refused: str | None = None
    if lock is not None:
        try:
            note = lock.acquire()
            if note:
                print0(f"shardtune: {note}")
        except RunLocked as e:
            refused = str(e)
    refused = broadcast_from_main(refused)
    if refused:
        raise RunLocked(refused)
    return lock


def fine_tune(cfg: TrainConfig, env: DistEnv) -> TrainResult:
    lock = hold_output_dir(cfg, env)
    try:
        return _fine_tune(cfg, env)
    finally:
        if lock is not None:
            lock.release()


def _fine_tune(cfg: TrainConfig, env: DistEnv) -> TrainResult:
    seed_everything(cfg.train.seed)
    out_dir = Path(cfg.output.dir)
    if env.is_main:  # under the run lock: staging folders left here are a dead run's
        out_dir.mkdir(parents=True, exist_ok=True)
        remove_stale_staging(out_dir)
    set_previous_run_aside(cfg, env)  # collective: an ended run moved into previous/ (move_aside) before any write
    if env.is_main:
        write_text_atomic(out_dir / "config.yaml", to_yaml(cfg))
    if cfg.model.trust_remote_code:
        print0(f"trust_remote_code: running the model's own code from {cfg.model.name}")
    if cfg.output.push_to_hub:
        print0(f"push_to_hub: after the run, the model goes to the hub repo {hub_repo_id(cfg)}")
    tokenizer = data.apply_tokenizer_options(
        cfg, load_tokenizer(cfg.model.tokenizer or cfg.model.name, cfg.model.trust_remote_code)
    )
    strategy = make_strategy(cfg, env)
    objective = objective_class(cfg.objective, cfg)(cfg, env, strategy, tokenizer)
    units, eval_items = objective.load_data()
    startup.mark("tokenizer and data")
    model = build_model(cfg, env)
    startup.mark("model")
    name_pad_token(model, model_head(cfg), tokenizer)  # a score head reads each row at its last non-pad token
    mirror_eos_token(cfg, model, tokenizer)
    apply_freezing(model, cfg)
    apply_memory_levers(model, cfg, env.device)
    if bool(cfg.peft.method):
        model = apply_peft(model, cfg)
    apply_speed_features(model, cfg, env.device)
    if strategy.dims.sequence_split:
        groups = SequenceGroups.from_mesh(strategy.mesh, strategy.dims)
        print0(f"speed: {use_sequence_attention(hf_model(model), groups)}")
    num_params, num_trainable = count_parameters(model)
    model = strategy.wrap(model)
    startup.mark("levers, adapters, wrap")
    print0(describe_run(cfg, env, strategy, model, num_params, num_trainable))
    objective.attach(model, units, eval_items)  # DPO: its reference (placed, or its log-probabilities precomputed)
    saved_beside = objective.processing_class()  # the tokenizer, or a vision-language model's processor
    checkpointer = Checkpointer(cfg, env, strategy, saved_beside)
    metrics_path = out_dir / "metrics.jsonl" if env.is_main and cfg.logging.save_metrics else None
    total_steps = planned_steps(cfg, units, strategy.dims.dp_size)
    if metrics_path is not None and cfg.logging.save_plots and not cfg.eval.only:
        import_in_background()  # the charts written at the end
    append = metrics_path is not None and checkpointer.keep_metrics_rows(metrics_path, total_steps)
    writer = MetricsWriter(
        metrics_path,
        append=append,
        trackers=open_trackers(cfg) if env.is_main else (),
        tracker_every=every(cfg.logging.steps, total_steps),
    )
    published = False
    model_files: list[str] = []  # the published model's files (rank 0): what --push_to_hub uploads

    def publish(result: TrainResult) -> None:
        nonlocal published
        model_files.extend(save_outputs(cfg, env, strategy, model, saved_beside, result))
        published = True

    try:
        result = train(
            model, strategy, objective, units, writer, checkpointer, publish if cfg.output.save_model else None
        )
    except Exception:
        if published:
            print0(f"the trained model was written to {out_dir.resolve()} before this failure")
        raise
    finally:
        writer.close()
    barrier()  # metrics.jsonl is whole before any rank returns (a script's trainer reads it on every rank)
    if cfg.eval.only:
        print0(f"evaluated: eval loss {result.eval_loss:.4f} (--eval_only: nothing trained)")
        return result
    if metrics_path is not None and cfg.logging.save_plots:  # rank 0 (the only one with a metrics path)
        print0(f"charts: {write_run_plots(out_dir)}/ (loss, lr, grad norm, speed, memory)")
    print0(report(result, cfg))
    if cfg.output.push_to_hub and env.is_main and model_files:  # last: everything of the run is written
        print0(f"pushed to the hub: {push_model(cfg, model_files)}")
    return result


def describe_run(
    cfg: TrainConfig, env: DistEnv, strategy, model: torch.nn.Module, num_params: int, num_trainable: int
) -> str:
    """The start log's model, strategy and effective batch lines (and the cross-node traffic of a many-node run)."""
    quantized = ""
    if cfg.model.quantization == "4bit":
        qc = cfg.model
        quantized = f"; frozen base weights in 4-bit {qc.quant_type}{' (double quantised)' if qc.double_quant else ''}"
    elif cfg.model.quantization:
        quantized = "; frozen base weights in 8-bit"
    dp_size = strategy.dims.dp_size
    split = (
        f" ({env.world_size} processes / {env.world_size // dp_size} that split each row)"
        if strategy.dims.sequence_split
        else ""
    )
    lines = [
        f"model: {cfg.model.name} ({num_params:,} parameters, {num_trainable:,} trainable{quantized})",
        f"strategy: {strategy.describe()}",
        f"effective batch: {cfg.train.batch_size} per device x {dp_size} data-parallel devices{split} x "
        f"{cfg.train.gradient_accumulation_steps} accumulation = {effective_batch_size(cfg, dp_size)} "
        f"{'packed blocks' if cfg.data.batching == 'packing' else 'examples'} per step",
    ]
    if env.num_nodes > 1 and cfg.parallel.strategy != "deepspeed":
        lines.append(cross_node_traffic(cfg, env, model, strategy, num_params, num_trainable))
    return "\n".join(lines)


def cross_node_traffic(
    cfg: TrainConfig, env: DistEnv, model: torch.nn.Module, strategy, num_params: int, num_trainable: int
) -> str:
    """The formula of shardtune/accounting/memory.py with this run's sizes: all parameters are gathered in the compute
    dtype, trainable ones reduced in the dtype of the master weights."""
    master = next(p for p in model.parameters() if p.requires_grad)
    chosen = cfg.parallel.sharding_strategy if cfg.parallel.strategy == "fsdp" else "DDP"
    dims = ParallelDims.from_config(cfg, env.world_size, env.local_world_size)
    shard_group_size = dims.dp_shard * dims.cp * dims.sp if cfg.parallel.strategy == "fsdp" else 0
    return cross_node_summary(
        chosen,
        env.num_nodes,
        env.local_world_size,
        num_params=num_params,
        num_trainable=num_trainable,
        micro_batches=cfg.train.gradient_accumulation_steps,
        shard_group_size=shard_group_size,
        compute_bytes=strategy.compute_dtype.itemsize,
        grad_bytes=master.element_size(),
    )


def report(result: TrainResult, cfg: TrainConfig) -> str:
    lines = [
        f"done: {result.steps} steps, {result.label_tokens:,} label tokens in {result.train_time_s:.1f} s "
        f"({result.tokens_per_s:,.0f} tokens/s)"
    ]
    if result.losses:
        lines.append(f"  loss: first {result.losses[0]:.4f}, last {result.losses[-1]:.4f}")
    if result.eval_loss is not None:
        lines.append(f"  eval: loss {result.eval_loss:.4f}{result.eval_summary}")
    if cfg.output.save_model:
        lines.append(f"  model written to {Path(cfg.output.dir).resolve()}")
    return "\n".join(lines)


# Faults with a known fix, by exception class name.
KNOWN_FIXES = {
    "OutOfMemoryError": "lower --batch_size_training or --context_length, or shard with --enable_fsdp "
    "(and --fsdp_config.fsdp_activation_checkpointing true)"
}


def unexpected_error_line(e: BaseException, rank: int) -> str:
    """Where and what, in one line, with the fix when it is known; the traceback is for --debug."""
    what = failure_reason(e) if isinstance(e, CheckpointException) else (str(e).strip().splitlines() or [""])[0]
    fix = KNOWN_FIXES.get(type(e).__name__, "--debug prints the traceback")
    return f"rank {rank}: {type(e).__name__}: {what} ({fix})"


def record_worker_error(line: str) -> None:
    """Hand the line to torchrun's agent through its per-worker error file: shardtune's launcher prints the first
    failure's line once (launch.py), plain torchrun shows it in its failure summary. Without an agent (no error
    file), the line goes to stderr."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        print(f"shardtune: error: {line}", file=sys.stderr, flush=True)
        return
    with open(path, "w") as f:
        json.dump({"message": line, "timestamp": int(time.time())}, f)


def run_worker(cfg: TrainConfig, prepared: bool = False, exit_when_stopped: bool = False, reraise: bool = False) -> int:
    """One worker's run: its exit status. ``exit_when_stopped`` (a script's ``trainer.train()``): a run stopped by a
    signal (checkpoint written) raises SystemExit with the status the command would exit with, instead of
    returning it, so that the script's process ends as ``shardtune sft``'s would. ``reraise`` (a script's too): a
    fault no check foresaw — often the script's own code, a reward function or a callback — is raised again after
    the process group is left, with its traceback, instead of becoming one line."""
    install_worker_handlers()
    stopped: int | None = None
    fault: BaseException | None = None
    rank = int(os.environ["RANK"])
    try:
        if not prepared:  # the in-place run (one process) prepared it already
            prepare(cfg, int(os.environ["WORLD_SIZE"]))
    except ConfigError as e:
        if rank == 0:  # every rank finds the same problem; one line is enough
            fail(str(e), cfg.run.debug)
        return 2
    env = init_distributed(timeout_s=cfg.parallel.dist_timeout)
    startup.mark("process group")
    try:
        run_preflight(cfg, env)
        startup.mark("preflight")
        fine_tune(cfg, env)
    except PreflightError as e:  # found alike on every rank: one line per node
        if env.local_rank == 0:
            fail(str(e), cfg.run.debug)
        return 1
    except ConfigError as e:  # data errors found while loading
        fail(f"{e}" if env.world_size == 1 else f"(rank {env.rank}) {e}", cfg.run.debug)
        return 1
    except HubUploadError as e:  # rank 0's upload after the run, the model written: the launcher prints the line
        if cfg.run.debug:
            traceback.print_exc()
        record_worker_error(str(e))
        return 1
    except (CheckpointError, TrainingStopped, RunLocked) as e:  # raised on every rank alike
        if env.is_main:
            fail(str(e), cfg.run.debug)
        return 1
    except Preempted as e:  # every rank alike, after the checkpoint; 0 so that no agent restarts the workers
        if not report_stopped(e):
            print0(f"shardtune: {e}")
        # in place (no torchrun) this process is the job: its status is what SLURM requeues on
        stopped = 0 if "TORCHELASTIC_RUN_ID" in os.environ else e.status
        if not exit_when_stopped:
            return stopped
    except (Exception, CheckpointException) as e:  # a fault no check foresaw (torch.distributed.checkpoint's error
        # is a BaseException): one line, printed once by whoever launched the workers
        if cfg.run.debug:
            traceback.print_exc()
        if not reraise or os.environ.get("TORCHELASTIC_ERROR_FILE"):  # torchrun's summary line; raised: its traceback
            record_worker_error(unexpected_error_line(e, env.rank))
        if not reraise:
            return 1
        fault = e
    finally:
        shutdown()
    if fault is not None:
        raise fault
    if stopped is not None:  # a script's train(): the script ends here, as the command would (its later lines
        raise SystemExit(stopped)  # would use a model that was not trained to the end)
    return 0
