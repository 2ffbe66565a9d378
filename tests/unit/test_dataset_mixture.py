"""Dataset mixtures (TRL's ``datasets:`` in a recipe, ``--dataset_mixture path[@split][:weight],...``): parsed into one
setting that enters the cache key and config.yaml; each source gives round(share x N) rows (N: all sources' rows),
seeded, upsampled when it has too few; TRL's own forms (no weight: concatenation; ``fraction``) give TRL's rows.
Nothing here launches."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import yaml

from shardtune.config.flags import from_dict, parse_args, to_yaml
from shardtune.config.schema import ConfigError
from shardtune.data.mixture import composition, draw, mixture_rows
from shardtune.data.trl_loading import check_trl_config, drop_absent_validation


def write_rows(path: Path, num_rows: int, tag: str, columns=("prompt", "completion")) -> str:
    rows = [{column: f"{tag}{i} {column}" for column in columns} for i in range(num_rows)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.fixture
def files(tmp_path):
    return write_rows(tmp_path / "a.jsonl", 1000, "a"), write_rows(tmp_path / "b.jsonl", 100, "b")


def recipe(tmp_path: Path, content: dict) -> str:
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(content))
    return str(path)


def one_line_error(argv: list[str], check=check_trl_config) -> str:
    with pytest.raises(ConfigError) as error:
        check(parse_args(argv))
    assert "\n" not in str(error.value)
    return str(error.value)


def test_trls_datasets_list_selects_the_mixture_and_round_trips_through_config_yaml(tmp_path, files):
    a, b = files
    cfg = parse_args(
        [
            "--config",
            recipe(
                tmp_path,
                {
                    "datasets": [
                        {"path": a, "columns": ["prompt", "completion"], "weight": 2},
                        {"path": b, "split": "train"},
                    ]
                },
            ),
        ]
    )
    entries = cfg.data.trl_dataset.dataset_mixture
    assert cfg.data.dataset == "trl_dataset" and [e["path"] for e in entries] == [a, b]
    assert (entries[0]["weight"], entries[1]["weight"], entries[0]["columns"]) == (2.0, None, ["prompt", "completion"])
    assert from_dict(yaml.safe_load(to_yaml(cfg))).data.trl_dataset.dataset_mixture == entries
    check_trl_config(cfg)


def test_the_command_line_form_is_path_at_split_colon_weight(files):
    a, _ = files
    entries = parse_args(["--dataset_mixture", f"{a}:0.7,org/chats@validation:0.3,org/more"]).data.trl_dataset
    got = [(e["path"], e["split"], e["weight"]) for e in entries.dataset_mixture]
    assert got == [(a, "train", 0.7), ("org/chats", "validation", 0.3), ("org/more", "train", None)]


def test_the_cache_key_hashes_every_entrys_file_and_the_weights(tmp_path, files):
    from shardtune.data.cache import cache_key
    from shardtune.model.loading import train_tokenizer

    a, b = files
    tokenizer = train_tokenizer()
    key = cache_key(parse_args(["--dataset_mixture", f"{a}:0.7,{b}:0.3"]), tokenizer, "train")
    assert cache_key(parse_args(["--dataset_mixture", f"{a}:0.6,{b}:0.4"]), tokenizer, "train") != key
    write_rows(Path(b), 100, "changed")
    assert cache_key(parse_args(["--dataset_mixture", f"{a}:0.7,{b}:0.3"]), tokenizer, "train") != key


@pytest.mark.parametrize(
    "value, named",
    [
        ("", "--dataset_mixture '' names no dataset: pass path"),
        ("a.jsonl:0", "weight '0' is not a positive number"),
        ("a.jsonl:-1,b.jsonl", "weight '-1' is not a positive number"),
        ("a.jsonl:heavy", "weight 'heavy' is not a positive number"),
    ],
)
def test_bad_command_line_values_are_refused_in_one_line(value, named):
    assert named in one_line_error(["--dataset_mixture", value], check=lambda cfg: None)


def test_bad_entries_and_combinations_are_refused_naming_the_value_and_the_fix(tmp_path, files):
    a, b = files
    mixture = ["--dataset_mixture", f"{a}:0.7,{b}:0.3"]
    for argv, named in [
        ([*mixture, "--dataset_name", a], f"--dataset_mixture and --dataset_name {a} both name the data: drop one"),
        (["--dataset_mixture", f"{a},{tmp_path}/missing.jsonl"], "entry 2 (" + f"{tmp_path}/missing.jsonl): no such"),
        ([*mixture, "--dataset_train_split", "dev"], "--dataset_train_split dev has no effect with --dataset_mixture"),
        ([*mixture, "--dataset_streaming", "true"], "drop --dataset_streaming"),
    ]:
        assert named in one_line_error(argv)
    for datasets, named in [
        ([{"path": a, "sample": 0.5}], "datasets: entry 1: unknown key 'sample' (known: path, name, data_dir"),
        ([{"path": a, "weight": 0}], "weight 0 is not a positive number"),
        ([{"split": "train"}], "datasets: entry 1 has no path"),
        ([{"path": a, "fraction": 0.5}, {"path": b}], "fraction (TRL's) is set on some entries only"),
        ([{"path": a, "fraction": 0.5}, {"path": b, "fraction": 0.5, "weight": 1}], "use one"),
    ]:
        assert named in one_line_error(["--config", recipe(tmp_path, {"datasets": datasets})], check=lambda cfg: None)


def test_sources_with_different_formats_are_refused_naming_both(tmp_path, files):
    a, _ = files
    chats = write_rows(tmp_path / "c.jsonl", 10, "c", columns=("messages",))
    with pytest.raises(ConfigError, match=f"{a} has columns prompt, completion but {chats} has messages") as error:
        mixture_rows(parse_args(["--dataset_mixture", f"{a},{chats}"]), "train")
    assert "\n" not in str(error.value)


def test_each_source_gives_round_share_times_all_rows_and_the_report_says_how_many(files):
    a, b = files
    cfg = parse_args(["--dataset_mixture", f"{a}:0.7,{b}:0.3"])
    source, rows, columns = mixture_rows(cfg, "train")
    assert Counter(origin for origin, _, _ in rows) == {a: round(0.7 * 1100), b: round(0.3 * 1100)}
    assert columns == ["prompt", "completion"]
    assert (
        source == f"mixture of 2 datasets (by weight, seed 42): {a} 770 of 1000 rows, {b} 330 rows (upsampled from 100)"
    )
    # a's rows: a seeded subset, each once; b's: every row 3 or 4 times; each row is its source's numbered row
    taken = Counter((origin, number) for origin, number, _ in rows)
    assert max(n for (origin, _), n in taken.items() if origin == a) == 1
    assert sorted(Counter(n for (origin, _), n in taken.items() if origin == b).items()) == [(3, 70), (4, 30)]
    assert all(record["prompt"] == f"{'a' if o == a else 'b'}{n - 1} prompt" for o, n, record in rows)
    # the sources are interleaved, not one after the other
    assert {o for o, _, _ in rows[:50]} == {a, b}


@pytest.mark.parametrize("sizes, weights", [([1000, 100], [0.7, 0.3]), ([7, 13, 5], [1, 2, 3]), ([3, 50], [None, 4])])
def test_the_composition_matches_the_weights_exactly(sizes, weights):
    entries = [{"fraction": None, "weight": w} for w in weights]
    shares = [(w or 1.0) / sum(w or 1.0 for w in weights) for w in weights]
    counts = composition(sizes, entries)
    assert counts == [round(share * sum(sizes)) for share in shares]
    assert Counter(s for s, _ in draw(sizes, counts, seed=3)) == dict(enumerate(counts))


def test_the_same_seed_gives_the_same_mixture_and_another_seed_another_order(files):
    a, b = files

    def rows(seed: int) -> list:
        return mixture_rows(parse_args(["--dataset_mixture", f"{a}:1,{b}:1", "--seed", str(seed)]), "train")[1]

    assert rows(7) == rows(7)
    assert rows(7) != rows(8) and sorted(map(str, rows(7))) != sorted(map(str, rows(8)))


def test_trls_own_forms_give_trls_rows(tmp_path, files):
    """No weight: TRL's concatenation; fraction: TRL 1.16's first rows of the largest mixture that repeats none (the
    oracle: trl's get_dataset on the same entries)."""
    from trl import DatasetMixtureConfig, get_dataset

    a, b = files
    for extra in ({}, {"fraction": 0.5}):
        datasets = [{"path": "json", "data_files": path, **extra} for path in (a, b)]
        cfg = parse_args(["--config", recipe(tmp_path, {"datasets": datasets})])
        theirs = get_dataset(DatasetMixtureConfig(datasets=[dict(d) for d in datasets]))["train"].to_list()
        assert [record for _, _, record in mixture_rows(cfg, "train")[1]] == theirs
    assert composition([1000, 100], [{"fraction": 0.5}, {"fraction": 0.5}]) == [100, 100]


def test_a_mixture_trains_without_evaluation_and_refuses_a_command_asking_for_it(files, capsys):
    a, b = files
    cfg = parse_args(["--dataset_mixture", f"{a},{b}"])
    cfg.eval.enabled = True  # as the cookbook's default, not asked for by a flag
    drop_absent_validation(cfg, say=True)
    assert not cfg.eval.enabled and "has no evaluation split: training without evaluation" in capsys.readouterr().out
    with pytest.raises(ConfigError, match="--eval_strategy asks for evaluation, but --dataset_mixture .* drop"):
        drop_absent_validation(parse_args(["--dataset_mixture", f"{a},{b}", "--eval_strategy", "steps"]), say=False)
