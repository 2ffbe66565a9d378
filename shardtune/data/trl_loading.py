"""``--dataset_name`` (TRL's data flags): load with ``datasets.load_dataset``, recognise the format, tokenise.

A local file (JSON, JSONL, CSV, Parquet, Arrow) is the train split; a local folder or a hub id is loaded as
``datasets`` lays it out (a folder's splits come from its file names: train.jsonl, test.jsonl ...). The
evaluation split is ``--dataset_test_split``; when the data has no such split, training runs without evaluation
(said once, before launch), or, when the command asked for evaluation, is refused. The embedded synthetic
dialogues with ``--synthetic_dialogues.messages true`` go through the same formats code as conversational rows.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from shardtune.config.schema import ConfigError, TrainConfig, TrlDatasetConfig
from shardtune.data.aside import build_aside
from shardtune.data.chat import check_chat_template
from shardtune.data.emptiness import empty_file, empty_split, refuse_empty_files
from shardtune.data.files import Row
from shardtune.data.mixture import check_mixture, mixture_rows, without_evaluation
from shardtune.data.packing import row_limit
from shardtune.data.report import DataError, DataReport, RowFilter
from shardtune.data.stream_rows import has_split
from shardtune.data.tokenising import Preparation
from shardtune.data.trl_formats import LossOptions, RowFormat, check_options, prepare_rows, recognise, with_extras

BUILDERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet", ".arrow": "arrow"}
SYNTHETIC_SYSTEM_PROMPT = "Summarize the dialog."
NO_DATA = re.compile(r'Instruction "([^"]+)" corresponds to no data')  # datasets' words for a split without a row


def uses_trl_formats(cfg: TrainConfig) -> bool:
    """The datasets whose rows go through TRL's formats (and so read the --dataset_name options)."""
    return cfg.data.dataset == "trl_dataset" or (
        cfg.data.dataset == "synthetic_dialogues" and cfg.data.synthetic_dialogues.messages
    )


def check_trl_config(cfg: TrainConfig) -> None:
    """Before launch, without a tokenizer: the data exists and no option is set where it would be ignored."""
    tc, defaults = cfg.data.trl_dataset, TrlDatasetConfig()
    if cfg.data.dataset != "trl_dataset" and tc.dataset_name:
        raise ConfigError(
            f"--dataset_name {tc.dataset_name} and --dataset {cfg.data.dataset} both name the data: drop one of them"
        )
    if not uses_trl_formats(cfg):
        changed = [k for k in vars(defaults) if getattr(tc, k) != getattr(defaults, k)]
        if changed:
            raise ConfigError(
                f"--{changed[0]} {getattr(tc, changed[0])} has no effect with --dataset {cfg.data.dataset}: "
                "use --dataset_name (or --synthetic_dialogues.messages true), or drop the flag"
            )
        return
    if cfg.data.dataset == "trl_dataset" and tc.dataset_mixture:
        return check_mixture(cfg)
    if cfg.data.dataset == "trl_dataset":
        if not tc.dataset_name:
            raise ConfigError("--dataset trl_dataset needs --dataset_name: a local data file or folder, or a hub id")
        path = Path(tc.dataset_name).expanduser()
        if path.is_file() and path.suffix.lower() not in BUILDERS:
            raise DataError(
                f"--dataset_name {tc.dataset_name}: unknown format {path.suffix!r}: pass a "
                f"{', '.join(BUILDERS)} file or a folder of them"
            )
        if not path.exists() and (tc.dataset_name.startswith(("/", ".", "~")) or path.suffix.lower() in BUILDERS):
            raise DataError(f"--dataset_name {tc.dataset_name}: no such file or folder")
        if path.exists():  # a file or split without a row: said now, before anything else is made of the data
            refuse_empty_files(tc.dataset_name)


def loss_options(cfg: TrainConfig) -> LossOptions:
    tc = cfg.data.trl_dataset
    return LossOptions(
        text_field=tc.dataset_text_field,
        completion_only_loss=tc.completion_only_loss,
        assistant_only_loss=tc.assistant_only_loss,
        max_length=row_limit(cfg),  # bfd_split / wrapped split long rows: none is cut
        truncation_mode=tc.truncation_mode,
    )


@functools.lru_cache(maxsize=4)
def _load(name: str, config: str) -> Any:
    """The DatasetDict of ``name`` (loaded once per process)."""
    import datasets

    path = Path(name).expanduser()
    if path.exists():  # an empty file or split said as such, before datasets fails on it in its own words
        refuse_empty_files(name)
    if path.is_file():
        load = functools.partial(datasets.load_dataset, BUILDERS[path.suffix.lower()], data_files={"train": str(path)})
    elif (beside_images := _data_files_beside_images(path) if path.is_dir() else None) is not None:
        load = functools.partial(datasets.load_dataset, beside_images[0], data_files=beside_images[1])
    else:
        load = functools.partial(datasets.load_dataset, str(path) if path.is_dir() else name, name=config or None)
    build_aside(load)  # the Arrow cache built in a child: this process (the launcher) keeps none of the parsing
    try:
        return load()
    except Exception as e:  # network, authentication, missing dataset, unreadable files: one line with the fix
        where = "local data" if path.exists() else "the Hugging Face hub (offline? HF_DATASETS_OFFLINE set?)"
        reason = (str(e).strip().splitlines() or [""])[0]
        empty = NO_DATA.search(reason)  # a split datasets read no row from (rows of {} too; a hub dataset's)
        if empty and path.is_file():
            raise empty_file(name) from e
        if empty:
            flags = "--dataset_train_split / --dataset_test_split"
            raise empty_split(f"--dataset_name {name} split {empty[1]!r}", flags) from e
        raise DataError(
            f"--dataset_name {name}: could not be loaded from {where} ({type(e).__name__}: {reason}): "
            "pass a local JSON / JSONL / CSV / Parquet / Arrow file or folder, or a reachable hub id"
        ) from e


IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".gif")
SPLIT_STEMS = {"train": "train", "test": "test", "validation": "validation", "valid": "validation", "dev": "validation"}


def _data_files_beside_images(folder: Path) -> tuple[str, dict[str, str]] | None:
    """(builder, {split: file}) for a folder whose data files (train.jsonl, test.jsonl ...) sit at its top beside
    image files they name: ``datasets`` would read such a folder as an image folder (its rows the images alone).
    None for any other folder (``datasets`` lays it out)."""
    files = [f for f in sorted(folder.iterdir()) if f.is_file() and f.suffix.lower() in BUILDERS]
    builders = {BUILDERS[f.suffix.lower()] for f in files}
    if not files or len(builders) != 1 or not any(p.suffix.lower() in IMAGE_SUFFIXES for p in folder.rglob("*")):
        return None
    splits = {SPLIT_STEMS[f.stem.lower()]: str(f) for f in files if f.stem.lower() in SPLIT_STEMS}
    return (builders.pop(), splits) if splits else None


def _split_name(cfg: TrainConfig, split: str) -> str:
    tc = cfg.data.trl_dataset
    return tc.dataset_train_split if split == "train" else tc.dataset_test_split


def validation_available(cfg: TrainConfig) -> bool:
    """False when the data has no --dataset_test_split (then there is no evaluation)."""
    if cfg.data.dataset != "trl_dataset":
        return True
    if cfg.data.trl_dataset.dataset_mixture:  # TRL's mixture has a test split only with test_split_size (not built)
        return False
    if cfg.data.streaming:  # nothing loaded before launch: the split's files are listed
        return has_split(cfg, cfg.data.trl_dataset.dataset_test_split)
    return cfg.data.trl_dataset.dataset_test_split in _load(
        cfg.data.trl_dataset.dataset_name, cfg.data.trl_dataset.dataset_config
    )


def _dataset_rows(cfg: TrainConfig, split: str, images: bool = False) -> tuple[str, list[Row], list[str]]:
    """(source, rows, columns) of a split; a split with an image column is refused unless ``images`` (the rows a
    vision-language model reads: :func:`vision_rows`), rather than trained on with its images left out."""
    tc = cfg.data.trl_dataset
    loaded = _load(tc.dataset_name, tc.dataset_config)
    name = _split_name(cfg, split)
    if name not in loaded:
        flag = "--dataset_train_split" if split == "train" else "--dataset_test_split"
        raise DataError(
            f"--dataset_name {tc.dataset_name} has no split {name!r} (it has: {', '.join(loaded)}): pass {flag}"
        )
    path = Path(tc.dataset_name).expanduser()
    origin = str(path) if path.is_file() else f"{tc.dataset_name} split {name}"
    columns = list(loaded[name].column_names)
    if not images:
        refuse_images(cfg, f"{tc.dataset_name} split {name}", columns)
    return f"{tc.dataset_name} split {name}", ArrowRows(loaded[name], origin), columns


def refuse_images(cfg: TrainConfig, source: str, columns: Sequence[str]) -> None:
    """Rows with images for a text-only run: what they need instead, in one line (TRL's vision SFT needs a
    vision-language model; its vision DPO and the other objectives with images are not built here)."""
    from shardtune.config.objectives import registration
    from shardtune.data.vision import IMAGE_COLUMNS

    column = next((c for c in IMAGE_COLUMNS if c in columns), None)
    if column is None:
        return
    if registration(cfg.objective).vision_implementation:
        raise DataError(
            f"{source} has an {column!r} column, but {cfg.model.name or 'the model'} is a text-only model (its config "
            "has no vision_config): pass a vision-language model (docs/vision.md), or drop the column"
        )
    raise DataError(
        f"{source} has an {column!r} column: shardtune {cfg.objective} with images (TRL's vision "
        f"{cfg.objective.upper()} rows) is not built, images train with shardtune sft on a vision-language model "
        "(docs/vision.md): drop the column, or train with shardtune sft"
    )


class ArrowRows(Sequence):
    """A loaded split's rows as ``(origin, line, row)``, read from its Arrow table a slice at a time (rows are
    tokenised a chunk at a time): the process never holds the corpus as Python objects, only the slice it reads."""

    SLICE = 1024

    def __init__(self, dataset: Any, origin: str) -> None:
        self.dataset, self.origin = dataset, origin

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index):
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self))
            if step != 1:
                return [self[i] for i in range(start, stop, step)]
            if start >= stop:
                return []
            columns = self.dataset[start:stop]
            values = zip(*columns.values()) if columns else iter(())
            return [(self.origin, start + 1 + i, dict(zip(columns, row))) for i, row in enumerate(values)]
        i = range(len(self))[index]  # negative indices, IndexError
        return self[i : i + 1][0]

    def __iter__(self) -> Iterator[Row]:
        for start in range(0, len(self), self.SLICE):
            yield from self[start : start + self.SLICE]


def synthetic_message_rows(cfg: TrainConfig, split: str) -> tuple[str, list[Row], list[str]]:
    from shardtune.data.synthetic import generate_dialogues

    sd = cfg.data.synthetic_dialogues
    num = sd.num_train if split == "train" else sd.num_validation
    source = f"synthetic_dialogues: {num} generated {split} dialogues as messages (seed {sd.seed})"
    rows = [
        {
            "messages": [
                {"role": "system", "content": SYNTHETIC_SYSTEM_PROMPT},
                {"role": "user", "content": row["dialogue"]},
                {"role": "assistant", "content": row["summary"]},
            ]
        }
        for row in generate_dialogues(num, sd.seed, split, chatter=sd.chatter)
    ]
    return source, [(source, i, r) for i, r in enumerate(rows, start=1)], ["messages"]


def recognise_rows(cfg: TrainConfig, columns: list[str], rows: list[Row]) -> RowFormat:
    first = rows[0][2] if rows else {}
    return with_extras(recognise(columns, first, cfg.data.trl_dataset.dataset_text_field), columns)


def trl_preparation(cfg: TrainConfig, tokenizer: Any, split: str) -> Preparation:
    """The rows of ``split`` ("train" or "validation") in TRL's formats, their format recognised and checked, and how
    a chunk of them is tokenised."""
    loader = (
        (mixture_rows if cfg.data.trl_dataset.dataset_mixture else _dataset_rows)
        if cfg.data.dataset == "trl_dataset"
        else synthetic_message_rows
    )
    source, rows, columns = loader(cfg, split)
    if not rows:
        raise empty_split(source, "--dataset_train_split" if split == "train" else "--dataset_test_split")
    fmt = recognise_rows(cfg, columns, rows)
    if fmt.conversational:
        check_chat_template(cfg, tokenizer, f"{source} ({fmt.describe()})")
    options = loss_options(cfg)
    check_options(options, fmt)
    report = DataReport(source=f"{source}: {fmt.describe()}", num_rows=len(rows))
    tokenise = functools.partial(_formatted_examples, fmt=fmt, columns=columns, tokenizer=tokenizer, options=options)
    return Preparation(report, rows, tokenise, cfg.data.strict)


def _formatted_examples(
    rows: list[Row], filt: RowFilter, *, fmt: RowFormat, columns: list[str], tokenizer: Any, options: LossOptions
) -> list[dict]:
    return prepare_rows(rows, fmt, columns, tokenizer, options, filt, filt.report)


def drop_absent_validation(cfg: TrainConfig, say: bool) -> None:
    """No --dataset_test_split in the data: train without evaluation (``say``: tell it, in the one process that
    talks before launch), unless the command asked for evaluation (--eval_strategy, --eval_steps, --run_validation):
    then that is refused, never dropped."""
    if cfg.eval.enabled and not validation_available(cfg):
        tc = cfg.data.trl_dataset
        asked = [flag for key, flag in cfg.provenance.spelled.items() if key in ("eval.enabled", "eval.steps")]
        if cfg.eval.only:
            asked = asked or ["eval_only"]
        if tc.dataset_mixture:
            return without_evaluation(cfg, asked, say)
        if asked:
            raise DataError(
                f"--{asked[0]} asks for evaluation, but --dataset_name {tc.dataset_name} has no split "
                f"{tc.dataset_test_split!r}: pass --dataset_test_split with a split it has, or drop --{asked[0]}"
            )
        cfg.eval.enabled = False
        if say:
            tc = cfg.data.trl_dataset
            print(
                f"shardtune: --dataset_name {tc.dataset_name} has no split {tc.dataset_test_split!r}: training "
                "without evaluation (pass --dataset_test_split to evaluate on another split)",
                flush=True,
            )


def vision_rows(cfg: TrainConfig, split: str) -> tuple[str, Any]:
    """(source, the split's rows as shardtune.data.vision.VisionRows) of --dataset_name, for a vision-language model:
    rows read lazily from the loaded table, relative image paths from the data file's folder."""
    from shardtune.data.vision import VisionRows

    if cfg.data.dataset != "trl_dataset" or cfg.data.trl_dataset.dataset_mixture:
        raise ConfigError(
            "a vision-language model trains on --dataset_name rows (images + messages, prompt / completion or text: "
            "docs/vision.md); --dataset "
            + cfg.data.dataset
            + (" with a mixture" if cfg.data.dataset == "trl_dataset" else "")
            + " is not built for it: pass --dataset_name with one file or folder"
        )
    source, rows, columns = _dataset_rows(cfg, split, images=True)
    if not len(rows):
        raise empty_split(source, "--dataset_train_split" if split == "train" else "--dataset_test_split")
    path = Path(cfg.data.trl_dataset.dataset_name).expanduser()
    base = path.parent if path.is_file() else path if path.is_dir() else None
    return source, VisionRows(rows, columns, base, cfg.data.trl_dataset.dataset_text_field)
