"""``shardtune export CHECKPOINT OUT``: a training checkpoint (any world size, any strategy) as a Hugging Face
model directory (or a PEFT adapter directory, for an adapter checkpoint), in one process, without GPUs and
without a process group.

The checkpoint records what it came from (hf_config/: the source model's config.json and tokenizer;
config.yaml: the training config), so the model is rebuilt from that and the checkpoint's tensors are read
into it with torch.distributed.checkpoint, which reassembles the shards of every rank. Weights are written in
the source model's dtype (its config.json), not in the fp32 of the master weights, unless --dtype says so.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
import yaml
from transformers import AutoConfig, AutoTokenizer
from transformers.utils import logging as hf_logging

from shardtune.config.flags import from_dict
from shardtune.config.schema import ConfigError
from shardtune.model.attention import attention_implementation
from shardtune.model.loading import auto_model_class, load_model, model_head
from shardtune.model.vision import saved_processor
from shardtune.publishing.hub import HubUploadError, check_can_upload, push_folder
from shardtune.publishing.saving import save_hf_model
from shardtune.runtime.checkpoint_reader import (
    SafeFileSystemReader,
    UnsafeCheckpointError,
)
from shardtune.training.engine.checkpoint.layout import read_trainer_state, resolve_checkpoint

DTYPES = {"auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def source_dtype(config) -> torch.dtype:
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    return dtype if isinstance(dtype, torch.dtype) else torch.float32


def export_checkpoint(checkpoint: str | Path, out_dir: str | Path, dtype: str = "auto") -> tuple[Path, list[str]]:
    """Write the model held by ``checkpoint`` (a step folder, or an output dir: its latest) to ``out_dir``. Returns
    (the checkpoint read, the files written)."""
    notes: list[str] = []
    path = resolve_checkpoint(str(checkpoint), Path(checkpoint).parent.parent, notes=notes, resume=False)
    for note in notes:
        print(f"shardtune: warning: {note}", file=sys.stderr)
    state = read_trainer_state(path)
    cfg = from_dict(yaml.safe_load((path / "config.yaml").read_text(encoding="utf-8")))
    trust = {"trust_remote_code": cfg.model.trust_remote_code}  # as the run did: recorded in its config.yaml
    config = AutoConfig.from_pretrained(path / "hf_config", **trust)
    target = DTYPES[dtype] or source_dtype(config)
    head = model_head(cfg)  # the objective's: a reward model's checkpoint is a sequence-classification model
    model = auto_model_class(head).from_config(
        config, dtype=torch.float32, attn_implementation=attention_implementation(config), **trust
    )
    # the run's processing class: a vision-language model's processor, else its tokenizer
    tokenizer = saved_processor(path / "hf_config", cfg.model.trust_remote_code) or AutoTokenizer.from_pretrained(
        path / "hf_config", **trust
    )
    if state.get("strategy") == "deepspeed":
        read = _deepspeed_reader(path)
        stored = {f"model.{k}" for k in read()}
    else:
        stored = set(SafeFileSystemReader(str(path)).read_metadata().state_dict_metadata)

        def read(into: dict[str, torch.Tensor]) -> None:  # this one process reads every shard
            dcp.load({"model": into}, storage_reader=SafeFileSystemReader(str(path)), no_dist=True)

    if state.get("adapter_only"):  # the base weights do not matter: only the adapter is read and written
        from shardtune.model.peft import apply_peft, save_adapter

        cfg.model.quantization, cfg.peft.from_checkpoint = "", ""
        model = apply_peft(model, cfg)
        adapter = {k: v for k, v in model.state_dict().items() if f"model.{k}" in stored}
        read(adapter)
        trainable = {k: p.detach() for k, p in model.named_parameters() if p.requires_grad}
        return path, save_adapter(model, trainable, cfg.model.name, tokenizer, Path(out_dir))
    wanted = {k: v for k, v in model.state_dict().items() if f"model.{k}" in stored}
    missing = sorted(k for k, _ in model.named_parameters() if k not in wanted)
    if missing:  # frozen parameters are not in checkpoints: they come from the base model
        if not Path(cfg.model.name).is_dir():
            raise ConfigError(
                f"{path} does not hold {missing[0]} (and {len(missing) - 1} more frozen tensors), and "
                f"the base model {cfg.model.name} is not here: export on a machine that has it"
            )
        model.load_state_dict(load_model(cfg.model.name, config=config, head=head, **trust).state_dict())
    read(wanted)
    model.config.dtype = target
    return path, save_hf_model(model, model.state_dict(), tokenizer, Path(out_dir))


def check_out_dir(out_dir: Path, overwrite: bool) -> None:
    """Never write over files by accident: OUT_DIR must be new or empty, unless --overwrite."""
    if out_dir.exists() and not out_dir.is_dir():
        raise ConfigError(f"{out_dir} is a file, not a directory: pass a directory to write the model into")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not overwrite:
        raise ConfigError(f"{out_dir} is not empty: pass a new or empty directory, or --overwrite to write into it")


def _deepspeed_reader(path: Path):
    """DeepSpeed ZeRO partitions consolidated into fp32 tensors (DeepSpeed's zero_to_fp32, one CPU process).
    Returns read(): with no argument the consolidated state dict, with a dict the same tensors copied into it."""
    from shardtune.parallel.deepspeed import DEEPSPEED_TAG, import_deepspeed

    import_deepspeed()
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    consolidated = get_fp32_state_dict_from_zero_checkpoint(str(path), tag=DEEPSPEED_TAG)

    def read(into: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        if into is not None:
            for name, tensor in into.items():
                tensor.copy_(consolidated[name])
        return consolidated

    return read


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="shardtune export", description=__doc__.splitlines()[0])
    parser.add_argument(
        "checkpoint",
        help="a checkpoint folder (output_dir/checkpoints/step-NNNNNN) or an output dir (its latest checkpoint)",
    )
    parser.add_argument("out_dir", help="directory to write the Hugging Face model into")
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=sorted(DTYPES),
        help="dtype of the written weights; auto: the source model's (its config.json)",
    )
    parser.add_argument(
        "--merge",
        action="store_true",
        help="the first argument is a LoRA adapter directory: write base + adapter merged (merge_and_unload)",
    )
    parser.add_argument(
        "--base", default="", help="with --merge: the base model (default: the adapter's base_model_name_or_path)"
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="write into OUT_DIR even when it already holds files (a model there is replaced)",
    )
    parser.add_argument(
        "--push_to_hub",
        default="",
        metavar="ID",
        help="then upload the model written to the hub repo ID (user/name), through huggingface_hub",
    )
    parser.add_argument("--hub_private_repo", action="store_true", help="create the --push_to_hub repo private")
    parser.add_argument(
        "--trust_remote_code",
        action="store_true",
        help="with --merge: run the base model's own code (auto_map): docs/security.md",
    )
    args = parser.parse_args(argv)
    hf_logging.disable_progress_bar()
    try:
        check_out_dir(Path(args.out_dir), args.overwrite)
        if args.base and not args.merge:
            raise ConfigError("--base only applies with --merge ADAPTER_DIR OUT_DIR: add --merge, or drop --base")
        if args.hub_private_repo and not args.push_to_hub:
            raise ConfigError("--hub_private_repo only applies with --push_to_hub ID: add it, or drop the flag")
        if args.push_to_hub:  # before anything is written: an upload that cannot happen is refused now
            check_can_upload(args.push_to_hub, args.out_dir, after="after the export")
        if args.merge:
            from shardtune.model.peft import merge_adapter

            base, files = merge_adapter(
                args.checkpoint, args.out_dir, args.base, DTYPES[args.dtype], args.trust_remote_code
            )
            print(f"merged {args.checkpoint} into {base}, written to {Path(args.out_dir).resolve()}")
        else:
            if args.trust_remote_code:
                raise ConfigError(
                    "--trust_remote_code applies with --merge; a checkpoint's export runs the model's "
                    "own code when its run did (its config.yaml says so): drop the flag"
                )
            path, files = export_checkpoint(args.checkpoint, args.out_dir, args.dtype)
            print(f"exported {path} to {Path(args.out_dir).resolve()}")
    except ConfigError as e:
        print(f"shardtune: error: {e}", file=sys.stderr)
        return 2
    except UnsafeCheckpointError as e:
        print(f"shardtune: error: {args.checkpoint}: {e}", file=sys.stderr)
        return 1
    if args.push_to_hub:
        try:
            url = push_folder(Path(args.out_dir), args.push_to_hub, files, args.hub_private_repo)
            print(f"pushed to the hub: {url}")
        except HubUploadError as e:
            print(f"shardtune: error: {e}", file=sys.stderr)
            return 1
    return 0
