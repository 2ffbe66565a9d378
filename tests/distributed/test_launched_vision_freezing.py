"""--freeze_LLM_only (llama-cookbook's) through the real launcher under FSDP2, where a unit holds frozen and trainable
parameters side by side (the root: frozen embeddings and head beside the trainable projector; mllama's decoder layers
beside its trainable cross-attention layer). Which parameters each freezing flag picks on every family is
tests/unit/test_vision_freezing.py's."""

from __future__ import annotations

import torch

from tests.helpers import step_rows
from tests.vision_data import write_squares


def test_freeze_llm_only_under_fsdp_keeps_the_language_model_and_trains_the_rest(run_cli, tmp_path):
    """mllama, FSDP 2 processes, 2 steps at a large learning rate: the saved model's language model (embeddings,
    self-attention layers, norm, head) is bit-identical to the base; every parameter of the vision tower, the projector
    and the cross-attention layer changed."""
    from transformers import AutoModelForImageTextToText

    from shardtune.model.loading import init_model

    base = init_model("vlm-mllama-tiny", tmp_path / "base", seed=0)
    data = write_squares(tmp_path / "squares", {"train": 8}, seed=3)
    out = tmp_path / "out"
    run_cli(
        "sft",
        "--defaults",
        "trl",
        "--model_name",
        base,
        "--dataset_name",
        data,
        "--output_dir",
        out,
        "--nproc_per_node",
        "2",
        "--fsdp",
        "full_shard",
        "--per_device_train_batch_size",
        "2",
        "--max_steps",
        "2",
        "--learning_rate",
        "1e-2",
        "--logging_steps",
        "1",
        "--freeze_LLM_only",
    )
    assert len(step_rows(out)) == 2
    before = AutoModelForImageTextToText.from_pretrained(base).state_dict()
    after = AutoModelForImageTextToText.from_pretrained(out).state_dict()
    assert before.keys() == after.keys()
    cross_attention = "model.language_model.layers.1."  # the preset's cross_attention_layers: [1]
    frozen = [k for k in before if k.startswith(("model.language_model.", "lm_head.")) and cross_attention not in k]
    trained = [k for k in before if k not in frozen]
    assert len(frozen) == 21 and len(trained) == 66
    assert [k for k in frozen if not torch.equal(before[k], after[k])] == []
    # Adam's first steps move every weight with a gradient by ~lr = 1e-2: none of them stays bit-identical
    assert [k for k in trained if torch.equal(before[k], after[k])] == []
    assert any(k.startswith("model.vision_model.") for k in trained) and any(cross_attention in k for k in trained)
