"""Vision-language SFT (docs/vision.md) through the real launcher: images + chat messages train alike on one
process, DDP, FSDP and ZeRO-3 and as TRL's SFTTrainer does on the same model and rows; LoRA leaves an adapter peft
loads onto the base; the outputs load with their processor, export, merge and answer about an image; a toy task
(the colour of a square) is learned.

The models are tiny random ones built from configs (shardtune.model.vision_presets), the images drawn here
(tests/vision_data.py). Rows are taken in order (--train_sampling_strategy sequential, TRL's too) so that TRL's
trainer sees the same rows at each step; shardtune's own seeded shuffle is tested elsewhere.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests.helpers import assert_same_training, eval_rows, step_rows, weights
from tests.rounding import assert_same_adam_training
from tests.vision_data import QUESTION, write_squares

OCRVQA = Path(__file__).parent.parent / "ocrvqa_squares.py"  # a llama-cookbook style custom dataset file
STEPS = 4  # 16 rows, an effective batch of 8, 2 epochs
# (processes, per-device batch) x accumulation 2 = 8 rows a step, and the flags of the layout
LAYOUTS = {
    "single": (1, 4),
    "ddp": (2, 2),
    "fsdp": (2, 2, "--fsdp", "full_shard"),
    "zero3": (2, 2, "--enable_deepspeed", "--deepspeed_config.zero_stage", "3"),
}
TRAIN = (
    "--defaults",
    "trl",
    "--gradient_accumulation_steps",
    "2",
    "--num_train_epochs",
    "2",
    "--learning_rate",
    "1e-3",
    "--logging_steps",
    "1",
    "--train_sampling_strategy",
    "sequential",
    "--eval_strategy",
    "steps",
    "--eval_steps",
    "2",
)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """name -> a tiny random model of that vision preset, with its processor (built on first use)."""
    from shardtune.model.loading import train_tokenizer
    from shardtune.model.vision_presets import build_vision_preset

    root, models = tmp_path_factory.mktemp("vlm"), {}

    def get(name: str) -> Path:
        if name not in models:
            out = root / name
            out.mkdir()
            build_vision_preset(name, train_tokenizer(), out, seed=0)
            models[name] = out
        return models[name]

    return get


@pytest.fixture(scope="module")
def squares(tmp_path_factory) -> Path:
    return write_squares(tmp_path_factory.mktemp("squares"), {"train": 16, "test": 4}, seed=2)


def sft(run_cli, model: Path, data: Path, out: Path, layout: str, *extra) -> Path:
    procs, batch, *flags = LAYOUTS[layout]
    run_cli(
        "sft",
        *TRAIN,
        "--model_name",
        model,
        "--dataset_name",
        data,
        "--output_dir",
        out,
        "--nproc_per_node",
        str(procs),
        "--per_device_train_batch_size",
        str(batch),
        *flags,
        *extra,
    )
    return out


def eval_samples(out: Path) -> list[dict]:
    """--log_eval_samples' rows, predictions compared as text (greedy decoding of equal logits)."""
    rows = [json.loads(line) for line in (out / "eval_samples.jsonl").read_text().splitlines()]
    return [{k: v for k, v in row.items() if not k.startswith("rouge")} for row in rows]


def answers_of(data: Path) -> list[str]:
    return [json.loads(line)["messages"][-1]["content"] for line in (data / "test.jsonl").read_text().splitlines()]


def trl_history(model: Path, data: Path, out: Path) -> list[dict]:
    """TRL's SFTTrainer in this process on the same model and rows (images opened as a `datasets` Image column
    gives them), one process with the single layout's batch: its log_history."""
    from datasets import Dataset
    from PIL import Image
    from transformers import AutoModelForImageTextToText
    from trl import SFTConfig, SFTTrainer

    from shardtune.model.vision import load_processor_from  # AutoProcessor's, or Qwen2-VL's without torchvision

    def split(name: str) -> Dataset:
        rows = [json.loads(line) for line in (data / f"{name}.jsonl").read_text().splitlines()]
        for row in rows:
            row["images"] = [Image.open(data / path).convert("RGB") for path in row["images"]]
        return Dataset.from_list(rows)

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
        model=AutoModelForImageTextToText.from_pretrained(model),
        args=args,
        train_dataset=split("train"),
        eval_dataset=split("test"),
        processing_class=load_processor_from(str(model)),
    )
    trainer.train()
    return trainer.state.log_history


def assert_trls_losses(out: Path, history: list[dict], label: str) -> None:
    """Per-step losses and evaluation losses equal TRL's up to float32 rounding (sums over ~1,000 labelled tokens in
    another order and Adam's few steps: ~1e-6 relative; a different row, mask or normalisation moves them ~1e-3)."""
    theirs = [h["loss"] for h in history if "loss" in h]
    ours = [r["loss"] for r in step_rows(out)]
    assert ours == pytest.approx(theirs, rel=1e-5, abs=0), (label, ours, theirs)
    theirs_eval = [h["eval_loss"] for h in history if "eval_loss" in h]
    ours_eval = [r["eval_loss"] for r in eval_rows(out)]
    assert ours_eval == pytest.approx(theirs_eval, rel=1e-5, abs=0), (label, ours_eval, theirs_eval)


def test_llava_trains_alike_on_every_layout_and_as_trl(run_cli, built, squares, tmp_path):
    """1 x 4 == DDP 2 x 2 == FSDP 2 x 2 == ZeRO-3 2 x 2 (accumulation 2) == FSDP resumed at step 3: token counts,
    losses, gradient norms, evaluation losses and the final weights; and the same per-step and evaluation losses as
    TRL's SFTTrainer."""
    model = built("vlm-llava-tiny")
    flags = ("--save_steps", "3", "--log_eval_samples", "2")
    runs = {name: sft(run_cli, model, squares, tmp_path / name, name, *flags) for name in LAYOUTS}
    for name in ("ddp", "fsdp", "zero3"):
        assert_same_training(runs["single"], runs[name], name, num_steps=STEPS)
        ref, other = eval_rows(runs["single"]), eval_rows(runs[name])
        assert [r["eval_loss"] for r in other] == pytest.approx([r["eval_loss"] for r in ref], rel=1e-5), name
    # evaluation samples: the first two test rows answered at each evaluation, their images named, alike on every
    # layout (greedy; FSDP and ZeRO-3 generate on every rank alike)
    samples = {name: eval_samples(out) for name, out in runs.items()}
    assert [(s["step"], s["images"], s["reference"]) for s in samples["single"]] == [
        (step, f"img/test-{i}.png", reference) for step in (2, 4) for i, reference in enumerate(answers_of(squares)[:2])
    ]
    assert all(samples[name] == samples["single"] for name in LAYOUTS), samples
    # resumed from FSDP's checkpoint inside the second epoch: step 4 and the final weights as the run's without a
    # stop (LLaVA's tower has a weight without a gradient, hence without optimizer state: the checkpoint still loads)
    resumed = sft(
        run_cli, model, squares, tmp_path / "resumed", "fsdp", "--resume", runs["fsdp"] / "checkpoints" / "step-000003"
    )
    rows, ref_rows = step_rows(resumed), step_rows(runs["single"])
    assert [r["step"] for r in rows] == [4]
    assert rows[0]["loss"] == pytest.approx(ref_rows[3]["loss"], rel=1e-5, abs=0)
    assert rows[0]["grad_norm"] == pytest.approx(ref_rows[3]["grad_norm"], rel=1e-4)
    assert eval_rows(resumed)[-1]["eval_loss"] == pytest.approx(eval_rows(runs["single"])[-1]["eval_loss"], rel=1e-5)
    assert_same_adam_training(weights(runs["single"]), weights(resumed), 1e-3, ref_rows, "resumed")
    assert_trls_losses(runs["single"], trl_history(model, squares, tmp_path / "trl"), "llava")
    for name in ("single", "zero3"):  # the processor beside the model, as it was given
        from transformers import AutoProcessor

        assert type(AutoProcessor.from_pretrained(runs[name])).__name__ == "LlavaProcessor"


@pytest.mark.parametrize(
    "preset,layouts",
    [
        ("vlm-mllama-tiny", ("ddp", "fsdp", "zero3")),  # Llama 3.2 Vision: cross-attention layers, image tiles
        ("vlm-qwen2vl-tiny", ("ddp", "fsdp", "zero3")),  # Qwen2-VL: M-RoPE positions
        ("vlm-idefics3-tiny", ("ddp",)),  # SmolVLM: a SigLIP tower, pixel shuffle, image splitting
        ("vlm-gemma3-tiny", ("zero3",)),  # Gemma 3: bidirectional attention over image tokens
    ],
)
def test_other_families_train_as_trl(run_cli, built, squares, tmp_path, preset, layouts):
    """Each family, on layouts of two processes, gives TRL's per-step and evaluation losses (one process with the
    whole batch): so its layouts give each other's too."""
    model = built(preset)
    history = trl_history(model, squares, tmp_path / "trl")
    for layout in layouts:
        out = sft(run_cli, model, squares, tmp_path / layout, layout)
        assert len(step_rows(out)) == STEPS
        assert_trls_losses(out, history, f"{preset} {layout}")


def ocrvqa_file():
    """tests/ocrvqa_squares.py imported by its path, as shardtune imports it."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("ocrvqa_squares", OCRVQA)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def collator_loss(model: Path, rows: list[dict]) -> tuple[float, int]:
    """(mean next-token loss, labelled tokens) of ``model`` on the batch tests/ocrvqa_squares.py's collator makes of
    ``rows``, in this process: the loss the model itself computes from the collator's labels."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    batch = ocrvqa_file().get_data_collator(AutoProcessor.from_pretrained(model))(rows)
    with torch.no_grad():
        loss = AutoModelForImageTextToText.from_pretrained(model).eval()(**batch).loss
    return float(loss), int((batch["labels"][:, 1:] != -100).sum())


def test_cookbooks_vision_recipe_with_its_custom_dataset_file(run_cli, built, tmp_path):
    """llama-cookbook's multi-modal command (FSDP, padding, validation, its checkpoint folders) on Llama 3.2 Vision
    with a custom dataset file in the shape of its ocrvqa recipe (tests/ocrvqa_squares.py: the function given the
    processor, its own collator): 4 rows, one step an epoch. Step 1's loss is the base model's loss on the
    collator's batch of the 4 rows (over both ranks' rows: one normalisation for the step), the last evaluation the
    saved model's on the 2 test rows, and a run resumed from the epoch-2 checkpoint gives step 3 and the last
    evaluation alike (float32 sums of ~20 tokens in another order: ~1e-7 relative; normalising each rank's loss by
    its own tokens moves step 1 by 1.4e-4 on these rows, a row lost or a mask changed by more)."""
    model = built("vlm-mllama-tiny")
    data = write_squares(tmp_path / "squares", {"train": 4, "test": 2}, seed=4)
    cookbook = (
        *("--nproc_per_node", "2", "--enable_fsdp", "--lr", "1e-3", "--num_epochs", "3", "--batch_size_training", "2"),
        *("--model_name", model, "--dist_checkpoint_root_folder", "./finetuned_model"),
        *("--dist_checkpoint_folder", "fine-tuned", "--use_fast_kernels", "--dataset", "custom_dataset"),
        *("--custom_dataset.test_split", "test", "--custom_dataset.file", OCRVQA, "--custom_dataset.data_path", data),
        *("--run_validation", "True", "--batching_strategy", "padding"),
    )
    run_cli("sft", *cookbook, "--output_dir", tmp_path / "out", cwd=tmp_path)
    train, test = (
        ocrvqa_file().get_custom_dataset(SimpleNamespace(data_path=data), None, name) for name in ("train", "test")
    )
    rows, evals = step_rows(tmp_path / "out"), eval_rows(tmp_path / "out")
    assert [r["step"] for r in rows] == [1, 2, 3] and [r["step"] for r in evals] == [1, 2, 3]
    loss, num_labels = collator_loss(model, [train[i] for i in range(4)])
    assert (rows[0]["loss"], rows[0]["label_tokens"]) == (pytest.approx(loss, rel=1e-5, abs=0), num_labels)
    assert rows[2]["loss"] != pytest.approx(loss, rel=1e-3)  # it trained
    eval_loss, num_eval_labels = collator_loss(tmp_path / "out", [test[i] for i in range(2)])
    assert (evals[-1]["eval_loss"], evals[-1]["eval_label_tokens"]) == (
        pytest.approx(eval_loss, rel=1e-5, abs=0),
        num_eval_labels,
    )
    checkpoints = sorted(p.name for p in (tmp_path / "finetuned_model").rglob("step-*"))
    assert checkpoints == ["step-000001", "step-000002", "step-000003"]
    resume = next((tmp_path / "finetuned_model").rglob("step-000002"))
    run_cli("sft", *cookbook, "--output_dir", tmp_path / "resumed", "--resume", resume, cwd=tmp_path)
    resumed, resumed_evals = step_rows(tmp_path / "resumed"), eval_rows(tmp_path / "resumed")
    assert [r["step"] for r in resumed] == [3]
    assert resumed[0]["loss"] == pytest.approx(rows[2]["loss"], rel=1e-5, abs=0)
    assert resumed_evals[-1]["eval_loss"] == pytest.approx(evals[-1]["eval_loss"], rel=1e-5, abs=0)


def test_lora_adapter_loads_with_peft_merges_and_answers_about_an_image(run_cli, built, squares, tmp_path):
    """LoRA under FSDP on the language model's q_proj / v_proj only: the adapter peft loads onto the base changes
    the logits; export --merge writes a model with its processor; generate --image answers from both."""
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText, AutoProcessor

    model = built("vlm-llava-tiny")
    out = sft(
        run_cli,
        model,
        squares,
        tmp_path / "lora",
        "fsdp",
        "--use_peft",
        "--lora_r",
        "8",
        "--lora_target_modules",
        "q_proj",
        "v_proj",
        "--learning_rate",
        "1e-2",
    )
    targets = json.loads((out / "adapter_config.json").read_text())["target_modules"]
    assert targets and all(".language_model." in name for name in targets), targets
    processor = AutoProcessor.from_pretrained(out)
    image = squares / "img" / "test-0.png"
    prompt = processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}],
        add_generation_prompt=True,
    )
    from PIL import Image

    inputs = processor(images=[Image.open(image).convert("RGB")], text=[prompt], return_tensors="pt")
    base = AutoModelForImageTextToText.from_pretrained(model).eval()
    with torch.no_grad():
        before = base(**inputs).logits
        after = PeftModel.from_pretrained(base, out).eval()(**inputs).logits
    assert not torch.allclose(before, after)  # the trained adapter is on the base
    merged = tmp_path / "merged"
    run_cli("export", "--merge", out, merged)
    assert type(AutoProcessor.from_pretrained(merged)).__name__ == "LlavaProcessor"
    answers = [
        run_cli("generate", "--model_name", source, "--image", image, "--chat", QUESTION, "--max_new_tokens", 3).stdout
        for source in (out, merged)
    ]
    assert answers[0] == answers[1]  # greedy: base + adapter answers as the merged model does


def test_the_colour_of_a_square_is_learned(run_cli, built, tmp_path):
    """96 images, 12 epochs on one process, the loss on the assistant's answer only: on 30 held-out images the
    generated answer is the square's colour far above chance (1 in 3: about 10 of 30). The checkpoint exports to a
    directory that answers alike."""
    from shardtune.data.vision import open_image
    from shardtune.model.generation import load_for_inference
    from shardtune.model.vision import generate_from_images, load_processor_from

    data = write_squares(tmp_path / "toy", {"train": 96, "test": 30}, seed=1)
    out = tmp_path / "out"
    run_cli(
        "sft",
        "--defaults",
        "trl",
        "--model_name",
        built("vlm-llava-tiny"),
        "--dataset_name",
        data,
        "--output_dir",
        out,
        "--nproc_per_node",
        "1",
        "--per_device_train_batch_size",
        "8",
        "--num_train_epochs",
        "12",
        "--learning_rate",
        "3e-3",
        "--assistant_only_loss",
        "true",
        "--logging_steps",
        "20",
    )
    exported = tmp_path / "exported"
    run_cli("export", out, exported)
    rows = [json.loads(line) for line in (data / "test.jsonl").read_text().splitlines()]
    for source in (out, exported):
        model, _ = load_for_inference(str(source))
        processor = load_processor_from(str(source))
        answers = [
            generate_from_images(
                model, processor, [row["messages"][0]], [open_image(row["images"][0], data)], max_new_tokens=4
            )
            for row in rows
        ]
        right = sum(answer.strip() == row["messages"][1]["content"] for answer, row in zip(answers, rows))
        assert right >= 24, (source, right)  # 80%: chance gives 10 +- 2.6
    image = data / rows[0]["images"][0]  # the command line answers as the Python face does
    said = run_cli("generate", "--model_name", exported, "--image", image, "--chat", QUESTION, "--max_new_tokens", 4)
    assert said.stdout.strip() == answers[0].strip()
