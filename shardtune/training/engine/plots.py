"""PNG charts of runs' metrics, several runs overlaid in each picture: what ``shardtune plot`` draws
(shardtune.commands.plot), and what every run writes into output_dir/plots at its end (``write_run_plots``).

Reads what training wrote: ``metrics.jsonl`` (shardtune), or llama-cookbook's ``metrics_data_*.json`` (its
train_step_loss / val_epoch_loss lists). Writes loss.png (raw and smoothed loss per optimizer step, eval loss as
markers on top), lr.png, tokens_per_s.png, mfu.png, memory.png, grad_norm.png (each when some run has the
numbers) and overview.png with all of them. Uses matplotlib's Agg backend: no display needed.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from pathlib import Path

from shardtune.training.engine.metrics import read_metrics

GIB = 1 << 30
LINE_STYLES = ("-", "--", "-.", ":")  # run i's style: runs that coincide (equivalent layouts) stay visible
COOKBOOK_PATTERN = "metrics_data_*.json"


@dataclass
class Run:
    name: str
    steps: list[dict] = field(default_factory=list)  # metrics.jsonl step rows (step, loss, lr, ...)
    evals: list[dict] = field(default_factory=list)  # rows with eval_loss


@dataclass(frozen=True)
class Panel:
    file: str
    title: str
    key: str
    ylabel: str
    scale: float = 1.0


PANELS = (
    Panel("lr.png", "learning rate", "lr", "lr"),
    Panel("tokens_per_s.png", "throughput", "tokens_per_s", "labelled tokens / s"),
    Panel("mfu.png", "model FLOPs utilisation (as computed)", "mfu", "MFU %", 100.0),
    Panel("memory.png", "peak memory (rank 0)", "peak_memory_bytes", "GiB", 1 / GIB),
    Panel("grad_norm.png", "gradient norm", "grad_norm", "global grad norm"),
)


def read_run(path: Path, name: str) -> Run:
    """A shardtune run directory (or metrics.jsonl), or a llama-cookbook metrics_data_*.json (or its folder)."""
    if path.is_dir():
        if (path / "metrics.jsonl").is_file():
            path = path / "metrics.jsonl"
        else:
            found = sorted(path.glob(COOKBOOK_PATTERN))
            if not found:
                raise ValueError(f"{path}: no metrics.jsonl or {COOKBOOK_PATTERN} in it: pass a run's output_dir")
            path = found[-1]
    if not path.is_file():
        raise ValueError(f"{path}: no such file or directory")
    if path.suffix == ".jsonl":
        rows = read_metrics(path)
        return Run(name, [r for r in rows if "loss" in r], [r for r in rows if "eval_loss" in r])
    return cookbook_run(json.loads(path.read_text(encoding="utf-8")), name, path)


def cookbook_run(data: dict, name: str, path: Path) -> Run:
    """llama-cookbook's save_to_json lists: a loss per training step; the eval loss at each epoch's end."""
    if not isinstance(data, dict) or "train_step_loss" not in data:
        raise ValueError(f"{path}: not a llama-cookbook metrics file (no train_step_loss): pass a metrics_data_*.json")
    losses = data["train_step_loss"]
    steps = [{"step": i + 1, "loss": loss} for i, loss in enumerate(losses)]
    eval_losses = data.get("val_epoch_loss") or []
    epochs = max(len(data.get("train_epoch_loss") or []), len(eval_losses), 1)
    per_epoch = len(losses) / epochs
    evals = [{"step": round(per_epoch * (i + 1)), "eval_loss": loss} for i, loss in enumerate(eval_losses)]
    return Run(name, steps, evals)


def run_names(paths: list[Path]) -> list[str]:
    """Each run's directory name; parent/name where two runs share a name."""
    names = [(p if p.is_dir() else p.parent).resolve().name or str(p) for p in paths]
    return [
        f"{(p if p.is_dir() else p.parent).resolve().parent.name}/{n}" if names.count(n) > 1 else n
        for p, n in zip(paths, names)
    ]


def smoothed(values: list[float], weight: float) -> list[float]:
    """Exponential moving average with bias correction (TensorBoard's smoothing), so the first points are not
    pulled towards zero."""
    out, average = [], 0.0
    for i, value in enumerate(values, start=1):
        average = weight * average + (1 - weight) * value
        out.append(average / (1 - weight**i) if weight < 1 else value)
    return out


def draw_loss(ax, runs: list[Run], smoothing: float) -> bool:
    for i, run in enumerate(runs):
        color = f"C{i}"
        steps = [r["step"] for r in run.steps]
        losses = [r["loss"] for r in run.steps]
        ax.plot(steps, losses, color=color, alpha=0.25, linewidth=0.8)
        ax.plot(
            steps,
            smoothed(losses, smoothing),
            color=color,
            linewidth=1.6,
            label=f"{run.name} (train)",
            linestyle=LINE_STYLES[i % len(LINE_STYLES)],
        )
        if run.evals:
            ax.plot(
                [r["step"] for r in run.evals],
                [r["eval_loss"] for r in run.evals],
                color=color,
                marker="o",
                linestyle="none",
                markersize=7 - 2 * (i % 2),
                markeredgecolor="black",
                label=f"{run.name} (eval)",
            )
    ax.set(title=f"loss (faint: raw; bold: smoothed {smoothing}; dots: eval)", xlabel="optimizer step", ylabel="loss")
    return any(run.steps for run in runs)


def draw_panel(ax, runs: list[Run], panel: Panel) -> bool:
    drawn = False
    for i, run in enumerate(runs):
        points = [(r["step"], r[panel.key] * panel.scale) for r in run.steps if r.get(panel.key) is not None]
        if points:
            ax.plot(
                *zip(*points),
                color=f"C{i}",
                linewidth=1.4,
                marker="." if len(points) < 50 else None,
                linestyle=LINE_STYLES[i % len(LINE_STYLES)],
                label=run.name,
            )
            drawn = True
    ax.set(title=panel.title, xlabel="optimizer step", ylabel=panel.ylabel)
    return drawn


def finish(ax, many: bool) -> None:
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(True, alpha=0.3)
    if many or ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize="small")


MARGINS = dict(left=0.14, right=0.97, top=0.91, bottom=0.12)  # room for tick labels like 1.0e-03, axis labels, title


def import_in_background() -> None:
    """Import matplotlib's pyplot (Agg) on a thread while the run trains, so that the charts a run writes at its end
    do not wait for the import (~0.3-0.7 s of a 2-core CPU). The import runs Python mostly while the training step
    runs torch's kernels (which release the GIL); a later import in the main thread waits for this one (the import
    lock) and then finds it done. Not a daemon: a run that fails at once exits after the import ends (a daemon thread
    frozen at the interpreter's exit while it holds an import lock deadlocks the exit). A failing import here is
    left for write_plots to raise."""

    def load() -> None:
        try:
            import matplotlib

            matplotlib.use("Agg")
            from matplotlib import pyplot  # noqa: F401
        except Exception:  # noqa: BLE001 (write_plots imports it again and raises there)
            pass

    threading.Thread(target=load, name="shardtune-plots-import").start()


def write_plots(runs: list[Run], out_dir: Path, smoothing: float = 0.6) -> list[Path]:
    """One PNG per chart with data, plus overview.png with all charts; returns the files written."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    charts = [("loss.png", lambda ax: draw_loss(ax, runs, smoothing))]
    charts += [(p.file, lambda ax, p=p: draw_panel(ax, runs, p)) for p in PANELS]
    for file, draw in charts:
        fig, ax = plt.subplots(figsize=(7, 4.2), dpi=100)
        if draw(ax):
            finish(ax, len(runs) > 1)
            fig.subplots_adjust(**MARGINS)  # fixed: tight_layout draws each figure once more to measure it
            fig.savefig(out_dir / file)
            written.append(out_dir / file)
        plt.close(fig)
    fig, axes = plt.subplots(2, 3, figsize=(16, 8.4), dpi=80)
    for ax, (_, draw) in zip(axes.flat, charts):
        if draw(ax):
            finish(ax, len(runs) > 1)
        else:
            ax.set_axis_off()
            ax.set_title(ax.get_title() + ": not logged")
    fig.suptitle(" vs ".join(run.name for run in runs))
    fig.subplots_adjust(left=0.05, right=0.985, top=0.9, bottom=0.07, hspace=0.38, wspace=0.24)
    fig.savefig(out_dir / "overview.png")
    plt.close(fig)
    return [*written, out_dir / "overview.png"]


def write_run_plots(run_dir: Path) -> Path:
    """The charts of one finished run, into RUN_DIR/plots (what `shardtune plot RUN_DIR` writes); returns the folder."""
    write_plots([read_run(run_dir, run_dir.name)], run_dir / "plots")
    return run_dir / "plots"
