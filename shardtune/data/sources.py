"""Dataset sources (synthetic dialogues, samsum, alpaca, custom file:function, --dataset_name) and their early checks.

``check_data_config`` runs before any process group exists and needs no tokenizer; ``load_examples`` runs on
every rank at start-up and is deterministic, so every rank holds the same examples in the same order.
"""

from __future__ import annotations

import hashlib
import importlib.util
from functools import partial
from pathlib import Path
from typing import Any, Callable

from shardtune.config.objectives import registration
from shardtune.config.schema import ConfigError, TrainConfig
from shardtune.data.emptiness import nothing_usable
from shardtune.data.files import DataFiles, Row, hold_out, locate, read_rows
from shardtune.data.formatting import (
    ALPACA_PROMPT_NO_INPUT,
    GRAMMAR_PROMPT,
    SAMSUM_PROMPT,
    alpaca_pairs,
    grammar_pairs,
    samsum_pairs,
    template_length,
    text_examples,
    token_examples,
)
from shardtune.data.packing import check_packing, row_limit
from shardtune.data.report import DataError, DataReport, RowFilter
from shardtune.data.streaming import check_streaming
from shardtune.data.tokenising import Preparation
from shardtune.data.trl_loading import check_trl_config, trl_preparation, uses_trl_formats

SPLITS = ("train", "validation")
DEFAULT_CUSTOM_FUNCTION = "get_custom_dataset"
DATA_COLLATOR_FUNCTION = "get_data_collator"
SAMSUM_COLUMNS = ("dialogue", "summary")
ALPACA_COLUMNS = ("instruction", "output")
GRAMMAR_COLUMNS = ("input", "target")


def check_data_config(cfg: TrainConfig) -> None:
    """Checks that need no tokenizer: paths exist, formats are known, a custom file defines its function."""
    check_trl_config(cfg)
    check_streaming(cfg)
    check_packing(cfg)
    _check_num_proc(cfg)
    if cfg.data.dataset == "synthetic_dialogues":
        _check_synthetic(cfg)
    elif cfg.data.dataset == "samsum_dataset" and cfg.data.samsum_dataset.data_path:
        _samsum_files(cfg)
    elif cfg.data.dataset == "alpaca_dataset":
        _alpaca_files(cfg)
    elif cfg.data.dataset == "custom_dataset":
        load_custom_function(cfg.data.custom_dataset.file)
    elif cfg.data.dataset == "grammar_dataset":  # the test file only when the run evaluates (reads it)
        for split in ("train", "validation") if cfg.eval.enabled else ("train",):
            grammar_file(cfg, split)


def _check_num_proc(cfg: TrainConfig) -> None:
    """data.num_proc is honoured where the tokenised-data cache of examples is built; elsewhere it is refused."""
    if cfg.data.num_proc is None:
        return
    flag = "--" + cfg.provenance.spelled.get("data.num_proc", "dataset_num_proc")
    why = (
        "--dataset_streaming tokenises the rows as the steps need them"
        if cfg.data.streaming
        else "custom_dataset's function returns tokenised rows"
        if cfg.data.dataset == "custom_dataset"
        else f"shardtune {cfg.objective} tokenises its data in one process"
        if not registration(cfg.objective).pooled_tokenising
        else ""
    )
    if why:
        raise ConfigError(f"{flag} {cfg.data.num_proc} has no effect here ({why}): drop it")


def check_context_length(cfg: TrainConfig, tokenizer: Any) -> None:
    """ConfigError if no example could fit: the fixed prompt template + bos + eos + one response token."""
    template = {
        "synthetic_dialogues": SAMSUM_PROMPT,
        "samsum_dataset": SAMSUM_PROMPT,
        "alpaca_dataset": ALPACA_PROMPT_NO_INPUT,
        "grammar_dataset": GRAMMAR_PROMPT,
    }.get(cfg.data.dataset)
    if template is None or uses_trl_formats(cfg):  # TRL's formats truncate long rows instead
        return
    needed = template_length(tokenizer, template) + 1
    if cfg.data.context_length < needed:
        raise ConfigError(
            f"--context_length {cfg.data.context_length} is shorter than the {cfg.data.dataset} prompt "
            f"template with bos, eos and one response token ({needed} tokens): "
            f"pass --context_length {needed} or more"
        )


def load_examples(cfg: TrainConfig, tokenizer: Any, split: str) -> tuple[list[dict], DataReport]:
    """Tokenised ``{input_ids, labels}`` examples of ``split`` ("train" or "validation"), in source order."""
    if cfg.data.dataset == "custom_dataset":
        examples, report = _custom_examples(cfg, tokenizer, _known(split))
    else:
        preparation = prepare_examples(cfg, tokenizer, split)
        examples, report = preparation.examples(), preparation.report
    report.num_examples = len(examples)
    check_usable(report, split)
    return examples, report


def prepare_examples(cfg: TrainConfig, tokenizer: Any, split: str) -> Preparation:
    """The rows of ``split`` and how a chunk of them is tokenised (every dataset but custom_dataset, whose function
    returns examples)."""
    split = _known(split)
    if uses_trl_formats(cfg):
        return trl_preparation(cfg, tokenizer, split)
    source, rows = _text_rows(cfg, split)
    to_pairs = {"alpaca_dataset": alpaca_pairs, "grammar_dataset": grammar_pairs}.get(cfg.data.dataset, samsum_pairs)
    tokenise = partial(text_examples, to_pairs=to_pairs, tokenizer=tokenizer, context_length=row_limit(cfg))
    return Preparation(DataReport(source=source, num_rows=len(rows)), rows, tokenise, cfg.data.strict)


def _known(split: str) -> str:
    if split not in SPLITS:
        raise ValueError(f"split {split!r} is not one of {SPLITS}")
    return split


def check_usable(report: DataReport, split: str) -> None:
    """DataError when no row of the split gave an example: it is empty, or every row was skipped (counted)."""
    if not report.num_examples:
        raise DataError(
            nothing_usable(report, f"{split} example", "fix the data (see the skip reasons) or raise --context_length")
        )


def _text_rows(cfg: TrainConfig, split: str) -> tuple[str, list[Row]]:
    if cfg.data.dataset == "synthetic_dialogues":
        return _synthetic_rows(cfg, split)
    if cfg.data.dataset == "alpaca_dataset":
        return _file_rows(
            "alpaca_dataset",
            _alpaca_files(cfg),
            cfg.data.alpaca_dataset.validation_fraction,
            cfg.train.seed,
            split,
            ALPACA_COLUMNS,
        )
    if cfg.data.dataset == "grammar_dataset":
        path = grammar_file(cfg, split)
        return f"grammar_dataset: {path}", read_rows([path], GRAMMAR_COLUMNS)
    if cfg.data.samsum_dataset.data_path:
        return _file_rows(
            "samsum_dataset",
            _samsum_files(cfg),
            cfg.data.samsum_dataset.validation_fraction,
            cfg.train.seed,
            split,
            SAMSUM_COLUMNS,
        )
    return _hub_rows(cfg, split)


# ---------------------------------------------------------------------------------------------------------------
# synthetic dialogues


def _check_synthetic(cfg: TrainConfig) -> None:
    sd = cfg.data.synthetic_dialogues
    if sd.num_train <= 0:
        raise ConfigError(f"--synthetic_dialogues.num_train {sd.num_train} must be positive")
    if cfg.eval.enabled and sd.num_validation <= 0:
        raise ConfigError(
            f"--synthetic_dialogues.num_validation {sd.num_validation} must be positive when "
            "--run_validation is on: pass a count or --run_validation false"
        )


def _synthetic_rows(cfg: TrainConfig, split: str) -> tuple[str, list[Row]]:
    from shardtune.data.synthetic import generate_dialogues

    sd = cfg.data.synthetic_dialogues
    num = sd.num_train if split == "train" else sd.num_validation
    chatter = ", with chatter" if sd.chatter else ""
    source = f"synthetic_dialogues: {num} generated {split} dialogues (seed {sd.seed}{chatter})"
    rows = generate_dialogues(num, sd.seed, split, chatter=sd.chatter)
    return source, [(source, i, row) for i, row in enumerate(rows, start=1)]


# ---------------------------------------------------------------------------------------------------------------
# file datasets (samsum, alpaca)


def _samsum_files(cfg: TrainConfig) -> DataFiles:
    sc = cfg.data.samsum_dataset
    files = locate("samsum_dataset.data_path", sc.data_path, sc.train_split, sc.test_split)
    if files.validation and sc.validation_fraction > 0:
        raise DataError(
            f"--samsum_dataset.validation_fraction {sc.validation_fraction} would be ignored: "
            f"{sc.data_path} has a validation file ({files.validation[0].name}): set it to 0 "
            "or remove the file"
        )
    if not files.validation and sc.validation_fraction == 0 and cfg.eval.enabled:
        naming = f"a file whose name contains {sc.test_split!r}, 'val', 'dev' or 'test'"
        if Path(sc.data_path).expanduser().is_file():  # one file is the train data, whatever its name says
            raise DataError(
                f"--samsum_dataset.data_path {sc.data_path} is one file, the train data: pass a folder "
                f"holding a train file and a validation file ({naming}), or set "
                "--samsum_dataset.validation_fraction (e.g. 0.05), or --run_validation false"
            )
        raise DataError(
            f"--samsum_dataset.data_path {sc.data_path}: no validation file: add one ({naming}) or set "
            "--samsum_dataset.validation_fraction (e.g. 0.05)"
        )
    return files


def _alpaca_files(cfg: TrainConfig) -> DataFiles:
    ac = cfg.data.alpaca_dataset
    if not ac.data_path:
        raise DataError(
            "--alpaca_dataset.data_path is empty: pass a JSON or JSONL file of {instruction, input, output} rows"
        )
    files = locate("alpaca_dataset.data_path", ac.data_path, "train", "validation", allow_folder=False)
    if ac.validation_fraction == 0 and cfg.eval.enabled:
        raise DataError(
            "--alpaca_dataset.validation_fraction is 0 but --run_validation is on: set a fraction "
            "(e.g. 0.05) or pass --run_validation false"
        )
    return files


def _file_rows(
    name: str, files: DataFiles, fraction: float, seed: int, split: str, columns: tuple[str, ...]
) -> tuple[str, list[Row]]:
    if files.validation and split == "validation":
        return f"{name}: {_names(files.validation)}", read_rows(files.validation, columns)
    rows = read_rows(files.train, columns)
    if fraction == 0 or files.validation:
        if split == "validation":
            raise DataError(f"{name}: no validation data: set --{name}.validation_fraction (e.g. 0.05)")
        return f"{name}: {_names(files.train)}", rows
    side = "held out for validation" if split == "validation" else "kept for training"
    source = f"{name}: {_names(files.train)} (the rows {side}: validation_fraction {fraction:g}, seed {seed})"
    return source, hold_out(rows, fraction, seed, split)


def grammar_file(cfg: TrainConfig, split: str) -> Path:
    """llama-cookbook's grammar_dataset: train_split and test_split are the paths of its two CSV files; ``split``'s
    ("train" or "validation") must be one."""
    gc = cfg.data.grammar_dataset
    name, value = ("train_split", gc.train_split) if split == "train" else ("test_split", gc.test_split)
    path = Path(value).expanduser()
    if path.suffix.lower() != ".csv" or not path.is_file():
        raise DataError(
            f"--grammar_dataset.{name} {value}: no such CSV file: pass the path of a CSV file with "
            f"columns {', '.join(GRAMMAR_COLUMNS)}"
        )
    return path


def _names(paths: list[Path]) -> str:
    return ", ".join(str(p) for p in paths)


def _hub_rows(cfg: TrainConfig, split: str) -> tuple[str, list[Row]]:
    """The hub dataset (users are online); any failure becomes one line pointing at --samsum_dataset.data_path."""
    sc = cfg.data.samsum_dataset
    hub_split = sc.train_split if split == "train" else sc.test_split
    source = f"samsum_dataset: hub {sc.hub_name} split {hub_split}"
    try:
        import datasets

        rows = list(datasets.load_dataset(sc.hub_name, split=hub_split))
    except Exception as e:  # network, authentication, missing dataset or split: all mean "use local files"
        raise DataError(
            f"{source}: could not be loaded from the Hugging Face hub ({type(e).__name__}: "
            f"{str(e).splitlines()[0] if str(e) else ''}): pass --samsum_dataset.data_path "
            "with a local file or folder"
        ) from e
    return source, [(source, i, row) for i, row in enumerate(rows, start=1)]


# ---------------------------------------------------------------------------------------------------------------
# custom file:function


def parse_custom_file(spec: str) -> tuple[Path, str]:
    """``path.py[:function]`` -> (path, function name; get_custom_dataset by default)."""
    path, sep, function = spec.rpartition(":")
    if sep and function.isidentifier() and path:
        return Path(path).expanduser(), function
    return Path(spec).expanduser(), DEFAULT_CUSTOM_FUNCTION


def load_custom_function(spec: str) -> Callable[..., Any]:
    """Import ``path.py`` from its path (no sys.path lookup) and return its dataset function."""
    return load_custom_file(spec)[0]


def load_custom_file(spec: str) -> tuple[Callable[..., Any], Callable[..., Any] | None]:
    """Import ``path.py`` from its path (no sys.path lookup): its dataset function, and its
    ``get_data_collator(processor)`` where it defines one (llama-cookbook's vision recipes batch through it)."""
    if not spec:
        raise ConfigError("--custom_dataset.file is empty: pass path.py or path.py:function")
    path, function = parse_custom_file(spec)
    if path.suffix != ".py" or not path.is_file():
        raise ConfigError(f"--custom_dataset.file {spec}: {path} is not a .py file: pass path.py[:function]")
    module_name = "shardtune_custom_dataset_" + hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:12]
    module_spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(module_spec)
    try:
        module_spec.loader.exec_module(module)
    except Exception as e:  # user code: report it as one line naming the file
        raise ConfigError(
            f"--custom_dataset.file {spec}: importing {path} failed ({type(e).__name__}: {e}): fix the file"
        ) from e
    fn = getattr(module, function, None)
    if not callable(fn):
        raise ConfigError(
            f"--custom_dataset.file {spec}: {path} defines no function {function!r}: define it "
            "or name yours with path.py:function"
        )
    collator = getattr(module, DATA_COLLATOR_FUNCTION, None)
    return fn, collator if callable(collator) else None


def _custom_examples(cfg: TrainConfig, tokenizer: Any, split: str) -> tuple[list[dict], DataReport]:
    cc = cfg.data.custom_dataset
    custom_split = cc.train_split if split == "train" else cc.test_split
    fn, collator = load_custom_file(cc.file)
    if collator is not None:  # not silently left unused
        raise ConfigError(
            f"--custom_dataset.file {cc.file} defines {DATA_COLLATOR_FUNCTION}, which batches the rows of a "
            "vision-language model (llama-cookbook's vision recipes); this is a text model, whose rows (input_ids, "
            f"labels) shardtune batches itself (--batching_strategy): remove {DATA_COLLATOR_FUNCTION} from the file"
        )
    source = f"custom_dataset: {cc.file} split {custom_split}"
    try:
        rows = list(fn(cc, tokenizer, custom_split))
    except Exception as e:  # user code
        raise DataError(
            f"{source}: the dataset function failed ({type(e).__name__}: {e}): fix "
            f"{cc.file} (it must return an iterable of dicts with input_ids and labels)"
        ) from e
    report = DataReport(source=source, num_rows=len(rows))
    filt = RowFilter(report, cfg.data.strict)
    return token_examples(rows, source, len(tokenizer), row_limit(cfg), filt), report
