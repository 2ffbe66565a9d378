"""Trackers: TensorBoard, Weights & Biases and trackio, fed the rows rank 0 writes to metrics.jsonl.

metrics.jsonl stays the source of truth; a tracker only receives the same numbers under TRL-style names
(``train/loss``, ``eval/loss``, ...). Each tracker package is an optional extra, imported only when asked for
(``--report_to``, ``--use_wandb``); a missing one is reported before launch (config.py).
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any, Protocol

from shardtune.config.flags import to_dict, to_yaml
from shardtune.config.schema import TrainConfig

# metrics.jsonl key -> tracker name; other numeric keys of a step row go under train/, of an eval row under eval/
TRACKER_NAMES = {
    "loss": "train/loss",
    "lr": "train/lr",
    "grad_norm": "train/grad_norm",
    "tokens_per_s": "train/tokens_per_s",
    "mfu": "train/mfu",
    "peak_memory_bytes": "train/peak_memory",
    "eval_loss": "eval/loss",
    "eval_ppl": "eval/ppl",
}
NOT_LOGGED = ("step", "skipped")


def tracker_scalars(row: dict[str, Any]) -> dict[str, float]:
    """The numbers of one metrics.jsonl row under tracker names (``eval_rouge1`` -> ``eval/rouge1``)."""
    prefix = "eval/" if any(key.startswith("eval_") for key in row) else "train/"
    out = {}
    for key, value in row.items():
        if key in NOT_LOGGED or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        out[TRACKER_NAMES.get(key) or prefix + key.removeprefix("eval_")] = float(value)
    return out


class Tracker(Protocol):
    def log(self, scalars: dict[str, float], step: int) -> None: ...
    def log_samples(self, samples: list[dict[str, str]], step: int) -> None: ...
    def close(self) -> None: ...


class TensorBoardTracker:
    """Event files in output_dir/tensorboard (``tensorboard --logdir OUTPUT_DIR``); the config as text."""

    def __init__(self, cfg: TrainConfig):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(Path(cfg.output.dir) / "tensorboard"))
        self.writer.add_text("config", "```yaml\n" + to_yaml(cfg) + "\n```", global_step=0)

    def log(self, scalars: dict[str, float], step: int) -> None:
        for name, value in scalars.items():
            self.writer.add_scalar(name, value, global_step=step)
        self.writer.flush()

    def log_samples(self, samples: list[dict[str, str]], step: int) -> None:
        columns = ("prompt", "prediction", "reference")
        cells = [[s[k].replace("|", "\\|").replace("\n", " ") for k in columns] for s in samples]
        table = "| prompt | prediction | reference |\n|---|---|---|\n" + "\n".join(
            "| " + " | ".join(row) + " |" for row in cells
        )
        self.writer.add_text("eval/samples", table, global_step=step)

    def close(self) -> None:
        self.writer.close()


def wandb_mode(cfg: TrainConfig) -> str:
    """--wandb_config.mode, or WANDB_MODE, or online when W&B is reachable and a key is known, else offline."""
    if cfg.logging.wandb.mode or os.environ.get("WANDB_MODE"):
        return cfg.logging.wandb.mode or os.environ["WANDB_MODE"]
    netrc = Path.home() / ".netrc"
    logged_in = bool(os.environ.get("WANDB_API_KEY")) or (netrc.is_file() and "api.wandb.ai" in netrc.read_text())
    if logged_in and reachable("api.wandb.ai", 443):
        return "online"
    from shardtune.runtime.distributed import print0

    print0(
        "wandb: offline ("
        + ("api.wandb.ai is not reachable" if logged_in else "not logged in")
        + f"): the run is kept in {Path(cfg.output.dir) / 'wandb'}; upload it later with wandb sync"
    )
    return "offline"


def reachable(host: str, port: int, timeout_s: float = 3.0) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


class WandbTracker:
    """A W&B run (llama-cookbook's wandb_config fields), offline when there is no network; the run's files go
    to output_dir/wandb."""

    def __init__(self, cfg: TrainConfig):
        import wandb

        wc = cfg.logging.wandb
        self.run = wandb.init(
            project=wc.project,
            entity=wc.entity or None,
            job_type=wc.job_type or None,
            tags=wc.tags or None,
            group=wc.group or None,
            notes=wc.notes or None,
            mode=wandb_mode(cfg),
            dir=str(Path(cfg.output.dir)),
            config=to_dict(cfg),
        )

    def log(self, scalars: dict[str, float], step: int) -> None:
        self.run.log(scalars, step=step)

    def log_samples(self, samples: list[dict[str, str]], step: int) -> None:
        import wandb

        columns = ["prompt", "prediction", "reference"]
        self.run.log(
            {"eval/samples": wandb.Table(columns=columns, data=[[s[c] for c in columns] for s in samples])}, step=step
        )

    def close(self) -> None:
        self.run.finish()


class TrackioTracker:
    """A trackio run (local by default; its own dashboard: trackio show)."""

    def __init__(self, cfg: TrainConfig):
        import trackio

        self.trackio = trackio
        trackio.init(project=cfg.logging.wandb.project, name=Path(cfg.output.dir).name, config=to_dict(cfg))

    def log(self, scalars: dict[str, float], step: int) -> None:
        self.trackio.log(scalars, step=step)

    def log_samples(self, samples: list[dict[str, str]], step: int) -> None:
        columns = ["prompt", "prediction", "reference"]
        self.trackio.log(
            {"eval/samples": self.trackio.Table(columns=columns, data=[[s[c] for c in columns] for s in samples])},
            step=step,
        )

    def close(self) -> None:
        self.trackio.finish()


TRACKERS = {"tensorboard": TensorBoardTracker, "wandb": WandbTracker, "trackio": TrackioTracker}


def open_trackers(cfg: TrainConfig) -> list[Tracker]:
    """The trackers of --report_to / --use_wandb, started (call on rank 0 only)."""
    return [TRACKERS[name](cfg) for name in cfg.logging.report_to]
