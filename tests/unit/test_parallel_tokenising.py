"""--dataset_num_proc (data.num_proc): the tokenised-data cache is built by that many processes, chunk by chunk, and
is the same bytes as one process builds (shardtune.data.tokenising). Real pools of forked workers, real corpora of a
few chunks each; nothing is mocked."""

from __future__ import annotations

import io
import json
import multiprocessing
import os
import pickle
from pathlib import Path

import pytest
import yaml

from shardtune.config.checks import check_fields
from shardtune.config.flags import parse_args
from shardtune.config.schema import ConfigError
from shardtune.data import DataError, check_data_config, load_examples
from shardtune.data.cache import STORE_ARRAYS, cache_key, load_examples_cached
from shardtune.data.sources import prepare_examples
from shardtune.data.tokenising import CHUNK_ROWS, Progress, num_processes, tokenise_chunk
from shardtune.model.loading import train_tokenizer

NUM_ROWS = 2 * CHUNK_ROWS + 300  # three chunks: two workers, and one of them takes a second chunk
PEOPLE = ("Anna", "Tom", "Kate", "Ben", "Lucy", "Mark")
PLACES = ("the cinema", "Riverside Park", "the Odeon", "Strike Zone", "the lake")


def sentence(i: int) -> str:
    return f"{PEOPLE[i % 6]} meets {PEOPLE[(i * 7 + 1) % 6]} at {PLACES[i % 5]} at {i % 12 + 1} pm"


def prompt_completion_row(i: int) -> dict:
    if i % 97 == 5:
        return {"prompt": sentence(i)}  # missing_field
    if i % 131 == 7:
        return {"prompt": sentence(i), "completion": i}  # not_a_string
    prompt = " and ".join(sentence(i + k) for k in range(1 + (i % 9 == 0) * 8))  # every 9th is truncated
    return {"prompt": f"Summarize: {prompt}\nSummary:", "completion": f" {PEOPLE[i % 6]} goes out."}


def messages_row(i: int) -> dict:
    answer = "" if i % 113 == 3 else f"{PEOPLE[i % 6]} goes to {PLACES[i % 5]}."  # empty_assistant_turn
    user = "narrator" if i % 89 == 4 else "user"  # unknown_role
    question = " and ".join(sentence(i + k) for k in range(1 + (i % 9 == 0) * 8))  # every 9th is truncated
    return {"messages": [{"role": user, "content": question}, {"role": "assistant", "content": answer}]}


def samsum_row(i: int) -> dict:
    dialogue = "\n".join(f"{PEOPLE[(i + k) % 6]}: {sentence(i + k)}" for k in range(2 + (i % 50 == 0) * 40))
    return {"dialogue": dialogue, "summary": "" if i % 101 == 2 else sentence(i)}  # too_long, empty_summary


CORPORA = {
    "prompt_completion": (prompt_completion_row, ["--max_length", "48"]),
    "messages": (messages_row, ["--max_length", "64"]),
    "samsum": (samsum_row, ["--dataset", "samsum_dataset", "--context_length", "256", "--run_validation", "false"]),
}


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer()


def corpus_flags(name: str, folder: Path) -> list[str]:
    make_row, flags = CORPORA[name]
    path = folder / f"{name}.jsonl"
    if not path.exists():
        path.write_text("".join(json.dumps(make_row(i)) + "\n" for i in range(NUM_ROWS)))
    source = ["--samsum_dataset.data_path"] if name == "samsum" else ["--dataset_name"]
    return [*source, str(path), *flags]


def build(flags: list[str], tokenizer, root: Path):
    cfg = parse_args(flags)
    store, report = load_examples_cached(cfg, tokenizer, "train", root)
    [entry] = [p for p in (root / "tokenized").iterdir() if p.is_dir()]
    return cfg, store, report, entry


@pytest.mark.parametrize("corpus", sorted(CORPORA))
def test_two_workers_write_the_same_cache_files_as_one_process(corpus, tokenizer, tmp_path, capsys):
    flags = corpus_flags(corpus, tmp_path)
    cfg, _, report, entry = build([*flags, "--dataset_num_proc", "1"], tokenizer, tmp_path / "one")
    _, two, report_two, entry_two = build([*flags, "--dataset_num_proc", "2"], tokenizer, tmp_path / "two")
    told = f"shardtune: tokenised {NUM_ROWS:,} train rows"
    said = [line for line in capsys.readouterr().err.splitlines() if line.startswith(told)]
    assert [line.rsplit(", ", 1)[1] for line in said] == ["1 worker)", "2 workers)"]
    assert entry.name == entry_two.name  # the same key
    for name in [*(f"{array}.npy" for array in STORE_ARRAYS), "report.json"]:
        assert (entry / name).read_bytes() == (entry_two / name).read_bytes(), name
    assert report_two == report and report.num_rows == NUM_ROWS
    assert len(report.skipped) >= 2 and report.num_examples == len(two) < NUM_ROWS  # bad rows of several kinds
    assert report.num_truncated or corpus == "samsum"  # (the cookbook's datasets skip long rows instead)
    fresh, fresh_report = load_examples(cfg, tokenizer, "train")  # in this process, without the cache
    assert two == fresh and report_two == fresh_report
    assert not multiprocessing.active_children()  # the pool's workers are gone


def preference_row(i: int) -> dict:
    if i % 97 == 5:
        return {"prompt": sentence(i), "chosen": f" {sentence(i + 1)}"}  # rejected missing
    if i % 131 == 7:
        return {"prompt": " and ".join(sentence(i + k) for k in range(12)), "chosen": " a", "rejected": " b"}  # fills
    prompt = " and ".join(sentence(i + k) for k in range(1 + (i % 9 == 0)))  # every 9th is truncated
    return {
        "prompt": f"Summarize: {prompt}\nSummary:",
        "chosen": f" {sentence(i + 1)}",
        "rejected": f" {PEOPLE[i % 6]}.",
    }


def test_dpo_pairs_with_two_workers_are_the_same_cache_files_as_one_process(tokenizer, tmp_path, capsys):
    """shardtune dpo's pairs go through the same chunked pool (--dataset_num_proc): the same entry, byte for byte,
    the same report (bad rows of two kinds, truncated pairs), the same pairs as one process makes them in memory."""
    from shardtune.data.cache import load_pairs_cached
    from shardtune.data.pair_store import PAIR_FIELDS
    from shardtune.data.preference import load_pairs

    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(preference_row(i)) + "\n" for i in range(NUM_ROWS)))
    entries, results = [], []
    for num_proc in ("1", "2"):
        cfg = parse_args(["--dataset_name", str(data), "--max_length", "40", "--dataset_num_proc", num_proc])
        cfg.objective = "dpo"
        check_data_config(cfg)
        results.append(load_pairs_cached(cfg, tokenizer, "train", tmp_path / num_proc))
        [entry] = [p for p in (tmp_path / num_proc / "tokenized").iterdir() if p.is_dir()]
        entries.append(entry)
    said = [line for line in capsys.readouterr().err.splitlines() if line.startswith("shardtune: tokenised")]
    assert [line.rsplit(", ", 1)[1] for line in said] == ["1 worker)", "2 workers)"]
    names = [f"{field}{part}.npy" for field in PAIR_FIELDS for part in ("", "_offsets")] + ["report.json"]
    for name in names:
        assert (entries[0] / name).read_bytes() == (entries[1] / name).read_bytes(), name
    (one, report), (two, report_two) = results
    assert report == report_two and report.num_rows == NUM_ROWS and report.num_examples == len(two) < NUM_ROWS
    assert set(report.skipped) >= {"missing_field", "prompt_fills_max_length"} and report.num_truncated
    fresh, fresh_report = load_pairs(cfg, tokenizer, "train")
    assert two == fresh and fresh_report == report
    assert not multiprocessing.active_children()


def test_the_key_and_the_entry_do_not_depend_on_the_processes_nor_the_batching(tokenizer, tmp_path, capsys):
    flags = corpus_flags("prompt_completion", tmp_path)
    keys = {
        cache_key(parse_args([*flags, *more]), tokenizer, "train")
        for more in (
            [],
            ["--dataset_num_proc", "1"],
            ["--dataset_num_proc", "2", "--packing", "true"],
            ["--dataset_num_proc", "3", "--packing", "false"],
        )
    }
    assert len(keys) == 1
    build([*flags, "--dataset_num_proc", "2", "--packing", "true"], tokenizer, tmp_path)
    assert "tokenised" in capsys.readouterr().err
    _, _, _, entry = build([*flags, "--dataset_num_proc", "1", "--packing", "false"], tokenizer, tmp_path)
    assert entry.name in keys and "tokenised" not in capsys.readouterr().err  # one entry, read by the second run


def test_a_bad_row_under_strict_data_in_a_worker_is_the_same_one_line_error(tokenizer, tmp_path):
    bad = CHUNK_ROWS + 500  # in the second chunk: the second worker's
    rows = [{"prompt": sentence(i), "completion": sentence(i + 1)} for i in range(NUM_ROWS)]
    rows[bad - 1] = {"prompt": sentence(0)}
    data = tmp_path / "strict.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    errors = []
    for num_proc in ("1", "2"):
        root = tmp_path / num_proc
        cfg = parse_args(["--dataset_name", str(data), "--strict_data", "true", "--dataset_num_proc", num_proc])
        with pytest.raises(DataError) as error:
            load_examples_cached(cfg, tokenizer, "train", root)
        errors.append(str(error.value))
        assert not [p for p in (root / "tokenized").iterdir() if not p.name.endswith(".lock")]  # no entry, no tmp
    missing = f"{data} row {bad}: field 'completion' is missing: fix the row, or drop --strict_data to skip bad rows"
    assert errors == [missing, missing]
    assert not multiprocessing.active_children()


def test_dataset_num_proc_is_trls_flag_and_recipe_key_and_defaults_to_the_cpus_available(tmp_path):
    assert parse_args(["--dataset_num_proc", "3"]).data.num_proc == 3
    recipe = tmp_path / "sft.yaml"
    recipe.write_text(yaml.safe_dump({"dataset_num_proc": 2, "learning_rate": 1e-4}))
    assert parse_args(["--config", str(recipe)]).data.num_proc == 2
    assert parse_args([]).data.num_proc is None
    assert num_processes(None) == len(os.sched_getaffinity(0)) and num_processes(5) == 5
    with pytest.raises(ConfigError, match=r"^--dataset_num_proc 0 must be positive"):
        check_fields(parse_args(["--dataset_num_proc", "0"]), 1)


def test_dataset_num_proc_where_nothing_is_tokenised_into_the_cache_is_refused(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"prompt": "a", "completion": "b"}) + "\n")
    streamed = ["--dataset_name", str(data), "--dataset_streaming", "true", "--max_steps", "2"]
    check_data_config(parse_args(streamed))
    with pytest.raises(ConfigError, match=r"^--dataset_num_proc 2 has no effect here \(--dataset_streaming .*drop it"):
        check_data_config(parse_args([*streamed, "--dataset_num_proc", "2"]))
    grpo = parse_args(["--dataset_name", str(data), "--dataset_num_proc", "2"])
    grpo.objective = "grpo"
    with pytest.raises(ConfigError, match=r"^--dataset_num_proc 2 has no effect here \(shardtune grpo tokenises"):
        check_data_config(grpo)


@pytest.mark.parametrize("corpus", sorted(CORPORA))
def test_a_chunks_job_pickles_as_a_spawned_worker_receives_it(corpus, tokenizer, tmp_path):
    """Where workers are spawned (macOS, Windows) the tokeniser travels pickled: it tokenises the same."""
    preparation = prepare_examples(parse_args(corpus_flags(corpus, tmp_path)), tokenizer, "train")
    rows = preparation.rows[:200]
    here = tokenise_chunk(preparation.tokenise, False, rows)
    there = tokenise_chunk(pickle.loads(pickle.dumps(preparation.tokenise)), False, pickle.loads(pickle.dumps(rows)))
    assert here.examples() == there.examples() and here.skipped == there.skipped


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_redraws_on_a_terminal_and_says_one_line_elsewhere():
    log, terminal = io.StringIO(), Terminal()
    for stream in (log, terminal):
        progress = Progress("train rows", stream, clock=iter([0.0, 1.0, 2.0, 4.0]).__next__)
        progress.start(3000, 2)
        progress.advance(1000)
        progress.advance(2000)
        progress.finish()
    assert log.getvalue() == "shardtune: tokenised 3,000 train rows in 4.0 s (750 rows/s, 2 workers)\n"
    drawn = terminal.getvalue().split("\r")[1:]
    assert drawn[0].startswith("shardtune: tokenising 1,000 / 3,000 train rows (33%, 1,000 rows/s, 2 workers)")
    assert drawn[1].startswith("shardtune: tokenising 3,000 / 3,000 train rows (100%, 1,500 rows/s")
    assert drawn[2].startswith("shardtune: tokenised 3,000 train rows in 4.0 s (750 rows/s, 2 workers)")
    assert terminal.getvalue().endswith("\n")
