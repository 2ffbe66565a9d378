"""Presets, the trained tokenizer, atomic model directories and early, one-line model-source errors."""

import json
import os

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from shardtune.config.schema import ConfigError
from shardtune.data.synthetic import PROMPT_PREFIX, PROMPT_SUFFIX, generate_dialogues
from shardtune.model.loading import (
    PRESET_VERSION,
    PRESETS,
    build_model_on_meta,
    cache_dir,
    check_model_source,
    count_parameters,
    init_model,
    load_model,
    load_tokenizer,
    preset_fingerprint,
    resolve_model_name,
    train_tokenizer,
)


@pytest.fixture(autouse=True)
def isolated_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDTUNE_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)  # relative names must not resolve against the repository


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return init_model("tiny", tmp_path_factory.mktemp("models") / "tiny", seed=0)


def test_tokenizer_is_deterministic_and_never_adds_bos_or_eos():
    first, second = train_tokenizer(seed=0), train_tokenizer(seed=0)
    assert first.backend_tokenizer.to_str() == second.backend_tokenizer.to_str()
    assert len(first) == 1024
    ids = first("Anna: Hi!").input_ids
    assert first.bos_token_id not in ids and first.eos_token_id not in ids
    assert (first.bos_token, first.eos_token, first.pad_token, first.unk_token) == ("<s>", "</s>", "<pad>", "<unk>")
    assert first.padding_side == "right"


def test_tokenizer_round_trips_dialogue_text_and_save_load(tmp_path):
    tokenizer = train_tokenizer()
    tokenizer.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    for row in generate_dialogues(20, seed=9, split="validation"):
        text = PROMPT_PREFIX + row["dialogue"] + PROMPT_SUFFIX + row["summary"]
        ids = tokenizer(text).input_ids
        assert loaded(text).input_ids == ids
        assert loaded.decode(ids) == text
    assert loaded.pad_token_id == tokenizer.pad_token_id and loaded.eos_token_id == tokenizer.eos_token_id


def test_init_model_writes_a_loadable_hugging_face_directory(tiny_dir):
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json"} <= set(os.listdir(tiny_dir))
    assert not [p for p in os.listdir(tiny_dir.parent) if p.startswith(".tmp-")]
    # the class name transformers 4 readers know, too
    assert json.loads((tiny_dir / "tokenizer_config.json").read_text())["tokenizer_class"] == "PreTrainedTokenizerFast"
    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    assert model.config.vocab_size == len(tokenizer)
    assert model.config.bos_token_id == tokenizer.bos_token_id == model.generation_config.bos_token_id
    assert model.config.pad_token_id == tokenizer.pad_token_id == model.generation_config.pad_token_id
    assert model.config.eos_token_id == tokenizer.eos_token_id == model.generation_config.eos_token_id
    total, trainable = count_parameters(model)
    assert total == trainable < 1_000_000


def test_init_model_is_reproducible_from_the_seed(tiny_dir, tmp_path):
    same = load_file(init_model("tiny", tmp_path / "same", seed=0) / "model.safetensors")
    other = load_file(init_model("tiny", tmp_path / "other", seed=1) / "model.safetensors")
    reference = load_file(tiny_dir / "model.safetensors")
    assert all(torch.equal(reference[k], same[k]) for k in reference)
    assert not torch.equal(reference["model.embed_tokens.weight"], other["model.embed_tokens.weight"])


def test_init_model_refuses_a_non_empty_directory(tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="not empty"):
        init_model("tiny", tmp_path / "out")
    assert os.listdir(tmp_path / "out") == ["notes.txt"]


def test_init_model_fills_an_existing_empty_directory(tmp_path):
    (tmp_path / "out").mkdir()
    assert (init_model("tiny", tmp_path / "out") / "config.json").is_file()


def test_resolve_model_name_builds_a_preset_once_into_the_cache():
    path = resolve_model_name("preset:tiny")
    assert path == str(cache_dir() / "presets" / f"tiny-{PRESET_VERSION}-{preset_fingerprint('tiny')}")
    weights = os.stat(os.path.join(path, "model.safetensors"))
    assert resolve_model_name("preset:tiny") == path
    again = os.stat(os.path.join(path, "model.safetensors"))
    assert (again.st_ino, again.st_mtime_ns) == (weights.st_ino, weights.st_mtime_ns)
    assert resolve_model_name("/some/model") == "/some/model" and resolve_model_name("org/name") == "org/name"


def test_empty_model_name_means_the_demo_preset():
    assert resolve_model_name("").endswith(f"demo-{PRESET_VERSION}-{preset_fingerprint('demo')}")


def test_a_preset_is_the_same_bytes_in_any_fresh_cache_and_a_cache_left_by_other_code_is_not_reused(
    tmp_path, monkeypatch
):
    """What a fresh clone builds is what a warm cache holds: the demo's figures cannot depend on the cache."""
    stale = cache_dir() / "presets" / f"tiny-{PRESET_VERSION}"  # its name before it carried the fingerprint
    stale.mkdir(parents=True)
    (stale / "config.json").write_text("{}")
    first = resolve_model_name("preset:tiny")
    assert first != str(stale)
    monkeypatch.setenv("SHARDTUNE_CACHE", str(tmp_path / "another-cache"))
    second = resolve_model_name("preset:tiny")
    assert second != first
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert open(os.path.join(first, name), "rb").read() == open(os.path.join(second, name), "rb").read(), name


def test_load_model_and_tokenizer_from_a_preset_directory(tiny_dir):
    model = load_model(str(tiny_dir), dtype=torch.bfloat16)
    tokenizer = load_tokenizer(str(tiny_dir))
    batch = tokenizer(["Anna: Hi!", "Tom: Hello there, how are you?"], padding=True, return_tensors="pt")
    assert model.dtype == torch.bfloat16 and model.config._attn_implementation == "sdpa"
    assert model(**batch).logits.shape[:2] == batch["input_ids"].shape


def test_load_tokenizer_gives_a_pad_token_to_tokenizers_without_one(tmp_path):
    tokenizer = train_tokenizer()
    tokenizer.pad_token = None
    tokenizer.save_pretrained(tmp_path)
    assert load_tokenizer(str(tmp_path)).pad_token == "</s>"


def test_build_model_on_meta_allocates_nothing_and_matches_the_real_shapes(tiny_dir):
    meta = build_model_on_meta(str(tiny_dir), dtype=torch.bfloat16)
    real = load_model(str(tiny_dir))
    assert all(p.is_meta and p.dtype == torch.bfloat16 for p in meta.parameters())
    assert {k: v.shape for k, v in meta.state_dict().items()} == {k: v.shape for k, v in real.state_dict().items()}


def test_benchmark_presets_have_the_llama_shapes():
    assert PRESETS["llama-8b-shape"]["hidden_size"] == 4096 and PRESETS["llama-8b-shape"]["vocab_size"] == 128256
    assert PRESETS["llama-1b-shape"]["num_hidden_layers"] == 16


def test_check_model_source_accepts_presets_and_model_directories(tiny_dir):
    for ok in ("", "preset:tiny", "preset:demo", str(tiny_dir)):
        check_model_source(ok)
    check_model_source(str(tiny_dir), what="tokenizer_name")


def test_check_model_source_rejects_a_missing_directory():
    with pytest.raises(ConfigError, match=r"--model_name ./nowhere: no such directory"):
        check_model_source("./nowhere")


def test_check_model_source_rejects_a_directory_without_config_json(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="has no config.json"):
        check_model_source(str(tmp_path / "empty"))


def test_check_model_source_treats_a_partly_existing_path_as_a_path(tmp_path):
    (tmp_path / "models").mkdir()
    with pytest.raises(ConfigError, match="no such directory"):
        check_model_source("models/llama")


def test_check_model_source_explains_an_unreachable_hub_id(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ConfigError) as error:
        check_model_source("shardtune-tests/no-such-model", what="tokenizer_name")
    message = str(error.value)
    assert "--tokenizer_name 'shardtune-tests/no-such-model' is not a local directory" in message
    assert "HF_HUB_OFFLINE" in message and "local path" in message and "\n" not in message


def test_check_model_source_lists_the_presets_for_an_unknown_one():
    with pytest.raises(ConfigError, match="unknown preset: choose one of preset:tiny, preset:demo"):
        check_model_source("preset:huge")
    with pytest.raises(ConfigError, match="unknown preset"):
        resolve_model_name("preset:huge")


def test_generation_config_carries_the_special_ids(tiny_dir):
    generation = json.loads((tiny_dir / "generation_config.json").read_text())
    assert (generation["bos_token_id"], generation["eos_token_id"], generation["pad_token_id"]) == (1, 2, 3)
