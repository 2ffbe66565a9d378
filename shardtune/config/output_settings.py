"""The output group of the canonical config (shardtune.config.schema): where the run writes, what it does with an
earlier run found there, and the upload to the hub."""

from __future__ import annotations

from dataclasses import dataclass

from shardtune.config.setting import RUN, setting

# What a new run does with an ended run (finished or failed) found in output.dir (docs/checkpoints.md)
PREVIOUS_RUN = ("refuse", "move_aside")
PREVIOUS_FOLDER = "previous"  # output.dir/previous/<UTC time>/: where move_aside puts an earlier run


@dataclass
class OutputSettings:
    dir: str = setting("output", "where the model, config.yaml and metrics.jsonl are written", **RUN)
    overwrite: bool = setting(False, "allow a new run to replace the outputs of a previous run in output.dir", **RUN)
    previous_run: str = setting(
        "refuse",
        "what a new run does with an ended run found in output.dir: refuse (before launch, with the fixes), or "
        "move_aside (rank 0 renames all of it into output.dir/previous/<UTC time>/ before writing anything; what "
        "shardtune's Python trainers do, as TRL's have no overwrite_output_dir). A resumed run continues its run "
        "and moves nothing; overwrite true writes over it",
        choices=PREVIOUS_RUN,
        **RUN,
    )
    save_model: bool = setting(True, "write the final model (or adapter) to output.dir", **RUN)
    push_to_hub: bool = setting(
        False,
        "after the run, upload the published model (or adapter) folder to the Hugging "
        "Face Hub repo hub_model_id (rank 0, through huggingface_hub); refused before "
        "launch when offline or without a token",
        **RUN,
    )
    hub_model_id: str = setting(
        "",
        "the push_to_hub repo (user/name or name); empty: output.dir's folder name, in your namespace (as Trainer)",
        **RUN,
    )
    hub_private_repo: bool = setting(
        False, "create the push_to_hub repo private (an existing repo keeps its visibility)", **RUN
    )
    hub_token: str = setting(
        "",
        "the push_to_hub token; empty: huggingface_hub's (HF_TOKEN or hf auth login); never written to config.yaml",
        secret=True,
        **RUN,
    )
