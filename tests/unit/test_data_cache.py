"""The tokenised-data cache returns exactly what load_examples returns, and notices changed data."""

from __future__ import annotations

import json

from shardtune.config.flags import config_from
from shardtune.config.schema import TrainConfig
from shardtune.data import load_examples
from shardtune.data.cache import cache_key, load_examples_cached
from shardtune.model.loading import train_tokenizer


def test_cached_examples_equal_fresh_ones_and_are_reused(tmp_path):
    tokenizer = train_tokenizer()
    cfg = TrainConfig()
    cfg.data.synthetic_dialogues.num_train = 50
    fresh, report = load_examples(cfg, tokenizer, "train")
    first, first_report = load_examples_cached(cfg, tokenizer, "train", tmp_path)
    again, again_report = load_examples_cached(cfg, tokenizer, "train", tmp_path)
    assert first == fresh == again
    assert first_report == report == again_report
    assert len([p for p in (tmp_path / "tokenized").iterdir() if p.is_dir()]) == 1
    assert not list((tmp_path / "tokenized").glob(".*.tmp-*"))


def test_key_follows_settings_tokenizer_and_file_contents(tmp_path):
    tokenizer = train_tokenizer()
    data = tmp_path / "train.jsonl"
    data.write_text(json.dumps({"dialogue": "A: hi", "summary": "hi"}))
    cfg = config_from(dataset="samsum_dataset")
    cfg.data.samsum_dataset.data_path = str(data)
    key = cache_key(cfg, tokenizer, "train")
    assert cache_key(cfg, tokenizer, "validation") != key
    data.write_text(json.dumps({"dialogue": "A: hello", "summary": "hello"}))
    assert cache_key(cfg, tokenizer, "train") != key
    cfg.data.context_length = 99
    assert cache_key(cfg, tokenizer, "train") != cache_key(config_from(dataset="samsum_dataset"), tokenizer, "train")
    assert cache_key(cfg, train_tokenizer(vocab_size=512), "train") != cache_key(cfg, tokenizer, "train")
