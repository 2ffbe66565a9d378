"""PEFT and QLoRA, shown by real runs: every method trains under DDP and FSDP2, DDP and FSDP2 agree, and what is
saved reloads with plain peft into the model that training ended with.

Each configuration is launched once (2 gloo processes, tiny preset) and shared by the tests that read it.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from shardtune import data
from shardtune.config.flags import from_dict
from shardtune.model.loading import load_model, load_tokenizer
from shardtune.model.loss import full_logits_loss_sum, num_label_tokens
from tests.conftest import shardtune_argv
from tests.helpers import eval_rows, max_relative_difference, step_rows, weights
from tests.rounding import adam_outliers, allowed_adam_outliers, assert_same_adam_training

NUM_STEPS = 8
# method -> (extra flags, learning rate): llama-adapter's gates start at zero, so it needs a larger step
METHODS = {
    "lora": (["--peft_method", "lora", "--lora_config.lora_dropout", "0"], 2e-2),
    "llama_adapter": (["--peft_method", "llama_adapter"], 1e-1),
    "prefix": (["--peft_method", "prefix", "--prefix_config.num_virtual_tokens", "8"], 2e-1),
    "qlora": (
        [
            "--peft_method",
            "lora",
            "--lora_config.lora_dropout",
            "0",
            "--quantization",
            "4bit",
            "--save_steps",
            NUM_STEPS // 2,
        ],
        2e-2,
    ),
}
STRATEGIES = {
    "ddp": [],
    "fsdp": ["--enable_fsdp"],
    "zero3": ["--enable_deepspeed", "--deepspeed_config.zero_stage", "3"],
}
NUM_SAMPLES = 1  # --log_eval_samples: every run generates at its evaluation


def sft_args(model: Path, out: Path, method: str, strategy: str, *extra) -> list:
    flags, lr = METHODS[method]
    return [
        "sft",
        "--nproc_per_node",
        2,
        "--model_name",
        model,
        "--output_dir",
        out,
        "--use_peft",
        *flags,
        *STRATEGIES[strategy],
        "--lr",
        lr,
        "--batching_strategy",
        "padding",
        "--batch_size_training",
        4,
        "--context_length",
        256,
        "--synthetic_dialogues.num_train",
        64,
        "--synthetic_dialogues.num_validation",
        8,
        "--max_train_step",
        NUM_STEPS,
        "--val_batch_size",
        4,
        "--num_workers_dataloader",
        0,
        "--log_eval_samples",
        NUM_SAMPLES,
        *extra,
    ]


@pytest.fixture(scope="module")
def trained(tiny_model, tmp_path_factory, cache_dir):
    """run(method, strategy) -> (output dir, stdout), launched on first use and cached for the module."""
    import subprocess

    from tests.conftest import REPO, cli_env

    runs: dict[tuple[str, str], tuple[Path, str]] = {}
    root = tmp_path_factory.mktemp("peft-runs")

    def run(method: str, strategy: str) -> tuple[Path, str]:
        if (method, strategy) not in runs:
            out = root / f"{method}-{strategy}"
            args = shardtune_argv(*sft_args(tiny_model, out, method, strategy))
            proc = subprocess.run(args, capture_output=True, text=True, timeout=600, env=cli_env(cache_dir), cwd=REPO)
            assert proc.returncode == 0, f"{method} {strategy}:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
            runs[method, strategy] = out, proc.stdout
        return runs[method, strategy]

    return run


def losses(out: Path) -> list[float]:
    return [r["loss"] for r in step_rows(out)]


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])  # PEFT under DeepSpeed: tests/distributed/test_deepspeed.py
@pytest.mark.parametrize("method", list(METHODS))
def test_each_method_trains_and_saves_only_the_adapter(method, strategy, trained):
    out, stdout = trained(method, strategy)
    steps = losses(out)
    assert len(steps) == NUM_STEPS
    first, last = sum(steps[:2]) / 2, sum(steps[-2:]) / 2
    print(f"{method} {strategy}: loss first {steps[0]:.4f} last {steps[-1]:.4f}")
    assert last < first - 0.02, f"{method} {strategy} did not learn: {steps}"
    assert "trainable of" in stdout  # the trainable parameter count is printed at start
    assert (out / "adapter_config.json").is_file() and (out / "adapter_model.safetensors").is_file()
    assert not (out / "model.safetensors").exists()


def eval_samples(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "eval_samples.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("method", list(METHODS))
def test_eval_samples_are_generated_alike_under_ddp_and_fsdp_after_the_adapter_is_published(method, trained):
    """Generation under FSDP2 goes around the root's forward (PeftModel.generate calls the inner model), which
    once left the root's weights sharded: the first evaluation crashed and the trained adapter was never written.
    Now both strategies generate the same greedy text, and the adapter is on disk before the final evaluation runs,
    so a failure there could not cost it."""
    texts = {}
    for strategy in ("fsdp", "ddp"):
        out, _ = trained(method, strategy)
        samples = eval_samples(out)
        assert len(samples) == NUM_SAMPLES and all(s["step"] == NUM_STEPS for s in samples), (method, strategy)
        texts[strategy] = [s["prediction"] for s in samples]
        published = (out / "adapter_model.safetensors").stat().st_mtime_ns
        assert published <= (out / "eval_samples.jsonl").stat().st_mtime_ns, f"{method} {strategy}: published late"
    print(f"{method}: {texts['ddp']!r}")
    assert texts["fsdp"] == texts["ddp"], method


def test_lora_ddp_and_fsdp_match_step_by_step(trained):
    ddp, _ = trained("lora", "ddp")
    fsdp, _ = trained("lora", "fsdp")
    for a, b in zip(step_rows(ddp), step_rows(fsdp), strict=True):
        assert b["num_tokens"] == a["num_tokens"]
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5, abs=0), a["step"]
    adapters = [load_file(str(d / "adapter_model.safetensors")) for d in (ddp, fsdp)]
    print(f"lora ddp vs fsdp: max relative adapter difference {max_relative_difference(*adapters):.2e}")
    # Adam at lr 2e-2 moves an element whose gradient nearly cancels by up to 2 lr on rounding alone: compared by how
    # many elements differ by more than lr / 100 (tests/rounding.py: 2 per tensor; measured: none, the adapters are
    # bitwise equal here with default, AVX2 and AVX-512 kernels and both MKL code paths)
    assert_same_adam_training(*adapters, METHODS["lora"][1], step_rows(ddp), "lora ddp vs fsdp")


def load_base(model_dir: str, quantized: bool) -> torch.nn.Module:
    """The base model as a user loads it: plain transformers (with bitsandbytes 4-bit for QLoRA)."""
    if not quantized:
        return load_model(model_dir)
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from shardtune.model.peft import use_generic_cpu_kernels

    bnb = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.float32,
    )
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, quantization_config=bnb, dtype=torch.float32, device_map={"": "cpu"}
    )
    use_generic_cpu_kernels(model)
    return model


@torch.no_grad()
def reference_eval_loss(model: torch.nn.Module, out: Path) -> float:
    """The run's validation examples through the plain full-logits loss, one process."""
    cfg = from_dict(yaml.safe_load((out / "config.yaml").read_text()))
    tokenizer = load_tokenizer(str(out))
    examples, _ = data.load_examples(cfg, tokenizer, "validation")
    total, count = 0.0, 0
    for batch in data.eval_batches(examples, cfg, 0, 1, tokenizer.pad_token_id):
        total += float(full_logits_loss_sum(model, batch, torch.device("cpu")))
        count += num_label_tokens(batch["labels"])
    return total / count


@pytest.mark.parametrize(
    "method,strategy", [("lora", "fsdp"), ("llama_adapter", "fsdp"), ("prefix", "ddp"), ("qlora", "fsdp")]
)
def test_saved_adapter_reloads_into_the_model_training_ended_with(method, strategy, trained):
    """The last eval of the run is computed by the in-memory model after its final step; plain peft loading the
    saved adapter on the untouched base must reproduce it. Were any base weight changed by training (or an
    adapter tensor lost in the FSDP gather), the two losses would differ by far more than rounding."""
    import peft

    out, _ = trained(method, strategy)
    config = json.loads((out / "adapter_config.json").read_text())
    model = peft.PeftModel.from_pretrained(load_base(config["base_model_name_or_path"], method == "qlora"), str(out))
    model.eval()
    final_eval = eval_rows(out)[-1]["eval_loss"]
    reloaded = reference_eval_loss(model, out)
    print(f"{method} {strategy}: eval loss in training {final_eval:.8f}, reloaded adapter {reloaded:.8f}")
    assert reloaded == pytest.approx(final_eval, rel=2e-6)
    base_only = reference_eval_loss(load_base(config["base_model_name_or_path"], method == "qlora"), out)
    assert abs(base_only - final_eval) > 1e-3, "the adapter changed nothing: the comparison would be vacuous"


def test_merged_export_matches_base_plus_adapter(trained, tiny_model, run_cli, tmp_path):
    import peft

    out, _ = trained("lora", "ddp")
    merged_dir = tmp_path / "merged"
    run_cli("export", "--merge", out, merged_dir)
    merged = load_model(str(merged_dir)).eval()
    with_adapter = peft.PeftModel.from_pretrained(load_model(str(tiny_model)), str(out)).eval()
    ids = torch.tensor([load_tokenizer(str(out))("Anna: lunch at 1?\nBen: sure, see you")["input_ids"]])
    with torch.no_grad():
        difference = (merged(input_ids=ids).logits - with_adapter(input_ids=ids).logits).abs().max().item()
    print(f"merged vs base + adapter: max logit difference {difference:.2e}")
    assert difference <= 1e-5
    assert merged.dtype == load_model(str(tiny_model)).dtype == torch.float32
    # the merge touches exactly the adapted projections; the base on disk is untouched by training
    base, merged_weights = (
        load_file(str(tiny_model / "model.safetensors")),
        load_file(str(merged_dir / "model.safetensors")),
    )
    changed = {k for k in base if not torch.equal(base[k], merged_weights[k])}
    assert changed and all(k.endswith(("q_proj.weight", "v_proj.weight")) for k in changed)


def test_training_continues_from_a_peft_checkpoint(trained, tiny_model, run_cli, tmp_path):
    first, _ = trained("lora", "ddp")
    out = tmp_path / "continued"
    run_cli(*sft_args(tiny_model, out, "lora", "ddp", "--from_peft_checkpoint", first, "--max_train_step", 2))
    # step 1 of the continued run sees the same batch as step 1 of the first run, with the trained adapter
    assert losses(out)[0] < losses(first)[0] - 0.05
    adapter, loaded = (load_file(str(d / "adapter_model.safetensors")) for d in (out, first))
    assert max_relative_difference(loaded, adapter) > 1e-4
    if importlib.util.find_spec("deepspeed") is None:
        return
    # the same continuation under DeepSpeed ZeRO-3: the adapter is loaded before the engine partitions it
    zero3 = tmp_path / "continued-zero3"
    run_cli(*sft_args(tiny_model, zero3, "lora", "zero3", "--from_peft_checkpoint", first, "--max_train_step", 2))
    assert losses(zero3) == pytest.approx(losses(out), rel=1e-5)
    # a fresh Adam's first steps are ~lr * sign(gradient): an element whose gradient nearly cancels moves by up to
    # 2 lr (4e-2) on rounding alone, so the adapters are compared by how many elements differ by more than lr / 100
    # (tests/rounding.py: 2 per tensor here; measured: none with default, AVX2 and AVX-512 kernels and both MKL code
    # paths; 1.6e-4 relative on an Intel host broke the former bound of 1e-4). An adapter not loaded, or trained
    # differently, has most elements elsewhere, as the continuation moved them from the loaded one
    lr, rows = METHODS["lora"][1], step_rows(out)
    assert_same_adam_training(adapter, load_file(str(zero3 / "adapter_model.safetensors")), lr, rows, "zero3")
    moved, allowed = adam_outliers(loaded, adapter, lr), allowed_adam_outliers(adapter, rows)
    assert all(moved[name] > allowed[name] for name in allowed), moved


def test_eval_rouge_matches_rouge_score_and_generate_matches_eval(trained, run_cli, tmp_path):
    from rouge_score import rouge_scorer

    out, _ = trained("lora", "ddp")
    report_path = tmp_path / "report.json"
    proc = run_cli(
        "eval",
        "--model_name",
        out,
        "--synthetic_dialogues.num_validation",
        8,
        "--context_length",
        256,
        "--max_examples",
        4,
        "--max_new_tokens",
        12,
        "--report_path",
        report_path,
    )
    assert "ROUGE-1" in proc.stdout and "[generated]" in proc.stdout
    report = json.loads(report_path.read_text())
    assert report["num_examples"] == len(report["examples"]) == 4
    scorer = rouge_scorer.RougeScorer(["rouge1", "rouge2", "rougeL"], use_stemmer=True)
    direct = [scorer.score(e["reference"], e["prediction"]) for e in report["examples"]]
    for key in ("rouge1", "rouge2", "rougeL"):
        assert report[key] == pytest.approx(sum(s[key].fmeasure for s in direct) / len(direct), abs=1e-12)
    # the same prompt through `shardtune generate` (stdin, greedy) gives the same text as the eval produced
    dialogue = report["examples"][0]["prompt"].split("Summarize this dialog:\n", 1)[1].rsplit("\n---\n", 1)[0]
    gen = run_cli("generate", "--model_name", out, "--dialogue", "--max_new_tokens", 12, stdin=dialogue)
    assert gen.stdout.strip() == report["examples"][0]["prediction"]


def test_a_qlora_checkpoint_written_under_fsdp_resumes_under_ddp_on_one_process(trained, tiny_model, run_cli, tmp_path):
    """FSDP's 4-bit layers list no quantisation statistics in their state dict, DDP's do (absmax, quant_map...):
    checkpoints now hold neither (they belong to the frozen base), so the FSDP checkpoint of step 4 resumes on one
    DDP process (batch 8: the same global batch) and ends where the uninterrupted two-process FSDP run ended."""
    fsdp, _ = trained("qlora", "fsdp")
    out = tmp_path / "resumed"
    run_cli(
        *sft_args(
            tiny_model,
            out,
            "qlora",
            "ddp",
            "--nproc_per_node",
            1,
            "--batch_size_training",
            8,
            "--resume",
            fsdp / "checkpoints" / "step-000004",
            "--log_eval_samples",
            0,
            "--save_steps",
            0,
        )
    )
    resumed = step_rows(out)
    assert [r["step"] for r in resumed] == [5, 6, 7, 8]
    assert [r["loss"] for r in resumed] == pytest.approx(losses(fsdp)[4:], rel=1e-5)
    adapters = [load_file(str(d / "adapter_model.safetensors")) for d in (fsdp, out)]
    print(f"qlora fsdp x2 -> ddp x1 resumed: adapter difference {max_relative_difference(*adapters):.2e}")
    # as Adam's steps amplify rounding (tests/rounding.py; measured: no element beyond lr / 100)
    assert_same_adam_training(*adapters, METHODS["qlora"][1], step_rows(fsdp), "qlora fsdp x2 -> ddp x1 resumed")


def test_lora_dropout_masks_do_not_depend_on_the_rank_layout(trained, tiny_model, run_cli, tmp_path):
    """LoRA's default dropout (0.05) on: 1 process x batch 8 (padded rows, DDP) and 2 processes x batch 4 (FSDP2,
    padding-free rows) draw each example's masks from (seed, step, example), so they train alike; the dropout-free
    run of the same batches ends elsewhere, so the masks are really applied."""
    dropout = ("--lora_config.lora_dropout", 0.05, "--log_eval_samples", 0)
    one = tmp_path / "one-process"
    run_cli(*sft_args(tiny_model, one, "lora", "ddp", "--nproc_per_node", 1, "--batch_size_training", 8, *dropout))
    two = tmp_path / "two-processes"
    run_cli(*sft_args(tiny_model, two, "lora", "fsdp", "--padding_free", "true", *dropout))
    assert [r["num_tokens"] for r in step_rows(two)] == [r["num_tokens"] for r in step_rows(one)]
    assert losses(two) == pytest.approx(losses(one), rel=1e-5)
    adapters = [load_file(str(d / "adapter_model.safetensors")) for d in (one, two)]
    difference = max_relative_difference(*adapters)
    without, _ = trained("lora", "ddp")
    control = max_relative_difference(adapters[0], load_file(str(without / "adapter_model.safetensors")))
    print(f"lora dropout 0.05: 1 x 8 vs 2 x 4 adapter difference {difference:.2e}; vs no dropout {control:.2e}")
    # as Adam's steps amplify rounding (tests/rounding.py: 2 elements per tensor beyond lr / 100; measured: none),
    # while the dropout-free run has >= 246 of each tensor's elements elsewhere
    lr, rows = METHODS["lora"][1], step_rows(one)
    assert_same_adam_training(*adapters, lr, rows, "lora dropout 1 x 8 vs 2 x 4")
    moved, allowed = adam_outliers(adapters[0], weights(without), lr), allowed_adam_outliers(adapters[0], rows)
    assert all(moved[name] > allowed[name] for name in allowed), moved
    assert losses(one)[1:] != pytest.approx(losses(without)[1:], rel=1e-4)
