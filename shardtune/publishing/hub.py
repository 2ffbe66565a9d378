"""--push_to_hub: the published model folder (what ``from_pretrained`` loads: config, weights or adapter, tokenizer)
uploaded to a Hugging Face Hub repo through huggingface_hub, by rank 0, after everything of the run is written.

    check_push_to_hub(cfg, world_size)   # before launch: offline, or no token, is refused in one line
    push_model(cfg, files)               # after the run: create_repo(exist_ok) + upload_folder of those files
    check_can_upload / push_folder       # the same for any folder (shardtune export --push_to_hub ID)

An upload that fails after training leaves the run as it is (the model stays in output_dir) and says how to upload it
by hand.
"""

from __future__ import annotations

import os
from pathlib import Path

from shardtune.config.schema import ConfigError, TrainConfig


class HubUploadError(RuntimeError):
    """The upload after training failed (rank 0 only): one line with the model's folder and the command to upload it."""


def hub_repo_id(cfg: TrainConfig) -> str:
    """--hub_model_id, else output_dir's folder name (Trainer's default; the hub puts it in the token's namespace)."""
    return cfg.output.hub_model_id or Path(cfg.output.dir).resolve().name


def check_push_to_hub(cfg: TrainConfig, world_size: int = 0) -> None:
    """Before launch: an upload that cannot work is refused now, never after hours of training."""
    if not cfg.output.push_to_hub:
        given = [f"--{name}" for name in ("hub_model_id", "hub_private_repo", "hub_token") if getattr(cfg.output, name)]
        if given:
            raise ConfigError(f"{given[0]} only applies with --push_to_hub: add --push_to_hub, or drop {given[0]}")
        return
    if not cfg.output.save_model:
        raise ConfigError("--push_to_hub uploads the final model, but --save_model false writes none: drop one of them")
    check_can_upload(hub_repo_id(cfg), cfg.output.dir, cfg.output.hub_token)


def check_can_upload(repo_id: str, folder: str | Path, token: str = "", after: str = "after training") -> None:
    """Offline, or no token: the upload could not happen; one line, with how to upload by hand later."""
    by_hand = f"or drop --push_to_hub and upload later (hf upload {repo_id} {folder})"
    if os.environ.get("HF_HUB_OFFLINE", "") not in ("", "0"):
        raise ConfigError(
            f"--push_to_hub: HF_HUB_OFFLINE is set, so the upload {after} could not happen: "
            f"unset HF_HUB_OFFLINE, {by_hand}"
        )
    from huggingface_hub import get_token

    if not token and get_token() is None:
        raise ConfigError(
            f"--push_to_hub: no Hugging Face token (none in HF_TOKEN, none saved by hf auth login): "
            f"log in with hf auth login, set HF_TOKEN or pass --hub_token, {by_hand}"
        )


def push_model(cfg: TrainConfig, files: list[str]) -> str:
    """Upload ``files`` (names in output_dir: the published model) to the hub repo; returns the commit's URL."""
    return push_folder(Path(cfg.output.dir), hub_repo_id(cfg), files, cfg.output.hub_private_repo, cfg.output.hub_token)


def push_folder(folder: Path, repo_id: str, files: list[str], private: bool = False, token: str = "") -> str:
    """create_repo (exist_ok) + upload_folder of ``files`` (names in ``folder``); returns the commit's URL."""
    from huggingface_hub import HfApi

    out_dir = folder.resolve()
    try:
        api = HfApi(token=token or None)
        repo_id = api.create_repo(repo_id, private=True if private else None, exist_ok=True).repo_id
        commit = api.upload_folder(
            repo_id=repo_id,
            folder_path=out_dir,
            allow_patterns=sorted(files),
            commit_message="Upload model trained with shardtune",
        )
    except Exception as e:  # noqa: BLE001 - network, auth, permissions, quota: the same way out for the user
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0].rstrip(".")
        raise HubUploadError(
            f"--push_to_hub: uploading to {repo_id} failed ({reason}); the trained model is "
            f"unharmed in {out_dir}: upload it by hand with hf upload {repo_id} {out_dir}"
        ) from None
    return commit.commit_url
