"""The long-sequence memory levers (shardtune.model.longseq) keep the numbers: tiled MLP and activation offloading give
the plain model's loss and gradients on a row of the tiny preset; YaRN RoPE scaling builds a model with scaled
positions that trains."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model

from shardtune.config.flags import config_from
from shardtune.config.schema import ConfigError
from shardtune.model.loading import build_model_on_meta, load_model, training_model_config
from shardtune.model.longseq import apply_memory_levers, check_rope_scaling
from shardtune.model.loss import hf_model, token_loss_sum
from shardtune.model.peft import load_quantized_model
from shardtune.training.engine.checks import validate

CPU = torch.device("cpu")
ROW_TOKENS = 300  # the tiny preset's hidden size is 64: four whole tiles and a partial one


def row(seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(4, 1000, (1, ROW_TOKENS), generator=gen)
    return {"input_ids": input_ids, "labels": input_ids.clone()}


def loss_and_grads(model: torch.nn.Module, batch: dict) -> tuple[float, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = token_loss_sum(model, batch, CPU) / ROW_TOKENS
    loss.backward()
    return float(loss.detach()), {
        n.replace("_checkpoint_wrapped_module.", ""): p.grad.clone()
        for n, p in model.named_parameters()
        if p.grad is not None
    }


def assert_same_loss_and_grads(reference: torch.nn.Module, other: torch.nn.Module) -> float:
    batch = row()
    ref_loss, ref_grads = loss_and_grads(reference, batch)
    loss, grads = loss_and_grads(other, batch)
    assert loss == pytest.approx(ref_loss, rel=1e-5, abs=0)
    assert grads.keys() == ref_grads.keys()
    worst = max(float((grads[n] - g).norm() / g.norm().clamp_min(1e-30)) for n, g in ref_grads.items())
    assert worst <= 1e-5, worst
    return worst


def with_levers(model: torch.nn.Module, **levers) -> torch.nn.Module:
    apply_memory_levers(model, config_from(**levers), CPU)
    return model


def intermediate_lengths(model: torch.nn.Module) -> list[int]:
    """Sequence lengths of the first layer's (tokens x intermediate_size) activations, one per MLP call."""
    lengths: list[int] = []
    hf_model(model).model.layers[0].mlp.act_fn.register_forward_hook(lambda m, args, out: lengths.append(out.shape[1]))
    return lengths


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_tiled_mlp_same_loss_and_gradients_without_a_full_length_intermediate(tiny_model, lora):
    reference, tiled = load_model(str(tiny_model)), with_levers(load_model(str(tiny_model)), tiled_mlp=True)
    if lora:  # the adapter is applied after the lever, as in sft.py: its parameters get their gradients too
        lora_config = LoraConfig(r=4, target_modules=["gate_proj", "up_proj", "down_proj", "q_proj"])
        torch.manual_seed(0)
        reference = get_peft_model(reference, lora_config)
        torch.manual_seed(0)  # the same adapter initialisation
        tiled = get_peft_model(tiled, lora_config)
    plain_lengths, tiled_lengths = intermediate_lengths(reference), intermediate_lengths(tiled)
    worst = assert_same_loss_and_grads(reference, tiled)
    print(f"tiled MLP ({'lora' if lora else 'full'}): worst gradient relative difference {worst:.1e}")
    assert plain_lengths == [ROW_TOKENS]
    assert tiled_lengths == [64, 64, 64, 64, 44] * 2  # each tile in forward, and again recomputed in backward


def test_activation_offloading_same_loss_and_gradients(tiny_model):
    assert_same_loss_and_grads(
        load_model(str(tiny_model)), with_levers(load_model(str(tiny_model)), activation_offloading=True)
    )


def test_tiled_mlp_and_offloading_under_activation_checkpointing_same_gradients(tiny_model):
    from shardtune.model.structure import decoder_layers
    from shardtune.parallel.fsdp import apply_activation_checkpointing

    levers = with_levers(load_model(str(tiny_model)), tiled_mlp=True, activation_offloading=True)
    apply_activation_checkpointing(levers, decoder_layers(levers))
    assert_same_loss_and_grads(load_model(str(tiny_model)), levers)


def test_yarn_rope_scaling_builds_scaled_positions_that_train(tiny_model, tmp_path):
    cfg = config_from(model_name=str(tiny_model), rope_scaling="yarn", rope_factor=4.0)
    plain, scaled = load_model(str(tiny_model)), load_model(str(tiny_model), config=training_model_config(cfg))
    rope = scaled.config.rope_parameters
    assert (rope["rope_type"], rope["factor"], rope["original_max_position_embeddings"]) == ("yarn", 4.0, 2048)
    assert scaled.config.max_position_embeddings == 4 * plain.config.max_position_embeddings == 8192
    assert scaled.model.rotary_emb.attention_scaling > 1.0 == plain.model.rotary_emb.attention_scaling
    assert not torch.allclose(scaled.model.rotary_emb.inv_freq, plain.model.rotary_emb.inv_freq)
    batch = row()
    with torch.no_grad():  # same weights, other positions: other logits
        assert not torch.allclose(
            plain(input_ids=batch["input_ids"]).logits, scaled(input_ids=batch["input_ids"]).logits
        )
    optimizer = torch.optim.SGD(scaled.parameters(), lr=0.5)
    losses = []
    for _ in range(3):
        optimizer.zero_grad()
        loss = token_loss_sum(scaled, batch, CPU) / ROW_TOKENS
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    assert losses[2] < losses[0], losses
    scaled.save_pretrained(tmp_path / "scaled")  # the scaling is saved with the model, and refused on top of itself
    with pytest.raises(ConfigError, match="already uses RoPE scaling 'yarn'"):
        check_rope_scaling(config_from(model_name=str(tmp_path / "scaled"), rope_scaling="yarn", rope_factor=2.0))


def test_every_loading_path_builds_the_yarn_scaled_model(tiny_model):
    """Full weights, 4-bit (QLoRA, also rank 0 of --low_cpu_fsdp) and the meta-device structure of the other ranks
    of --low_cpu_fsdp all build from training_model_config: the same scaled positions (inv_freq, and YaRN's
    attention scaling, which is an attribute the meta ranks compute themselves, not a buffer rank 0 could send)."""
    cfg = config_from(
        model_name=str(tiny_model), rope_scaling="yarn", rope_factor=4.0, use_peft=True, quantization="4bit"
    )
    full = load_model(str(tiny_model), config=training_model_config(cfg)).model.rotary_emb
    quantized = load_quantized_model(cfg, CPU)
    meta = build_model_on_meta(str(tiny_model), config=training_model_config(cfg)).model.rotary_emb
    plain = load_model(str(tiny_model)).model.rotary_emb
    assert quantized.config.rope_parameters["rope_type"] == "yarn" and quantized.config.max_position_embeddings == 8192
    assert type(quantized.model.layers[0].self_attn.q_proj).__name__ == "Linear4bit"  # the 4-bit path, truly
    for rotary in (quantized.model.rotary_emb, meta):
        assert rotary.attention_scaling == full.attention_scaling > plain.attention_scaling
        assert rotary.rope_type == "yarn"
    assert torch.equal(quantized.model.rotary_emb.inv_freq.float(), full.inv_freq)
    assert (
        training_model_config(config_from(model_name=str(tiny_model))).to_dict()
        == load_model(str(tiny_model)).config.to_dict()
    )  # without the flag: the model's own config


@pytest.mark.parametrize(
    "flags, message",
    [
        (dict(rope_scaling="yarn"), "--rope_factor 1.0 must be > 1"),
        (dict(rope_factor=4.0), "--rope_factor 4.0 has no effect without --rope_scaling"),
        (dict(rope_scaling="ntk", rope_factor=4.0), "--rope_scaling 'ntk' is not valid"),
    ],
)
def test_rope_scaling_bad_flags_are_one_line_errors(flags, message, tmp_path):
    with pytest.raises(ConfigError, match=message):
        validate(config_from(output_dir=str(tmp_path / "out"), **flags), world_size=1)


def test_a_4bit_model_counts_its_parameters_as_peft_does(tiny_model):
    """The start line's count: a 4-bit weight counts its logical shape, not its packed storage (181,056 before)."""
    from shardtune.model.loading import count_parameters
    from shardtune.model.peft import apply_peft

    cfg = config_from(model_name=str(tiny_model), use_peft=True, quantization="4bit")
    model = apply_peft(load_quantized_model(cfg, CPU), cfg)
    trainable, total = model.get_nb_trainable_parameters()
    assert count_parameters(model) == (total, trainable)


def test_a_yarn_lora_adapter_records_the_scaling_and_merges_into_the_trained_model(tiny_model, run_cli, tmp_path):
    """A LoRA adapter trained with --rope_scaling yarn says so in its directory, and `shardtune export --merge`
    rebuilds the base with it: the merged model computes what base (YaRN-scaled) + adapter computed in training,
    at positions past the base's original context too."""
    from shardtune.model.loading import load_tokenizer
    from shardtune.model.peft import apply_peft, save_adapter

    cfg = config_from(model_name=str(tiny_model), rope_scaling="yarn", rope_factor=4.0, use_peft=True)
    trained = apply_peft(load_model(str(tiny_model), config=training_model_config(cfg)), cfg).eval()
    with torch.no_grad():  # a trained adapter: B is no longer zero
        for name, p in trained.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))) * 0.05)
    adapter_dir = tmp_path / "adapter"
    state = {k: p.detach() for k, p in trained.named_parameters() if p.requires_grad}
    save_adapter(trained, state, str(tiny_model), load_tokenizer(str(tiny_model)), adapter_dir)
    run_cli("export", "--merge", adapter_dir, tmp_path / "merged")
    merged = load_model(str(tmp_path / "merged")).eval()
    rope = merged.config.rope_parameters
    assert (rope["rope_type"], rope["factor"], merged.config.max_position_embeddings) == ("yarn", 4.0, 8192)
    ids = torch.randint(4, 1000, (1, 2100), generator=torch.Generator().manual_seed(1))  # > 2048 positions
    with torch.no_grad():
        difference = (merged(input_ids=ids).logits - trained(input_ids=ids).logits).abs().max().item()
    print(f"yarn LoRA: merged vs trained, max logit difference {difference:.2e}")
    assert difference <= 1e-4
