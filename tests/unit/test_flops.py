"""Training FLOPs per token: 6 N + 12 L d T for full fine-tuning, counted from the model itself."""

from __future__ import annotations

from shardtune.accounting.flops import model_shape, training_flops_per_token
from shardtune.model.loading import load_model


def test_full_fine_tuning_counts_six_flops_per_matmul_parameter_plus_attention(tiny_model):
    model = load_model(str(tiny_model))
    config = model.config
    embedding = model.get_input_embeddings().weight.numel()
    matmul_params = sum(p.numel() for p in model.parameters() if p.dim() == 2) - embedding  # not the norm scales
    shape = model_shape(model)
    assert shape.num_matmul_params == shape.num_trainable_params == matmul_params
    expected = 6 * matmul_params + 12 * config.num_hidden_layers * config.hidden_size * 128
    assert training_flops_per_token(shape, 128) == expected


def test_frozen_weights_skip_their_weight_gradient(tiny_model):
    model = load_model(str(tiny_model))
    full = training_flops_per_token(model_shape(model), 64)
    for p in model.parameters():
        p.requires_grad_(False)
    frozen = model_shape(model)
    assert frozen.num_trainable_params == 0
    assert full - training_flops_per_token(frozen, 64) == 2 * frozen.num_matmul_params


def test_a_tied_head_counts_once(tiny_model):
    """Tying removes the separate head parameters; the shared table is a matmul (the head) exactly once."""
    model = load_model(str(tiny_model))
    untied = model_shape(model).num_matmul_params
    model.lm_head.weight = model.get_input_embeddings().weight
    assert sum(p.numel() for p in model.parameters() if p.dim() == 2) == untied  # the input table is no longer extra
    assert model_shape(model).num_matmul_params == untied
