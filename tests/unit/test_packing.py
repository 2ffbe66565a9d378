"""Packing as TRL packs: shardtune's blocks under bfd, bfd_split and wrapped are the rows TRL's SFTTrainer trains on,
and shardtune's pack_dataset is trl.pack_dataset, both compared with trl 1.16 itself on the same rows (no launch:
TRL's trainer is only constructed). Greedy (llama-cookbook's) stays the cookbook names' default."""

from __future__ import annotations

import copy
import json
import random
from pathlib import Path

import pytest
from datasets import Dataset, DatasetDict, load_dataset

from shardtune.config.argv import split_argv
from shardtune.config.flags import build_config, config_from
from shardtune.config.schema import ConfigError, TrainConfig
from shardtune.data import build_units, check_data_config, eval_batches, load_examples, steps_per_epoch
from shardtune.data.cache import TokenStore, load_examples_cached
from shardtune.data.packing import MAP_BATCH_ROWS, TRL_STRATEGIES, best_fit_decreasing, pack_dataset
from shardtune.data.report import DataReport
from shardtune.data.stream_rows import START
from shardtune.data.streaming import StreamSource, StreamSteps
from shardtune.model.loading import train_tokenizer

trl = pytest.importorskip("trl")

WORDS = "anna tom kate ben lucy mark cinema lunch picnic park pool bowling friday monday seven noon brings cake".split()


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer()


def token_rows(num: int, seed: int, max_len: int, columns: tuple[str, ...] = ("input_ids", "labels")) -> list[dict]:
    """Rows of list columns aligned token by token, lengths 0..max_len with many ties."""
    rng = random.Random(seed)
    rows = []
    for _ in range(num):
        length = rng.choice([rng.randint(0, max_len), rng.randint(1, 8), max_len // 2])
        ids = [rng.randint(3, 900) for _ in range(length)]
        row = {"input_ids": ids, "labels": [t if rng.random() < 0.6 else -100 for t in ids]}
        row["attention_mask"] = [1] * length
        rows.append({name: row[name] for name in columns})
    return rows


# name: (rows, seq_length, map_kwargs)
DATASETS = {
    "short rows, ties and empty rows": (token_rows(60, 0, 24), 16, None),
    "2,500 rows: three map batches, rows longer than seq_length": (token_rows(2500, 1, 90), 64, None),
    "three columns, batches of 7 rows": (token_rows(300, 2, 30, ("input_ids", "labels", "attention_mask")), 20, 7),
    "input_ids alone, one row per block": (token_rows(40, 3, 12, ("input_ids",)), 12, None),
}


@pytest.mark.parametrize("strategy", TRL_STRATEGIES)
@pytest.mark.parametrize("case", list(DATASETS))
def test_pack_dataset_gives_trls_rows_and_columns(case, strategy):
    rows, seq_length, batch_size = DATASETS[case]
    dataset = Dataset.from_list(rows)
    map_kwargs = {"batch_size": batch_size} if batch_size else None
    theirs = trl.pack_dataset(dataset, seq_length, strategy, map_kwargs)
    ours = pack_dataset(dataset, seq_length, strategy, map_kwargs)
    assert ours.features == theirs.features
    assert ours.to_dict() == theirs.to_dict()
    assert len(ours) != len(dataset)  # something was packed (or split): the comparison is not of the input


def test_pack_dataset_keeps_the_format_packs_every_split_and_a_stream_and_refuses_what_trl_refuses():
    splits = DatasetDict(train=Dataset.from_list(token_rows(50, 4, 20)), test=Dataset.from_list(token_rows(9, 5, 20)))
    splits = splits.with_format("torch", columns=["input_ids", "labels"])
    for strategy in TRL_STRATEGIES:
        ours, theirs = pack_dataset(splits, 16, strategy), trl.pack_dataset(splits, 16, strategy)
        for name in splits:
            assert ours[name].format == theirs[name].format
            mine, trls = ours[name][:], theirs[name][:]
            assert mine.keys() == trls.keys()
            assert all(
                len(a) == len(b) and all((x == y).all() for x, y in zip(a, b))
                for a, b in ((mine[k], trls[k]) for k in mine)
            )
    streamed = Dataset.from_list(token_rows(1100, 6, 30)).to_iterable_dataset()  # a stream: the same batches of 1,000
    for strategy in TRL_STRATEGIES:
        assert list(pack_dataset(streamed, 24, strategy)) == list(trl.pack_dataset(streamed, 24, strategy))
    with pytest.raises(ValueError, match="not one of bfd, bfd_split, wrapped"):
        pack_dataset(splits, 16, "greedy")
    with pytest.raises(TypeError, match="list columns"):
        pack_dataset(Dataset.from_list([{"input_ids": [1, 2], "text": "a"}]), 4)
    with pytest.raises(ValueError, match="not as long as input_ids"):
        pack_dataset(Dataset.from_list([{"input_ids": [1, 2], "labels": [1]}]), 4)


def test_best_fit_decreasing_fills_the_fullest_bin_that_holds_an_item():
    # 7 opens a bin (3 free), 6 another (4 free), 5 a third (5 free); 4 goes where 4 is free, 3 where 3 is free
    assert best_fit_decreasing([3, 4, 5, 6, 7], 10) == [[4, 0], [3, 1], [2]]
    # equal free space: the bin that had it first; equal lengths: data order
    assert best_fit_decreasing([2, 2, 8, 8], 10) == [[2, 0], [3, 1]]


# -- the engine's blocks are the rows TRL's SFTTrainer trains on ------------------------------------------------------


def prompt_completion_rows(num: int, seed: int, long_every: int = 0) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for i in range(num):
        prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 12)))
        size = rng.randint(40, 70) if long_every and i % long_every == 0 else rng.randint(1, 14)
        rows.append(
            {"prompt": f"Summarize: {prompt}\nSummary:", "completion": " " + " ".join(rng.choices(WORDS, k=size))}
        )
    return rows


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def packed_cfg(path: Path, strategy: str, max_length: int, **more) -> TrainConfig:
    cfg = config_from(dataset="trl_dataset", context_length=max_length, run_validation=False, **more)
    cfg.data.trl_dataset.dataset_name = str(path)
    cfg.data.batching, cfg.data.packing_strategy = "packing", strategy
    return cfg


def trl_trainer(path: Path, strategy: str, max_length: int, tokenizer, out: Path, batch_size: int = 8):
    """TRL's SFTTrainer packing the same file (its own preparation; a 1-layer model, nothing trained)."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    args = trl.SFTConfig(
        output_dir=str(out),
        report_to="none",
        use_cpu=True,
        save_strategy="no",
        packing=True,
        packing_strategy=strategy,
        max_length=max_length,
        per_device_train_batch_size=batch_size,
    )
    with torch.random.fork_rng(devices=[]):
        config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=16, num_hidden_layers=1, num_attention_heads=2)
        model = AutoModelForCausalLM.from_config(config)
    dataset = load_dataset("json", data_files=str(path), split="train")
    return trl.SFTTrainer(model=model, args=args, train_dataset=dataset, processing_class=copy.deepcopy(tokenizer))


def as_rows(units: list) -> list[dict]:
    """The engine's blocks as TRL's packed rows: tokens and labels back to back, each sequence's length."""
    return [
        {
            "input_ids": [t for e in unit for t in e["input_ids"]],
            "labels": [t for e in unit for t in e["labels"]],
            "seq_lengths": [len(e["input_ids"]) for e in unit],
        }
        for unit in units
    ]


@pytest.mark.parametrize("strategy", TRL_STRATEGIES)
def test_the_engines_blocks_are_the_rows_sft_trainer_trains_on(strategy, tokenizer, tmp_path):
    """1,100 prompt-completion rows (two of TRL's map batches), one in 25 longer than max_length (bfd: cut, keeping
    the start; bfd_split and wrapped: kept whole and split): every block holds the same tokens, labels and sequences
    as TRL's row, in the same order, from the memory-mapped cache and from lists alike."""
    path = write_jsonl(tmp_path / "rows.jsonl", prompt_completion_rows(MAP_BATCH_ROWS + 100, 7, long_every=25))
    cfg = packed_cfg(path, strategy, 48)
    examples, report = load_examples_cached(cfg, tokenizer, "train", tmp_path / "cache")
    assert isinstance(examples, TokenStore) and report.num_examples == MAP_BATCH_ROWS + 100
    assert (report.num_truncated > 0) == (strategy == "bfd") and (max(examples.lengths) > 48) == (strategy != "bfd")
    ours = as_rows(build_units(examples, cfg))
    assert as_rows(build_units([dict(e) for e in examples], cfg)) == ours
    theirs = trl_trainer(path, strategy, 48, tokenizer, tmp_path / "trl").train_dataset
    assert len(ours) == len(theirs)
    for block, (mine, trls) in enumerate(zip(ours, theirs)):
        assert mine["input_ids"] == trls["input_ids"], f"block {block}: other tokens"
        assert mine["labels"] == trls["labels"], f"block {block}: other labels"
        assert mine["seq_lengths"] == trls.get("seq_lengths", [len(trls["input_ids"])]), f"block {block}"
    greedy = build_units(examples, packed_cfg(path, "greedy", 48)) if strategy == "bfd" else None
    assert greedy is None or as_rows(greedy) != ours  # control: another packing is seen


def test_sixty_four_prompt_completion_rows_make_trls_32_blocks_and_its_steps(tokenizer, tmp_path):
    """The issue's case: 64 prompt-completion rows, half of them a little over half a block, the other half short.
    TRL's best-fit decreasing pairs each long row with a short one (32 blocks: 8 steps of 4 an epoch); shardtune's
    bfd gives the same 32 blocks and steps, the greedy packing of llama-cookbook's recipe more."""
    rng = random.Random(11)
    rows = []
    for i in range(64):
        completion = " ".join(rng.choices(WORDS, k=rng.randint(18, 21) if i % 2 else rng.randint(2, 5)))
        rows.append({"prompt": f"Summarize day {i}:", "completion": " " + completion})
    path = write_jsonl(tmp_path / "rows.jsonl", rows)
    cfg = packed_cfg(path, "bfd", 64, batch_size_training=4)
    examples, _ = load_examples(cfg, tokenizer, "train")
    assert len(examples) == 64 and sum(len(e["input_ids"]) > 32 for e in examples) == 32
    trainer = trl_trainer(path, "bfd", 64, tokenizer, tmp_path / "trl", batch_size=4)
    ours, greedy = build_units(examples, cfg), build_units(examples, packed_cfg(path, "greedy", 64))
    assert len(trainer.train_dataset) == len(ours) == 32
    assert as_rows(ours) == [dict(row) for row in trainer.train_dataset]
    assert len(greedy) > 32
    assert steps_per_epoch(len(ours), cfg, 1) == len(trainer.get_train_dataloader()) == 8
    assert steps_per_epoch(len(greedy), cfg, 1) > 8


@pytest.mark.parametrize("strategy", ["bfd", "wrapped"])
def test_streamed_blocks_are_the_cached_ones_and_a_resume_inside_a_batch_continues_them(strategy, tokenizer, tmp_path):
    """--dataset_streaming packs each 1,000 streamed examples as the cache's are packed; a step that begins inside a
    batch resumes at the batch's first row with the blocks already trained on left out."""
    path = write_jsonl(tmp_path / "rows.jsonl", prompt_completion_rows(MAP_BATCH_ROWS + 60, 8, long_every=30))
    cfg = packed_cfg(path, strategy, 48, batch_size_training=4, max_steps=3)
    cached = as_rows(build_units(load_examples(cfg, tokenizer, "train")[0], cfg))
    cfg.data.streaming = True
    source = StreamSource(cfg, tokenizer)
    streamed = list(source.units(START, DataReport(source="")))
    assert as_rows([unit for unit, _, _ in streamed]) == cached
    index = next(i for i, (_, where, done) in enumerate(streamed) if where != START and done > 3)
    _, where, done = streamed[index]
    resumed = [unit for unit, _, _ in source.units(where, DataReport(source=""), done)]
    assert as_rows(resumed) == cached[index:]
    # the steps: a position saved after step 2 resumes step 3's micro-batches exactly
    steps = StreamSteps(source, 0, 1, 0, {"pass": 0, "rows": START, "examples": 0})
    (_, _), (_, after_two), (third, _) = [step for _, step in zip(range(3), steps)]
    [(again, _)] = [step for _, step in zip(range(1), StreamSteps(source, 0, 1, 0, after_two))]
    assert all((a[k] == b[k]).all() for a, b in zip(third, again) for k in a)


@pytest.mark.parametrize("strategy", ["bfd_split", "wrapped"])
def test_whole_rows_are_split_not_cut_and_evaluated_as_trl_packs_them(strategy, tokenizer, tmp_path):
    """With bfd_split and wrapped the loader cuts no row (TRL cuts none before packing; the cache keeps them whole
    under a key of its own), and evaluation computes the sequences packing makes (TRL's eval_packing follows
    packing): every sequence fits context_length and holds each labelled token once."""
    path = write_jsonl(tmp_path / "rows.jsonl", prompt_completion_rows(40, 9, long_every=4))
    cut = packed_cfg(path, "bfd", 24)
    whole = packed_cfg(path, strategy, 24, val_batch_size=3)
    cut_examples, cut_report = load_examples_cached(cut, tokenizer, "train", tmp_path)
    examples, report = load_examples_cached(whole, tokenizer, "train", tmp_path)
    assert cut_report.num_truncated > 0 and report.num_truncated == 0 and max(examples.lengths) > 24
    entries = [p for p in (tmp_path / "tokenized").iterdir() if p.is_dir() and not p.name.startswith(".")]
    assert len(entries) == 2  # two entries: cut and whole rows
    batches = eval_batches(examples, whole, 0, 1, pad_id=0)
    rows = [length for b in batches for length in b["attention_mask"].sum(1).tolist()]
    assert max(rows) <= 24 and sum(rows) == sum(examples.lengths)
    labelled = sum(int((b["labels"] != -100).sum()) for b in batches)
    assert labelled == sum(sum(t != -100 for t in e["labels"]) for e in examples)


# -- the settings ------------------------------------------------------------------------------------------------------


def ours(argv: list[str], objective: str = "sft") -> TrainConfig:
    args = split_argv(argv)
    return build_config(args.training, args.recipe, (), None, objective)


@pytest.mark.parametrize("objective", ["dpo", "grpo"])
def test_an_objective_that_never_packs_refuses_packing_asked_for_and_pads_by_default(objective):
    """DPO's pairs and GRPO's completions are padded per micro-batch, never packed: --packing / --batching_strategy
    packing (on the command line or in a recipe) is refused in one line naming the flag; the cookbook's default
    (packing, a setting nobody named) becomes padding, as does an explicit padding."""
    from shardtune.training.engine.checks import validate

    for argv, flag in ((["--packing"], "--packing"), (["--batching_strategy", "packing"], "--batching_strategy")):
        with pytest.raises(ConfigError) as refused:
            validate(ours(argv, objective), 1)
        assert str(refused.value).startswith(f"{flag} asks for packing, but shardtune {objective} never packs"), refused
    for argv in ([], ["--lr", "1e-4"], ["--packing", "false"], ["--batching_strategy", "padding"]):
        cfg = ours(argv, objective)
        validate(cfg, 1)
        assert cfg.data.batching == "padding", argv


def test_trl_names_pack_with_bfd_the_cookbooks_with_greedy_and_bad_values_are_one_line(tmp_path):
    trl_packing = ours(["--model_name_or_path", "m", "--packing"])
    assert (trl_packing.data.batching, trl_packing.data.packing_strategy) == ("packing", "bfd")
    cookbook = ours(["--model_name", "m", "--batching_strategy", "packing"])
    assert (cookbook.data.batching, cookbook.data.packing_strategy) == ("packing", "greedy")
    assert ours(["--model_name_or_path", "m", "--packing", "--packing_strategy", "wrapped"]).data.packing_strategy == (
        "wrapped"
    )
    assert ours(["--packing_strategy", "bfd-requeue"]).data.packing_strategy == "bfd_split"  # TRL's old name
    assert ours(["--data.packing_strategy", "bfd"]).data.packing_strategy == "bfd"
    from shardtune.training.engine.checks import validate

    with pytest.raises(ConfigError, match=r"^--packing_strategy 'bfd-split' is not valid: did you mean bfd_split\?"):
        validate(ours(["--packing_strategy", "bfd-split", "--output_dir", str(tmp_path / "o")]), 1)
    # named where nothing is packed: refused (bfd, TRL's default that a dumped TRL config holds, asks for nothing)
    with pytest.raises(ConfigError, match=r"^--packing_strategy wrapped has no effect without packing: add --packing"):
        check_data_config(ours(["--model_name_or_path", "m", "--packing_strategy", "wrapped"]))
    check_data_config(ours(["--model_name_or_path", "m", "--packing", "false", "--packing_strategy", "bfd"]))
    with pytest.raises(ConfigError, match="has no effect without packing"):
        check_data_config(ours(["--packing_strategy", "greedy"], "dpo"))  # DPO never packs
