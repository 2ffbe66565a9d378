"""A vision-language model trained through the Python face as TRL's docs train one: ``SFTTrainer(model=<an
AutoModelForImageTextToText>, processing_class=<its AutoProcessor>, train_dataset=<a datasets.Dataset of images +
messages>)``, in this process (plain ``python``: the script's process is the run's one worker), against TRL's own
SFTTrainer on the same model and rows (tests/distributed/test_vision.py's trl_history). How each form of image
travels, and the refusals, are tests/unit/test_vision_inputs.py's."""

from __future__ import annotations

import json

import pytest

from tests.distributed.test_vision import assert_trls_losses, trl_history
from tests.vision_data import write_squares


def test_sft_trainer_on_a_vision_model_object_gives_trls_losses(tmp_path, cache_dir, monkeypatch):
    """llava, 16 rows (PIL images) x 2 epochs, batch 4 x accumulation 2, evaluated every 2 steps on 4 rows whose images
    are paths relative to the script's working directory: per-step and evaluation losses equal TRL's (rel 1e-5:
    assert_trls_losses' float32 reasoning); the trained model loads back as its own class."""
    from datasets import Dataset
    from PIL import Image
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from shardtune import SFTConfig, SFTTrainer
    from shardtune.model.loading import init_model

    monkeypatch.setenv("SHARDTUNE_CACHE", str(cache_dir))
    model_dir = init_model("vlm-llava-tiny", tmp_path / "llava", seed=0)
    data = write_squares(tmp_path / "squares", {"train": 16, "test": 4}, seed=2)

    def rows(split: str) -> list[dict]:
        return [json.loads(line) for line in (data / f"{split}.jsonl").read_text().splitlines()]

    train = [{**row, "images": [Image.open(data / p).convert("RGB") for p in row["images"]]} for row in rows("train")]
    monkeypatch.chdir(data)  # the evaluation rows name their images relative to here
    out = tmp_path / "ours"
    args = SFTConfig(
        output_dir=str(out),
        per_device_train_batch_size=4,
        per_device_eval_batch_size=4,
        gradient_accumulation_steps=2,
        num_train_epochs=2,
        learning_rate=1e-3,
        logging_steps=1,
        eval_strategy="steps",
        eval_steps=2,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        bf16=False,
        seed=0,
        train_sampling_strategy="sequential",
    )
    trainer = SFTTrainer(
        model=AutoModelForImageTextToText.from_pretrained(model_dir),
        args=args,
        train_dataset=Dataset.from_list(train),
        eval_dataset=Dataset.from_list(rows("test")),
        processing_class=AutoProcessor.from_pretrained(model_dir),
    )
    result = trainer.train()
    assert result.global_step == 4
    history = trl_history(model_dir, data, tmp_path / "trl")
    assert_trls_losses(out, history, "python face")
    theirs = [h["loss"] for h in history if "loss" in h]  # train()'s own log, as TRL's state keeps it
    assert [h["loss"] for h in trainer.state.log_history if "loss" in h] == pytest.approx(theirs, rel=1e-5, abs=0)
    assert type(trainer.model).__name__ == "LlavaForConditionalGeneration"
    assert type(AutoProcessor.from_pretrained(out)).__name__ == "LlavaProcessor"  # saved beside the model
