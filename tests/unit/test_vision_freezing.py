"""Freezing parts of a vision-language model (shardtune.model.freezing), without launching: on every tiny vision
preset, which parameters --freeze_vision_tower, --freeze_multi_modal_projector, --freeze_language_model (LLaMA-Factory's
names) and --freeze_LLM_only (llama-cookbook's) keep as they are, --freeze_layers counting the language model's
layers, and the one-line refusals. tests/distributed/test_launched_vision_freezing.py trains with one of them
under FSDP."""

from __future__ import annotations

from pathlib import Path

import pytest

from shardtune.config.flags import parse_args
from shardtune.config.schema import ConfigError
from shardtune.model.freezing import apply_freezing, check_freeze_layers, check_freezing_settings, check_vision_freezing
from shardtune.model.vision_presets import VISION_PRESETS

# Each preset's parts as prefixes of its parameter names, read off transformers' classes (the spec, written out by
# hand): tower, projector, language model (decoder and head), and the language model's cross-attention layers.
LANGUAGE = ("model.language_model.", "lm_head.")
PARTS = {
    "vlm-llava-tiny": (("model.vision_tower.",), ("model.multi_modal_projector.",), LANGUAGE, ()),
    # Qwen2-VL's projector is the tower's merger (LLaMA-Factory's qwen2_vl: visual.merger)
    "vlm-qwen2vl-tiny": (
        ("model.visual.patch_embed.", "model.visual.blocks."),
        ("model.visual.merger.",),
        LANGUAGE,
        (),
    ),
    # the mllama preset's one cross-attention layer is its text model's layer 1
    "vlm-mllama-tiny": (
        ("model.vision_model.",),
        ("model.multi_modal_projector.",),
        LANGUAGE,
        ("model.language_model.layers.1.",),
    ),
    "vlm-idefics3-tiny": (("model.vision_model.",), ("model.connector.",), ("model.text_model.", "lm_head."), ()),
    "vlm-gemma3-tiny": (("model.vision_tower.",), ("model.multi_modal_projector.",), LANGUAGE, ()),
}
FLAGS = ("--freeze_vision_tower", "--freeze_multi_modal_projector", "--freeze_language_model", "--freeze_LLM_only")


@pytest.fixture(scope="module")
def presets(tmp_path_factory) -> dict[str, Path]:
    from shardtune.model.loading import init_model

    root = tmp_path_factory.mktemp("vision-presets")
    return {name: init_model(name, root / name, seed=0) for name in VISION_PRESETS}


def config(model: Path, *flags: str):
    return parse_args(["--model_name", str(model), *flags])


def frozen_after(model_dir: Path, *flags: str) -> set[str]:
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(model_dir)
    apply_freezing(model, config(model_dir, *flags))
    return {name for name, param in model.named_parameters() if not param.requires_grad}


def test_the_table_names_every_preset() -> None:
    assert set(PARTS) == set(VISION_PRESETS)


@pytest.mark.parametrize("preset", sorted(PARTS))
def test_each_flag_freezes_its_part_on_every_family(presets, preset) -> None:
    """The parts partition the parameters (every one in exactly one of tower, projector, language model); each flag
    freezes exactly its part; --freeze_LLM_only the language model but its cross-attention layers (all of it where
    the family has none); with no flag nothing is frozen."""
    from transformers import AutoModelForImageTextToText

    names = [n for n, _ in AutoModelForImageTextToText.from_pretrained(presets[preset]).named_parameters()]
    tower, projector, language, cross = (
        {n for n in names if n.startswith(prefixes)} if prefixes else set() for prefixes in PARTS[preset]
    )
    assert tower and projector and language, preset
    assert len(tower) + len(projector) + len(language) == len(names) == len(tower | projector | language)
    assert bool(cross) == (preset == "vlm-mllama-tiny")
    expected = {FLAGS[0]: tower, FLAGS[1]: projector, FLAGS[2]: language, FLAGS[3]: language - cross}
    for flag, part in expected.items():
        assert frozen_after(presets[preset], flag) == part, (preset, flag)
    assert frozen_after(presets[preset]) == set()
    assert frozen_after(presets[preset], FLAGS[0], FLAGS[1]) == tower | projector


def test_freeze_layers_counts_the_language_models_layers(presets) -> None:
    """--freeze_layers N on a vision-language model: its language model's first N decoder layers (the tower's blocks,
    which come first in the module tree, are not counted), and N is checked against the text model's depth."""
    llava = presets["vlm-llava-tiny"]
    frozen = frozen_after(llava, "--freeze_layers", "--num_freeze_layers", "1")
    assert frozen and all(name.startswith("model.language_model.layers.0.") for name in frozen), sorted(frozen)
    check_freeze_layers(config(llava, "--freeze_layers", "--num_freeze_layers", "2"))
    with pytest.raises(ConfigError, match="--num_freeze_layers 3 exceeds the 2 decoder layers"):
        check_freeze_layers(config(llava, "--freeze_layers", "--num_freeze_layers", "3"))


def test_the_peers_names_set_the_settings() -> None:
    cfg = parse_args(["--freeze_LLM_only", "--freeze_vision_tower", "--freeze_multi_modal_projector", "true"])
    assert (cfg.model.freeze_llm_only, cfg.model.freeze_vision_tower, cfg.model.freeze_multi_modal_projector) == (
        True,
        True,
        True,
    )
    assert not parse_args(["--freeze_LLM_only", "false"]).model.freeze_llm_only
    assert parse_args(["--freeze_language_model"]).model.freeze_language_model
    assert parse_args(["--model.freeze_llm_only", "true"]).model.freeze_llm_only


@pytest.mark.parametrize(
    "flags,message",
    [
        (
            ("--freeze_vision_tower", "--use_peft"),
            "--freeze_vision_tower applies to full fine-tuning; with --use_peft the whole base model",
        ),
        (
            ("--freeze_LLM_only", "--freeze_language_model"),
            "--freeze_language_model freezes the whole language model and --freeze_LLM_only all of it but",
        ),
        (
            ("--freeze_layers", "--freeze_LLM_only"),
            "--freeze_layers freezes decoder layers of the language model, which --freeze_LLM_only freezes already",
        ),
    ],
)
def test_combinations_are_refused_from_the_settings_alone(flags, message) -> None:
    with pytest.raises(ConfigError, match=message):
        check_freezing_settings(parse_args(list(flags)), 1)


def test_a_text_model_a_missing_part_or_nothing_left_to_train_is_refused(presets, tiny_model) -> None:
    with pytest.raises(ConfigError, match="--freeze_LLM_only applies to vision-language models, and .* has no vision"):
        check_vision_freezing(config(tiny_model, "--freeze_LLM_only"))
    everything = ("--freeze_vision_tower", "--freeze_multi_modal_projector", "--freeze_LLM_only")
    with pytest.raises(ConfigError, match="leave no weight of .*vlm-llava-tiny to train: drop one of them"):
        check_vision_freezing(config(presets["vlm-llava-tiny"], *everything))
    check_vision_freezing(config(presets["vlm-mllama-tiny"], *everything))  # its cross-attention layers train
    for preset in PARTS:
        check_vision_freezing(config(presets[preset], *FLAGS[:2]))  # every family has a tower and a projector
