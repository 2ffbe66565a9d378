"""Bad files are one line or a rebuild, never a traceback: a damaged cache entry, metrics with NaN, a broken
config.json (without launching anything)."""

from __future__ import annotations

import json
import math

import pytest

from shardtune.config.flags import config_from
from shardtune.config.schema import ConfigError, TrainConfig
from shardtune.data.cache import load_examples_cached
from shardtune.model.loading import check_model_source, train_tokenizer
from shardtune.training.engine.metrics import MetricsWriter, read_metrics


def test_an_emptied_cache_file_is_removed_and_rebuilt_with_a_note(tmp_path, capsys):
    tokenizer = train_tokenizer()
    cfg = TrainConfig()
    cfg.data.synthetic_dialogues.num_train = 20
    store, _ = load_examples_cached(cfg, tokenizer, "train", tmp_path)
    fresh = [dict(example) for example in store]  # read now: the store maps the files damaged below
    del store
    [entry] = [p for p in (tmp_path / "tokenized").iterdir() if p.is_dir()]
    (entry / "labels.npy").write_bytes(b"")  # what a power cut or a full disk leaves
    capsys.readouterr()
    again, _ = load_examples_cached(cfg, tokenizer, "train", tmp_path)
    assert again == fresh
    assert f"the tokenised-data cache entry {entry} is damaged (EOFError" in capsys.readouterr().err
    load_examples_cached(cfg, tokenizer, "train", tmp_path)
    assert capsys.readouterr().err == ""  # rebuilt: read as it is from now on


def test_metrics_jsonl_is_strict_json_with_non_finite_numbers_as_strings(tmp_path):
    path = tmp_path / "metrics.jsonl"
    writer = MetricsWriter(path)
    writer.write({"step": 1, "loss": math.nan, "grad_norm": math.inf, "lr": -math.inf, "num_tokens": 3})
    writer.close()
    [line] = path.read_text().splitlines()
    row = json.loads(line, parse_constant=lambda name: pytest.fail(f"bare {name} in metrics.jsonl"))
    assert (row["loss"], row["grad_norm"], row["lr"]) == ("NaN", "Infinity", "-Infinity")
    [back] = read_metrics(path)
    assert math.isnan(back["loss"]) and back["grad_norm"] == math.inf and back["lr"] == -math.inf


@pytest.mark.parametrize(
    "text,needle",
    [
        ('{"model_type": "llama", ', "is not valid JSON"),
        (
            '{"model_type": "no_such_model"}',
            ("cannot be read as a model config (The checkpoint you are trying to load has model type `no_such_model`"),
        ),
    ],
)
def test_a_broken_config_json_is_one_line_naming_the_file(tmp_path, text, needle):
    (tmp_path / "config.json").write_text(text)
    with pytest.raises(ConfigError) as e:
        check_model_source(str(tmp_path))
    assert str(tmp_path / "config.json") in str(e.value) and needle in str(e.value)
    assert "\n" not in str(e.value)


def test_checkpoint_hints_name_the_right_folder_and_flag(tmp_path):
    """--resume latest on a run without checkpoints names output_dir/checkpoints (not .../checkpoints/checkpoints);
    export's errors offer no --resume, which export does not take."""
    from shardtune.training.engine.checkpoint.layout import checkpoint_root, resolve_checkpoint

    root = checkpoint_root(config_from(output_dir=str(tmp_path / "run")))
    root.mkdir(parents=True)
    with pytest.raises(ConfigError) as caught:
        resolve_checkpoint("latest", root)
    assert str(caught.value).startswith(f"--resume latest: no complete checkpoint in {root}: drop --resume")
    with pytest.raises(ConfigError) as caught:
        resolve_checkpoint(str(tmp_path / "run"), tmp_path, resume=False)
    assert "is not a complete checkpoint" in str(caught.value) and "--resume" not in str(caught.value)
    with pytest.raises(ConfigError, match="pass one, or --resume latest$"):
        resolve_checkpoint(str(tmp_path / "run"), tmp_path)
