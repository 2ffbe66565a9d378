"""The lean loss (the training default) gives the plain full-logits loss and gradients, in every wrapper the
loop sees: bare, DDP, FSDP2 (fully_shard per decoder layer, then the root), PEFT LoRA and prefix tuning."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

from shardtune.data.batching import collate_flat, collate_padding
from shardtune.model.attention import use_varlen_attention
from shardtune.model.loading import load_model
from shardtune.model.loss import (
    IGNORE_INDEX,
    RowwiseLinearCrossEntropy,
    default_chunk_rows,
    full_logits_loss_sum,
    lean_head,
    linear_cross_entropy_sum,
    linear_cross_entropy_sums,
    prediction_sums,
    token_loss_sum,
)

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def process_group(tmp_path_factory):
    """A real one-process gloo group, as torchrun's single worker has."""
    init_file = tmp_path_factory.mktemp("pg") / "init"
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def examples(num: int, seed: int = 0) -> list[dict]:
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(num):
        length = int(torch.randint(12, 40, (1,), generator=gen))
        ids = torch.randint(4, 1000, (length,), generator=gen).tolist()
        prompt = length // 2
        rows.append({"input_ids": ids, "labels": [IGNORE_INDEX] * prompt + ids[prompt:]})
    return rows


BATCHES = {
    "padding": lambda: collate_padding(examples(3), pad_id=3),
    "packing": lambda: collate_flat(examples(3, 1) + examples(2, 2)),
}


def loss_and_grads(model, batch, loss_fn):
    model.zero_grad(set_to_none=True)
    loss = loss_fn(model, batch, CPU)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads


def assert_same(model_lean, model_full, batch):
    lean, lean_grads = loss_and_grads(model_lean, batch, token_loss_sum)
    full, full_grads = loss_and_grads(model_full, batch, full_logits_loss_sum)
    assert lean.item() == pytest.approx(full.item(), rel=1e-6)
    assert lean_grads.keys() == full_grads.keys() and lean_grads
    for name, g in full_grads.items():
        h = lean_grads[name]
        if isinstance(g, torch.distributed.tensor.DTensor):
            g, h = g.full_tensor(), h.full_tensor()
        assert float((h - g).abs().max() / g.abs().max().clamp_min(1e-12)) <= 1e-5, name


@pytest.mark.parametrize("batching", list(BATCHES))
def test_lean_loss_equals_full_logits_loss_and_gradients(batching, tiny_model):
    model = load_model(str(tiny_model))
    use_varlen_attention(model)  # what training sets up; padded batches still take SDPA
    assert lean_head(model) is not None
    assert_same(model, model, BATCHES[batching]())


@pytest.mark.parametrize("batching", list(BATCHES))
def test_the_last_layer_computes_the_labelled_positions_only(batching, tiny_model):
    """shardtune.model.lean_layer: in the last decoder layer, the MLP runs on the positions whose next token is
    labelled, the first layer's on every token (the loss and gradients: the test above, against full logits)."""
    model = load_model(str(tiny_model))
    use_varlen_attention(model)
    batch = BATCHES[batching]()
    rows: list[int] = []
    layers = model.model.layers
    for layer in (layers[0], layers[-1]):
        layer.mlp.register_forward_hook(lambda module, args, output: rows.append(args[0].shape[:-1].numel()))
    token_loss_sum(model, batch, CPU).backward()
    read = int((F.pad(batch["labels"][:, 1:], (0, 1), value=IGNORE_INDEX) != IGNORE_INDEX).sum())
    assert rows == [batch["input_ids"].numel(), read] and 0 < read < batch["input_ids"].numel()


@pytest.mark.parametrize("strategy", ["packing", "padding"])
def test_grouped_evaluation_gives_the_loss_of_the_examples_one_by_one(strategy, tiny_model):
    """Evaluation runs several --val_batch_size chunks in one forward (shardtune.data.batching.grouped_eval_batches):
    the summed loss and prediction sums over the same tokens equal those of one example per forward up to float
    rounding (fp32 matmuls over other shapes, ~1e-7 relative per token; summed in fp64)."""
    from shardtune.config.flags import config_from
    from shardtune.data.batching import eval_batches, grouped_eval_batches
    from shardtune.model.loss import token_loss_and_prediction_sums

    model = load_model(str(tiny_model)).eval()
    use_varlen_attention(model)
    cfg = config_from(batching_strategy=strategy, batch_size_training=4, context_length=64, val_batch_size=1)
    rows = examples(13, 5)

    def total(batches):
        with torch.no_grad():
            sums = [
                torch.cat([s.double().reshape(-1) for s in token_loss_and_prediction_sums(model, b, CPU)])
                for b in batches
            ]
        return torch.stack(sums).sum(0)

    chunks, grouped = eval_batches(rows, cfg, 0, 1, 3), grouped_eval_batches(rows, cfg, 0, 1, 3)
    assert len(grouped) < len(chunks) == 13
    one_by_one, together = total(chunks), total(grouped)
    torch.testing.assert_close(together, one_by_one, rtol=1e-5, atol=0)  # loss, hits, entropy


def test_chunked_cross_entropy_equals_plain_cross_entropy_across_many_chunks():
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 50, 16, generator=gen, requires_grad=True)
    weight = torch.randn(300, 16, generator=gen, requires_grad=True)
    targets = torch.randint(0, 300, (2, 50), generator=gen)
    targets[0, :20] = IGNORE_INDEX
    lean = linear_cross_entropy_sum(hidden, weight, targets, chunk_rows=7)
    d_hidden, d_weight = torch.autograd.grad(lean * 0.5, (hidden, weight))
    full = F.cross_entropy((hidden @ weight.t()).reshape(-1, 300), targets.reshape(-1), reduction="sum")
    e_hidden, e_weight = torch.autograd.grad(full * 0.5, (hidden, weight))
    assert lean.item() == pytest.approx(full.item(), rel=1e-6)
    torch.testing.assert_close(d_hidden, e_hidden, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(d_weight, e_weight, rtol=1e-5, atol=1e-6)


def test_training_chunks_take_accuracy_and_entropy_from_the_gradients_softmax_bit_for_bit(monkeypatch):
    """SFT's accuracy and entropy sums, taken in training from the softmax the gradient computes anyway (one exp per
    logit, not two), are bit for bit the sums of the same rows' logits computed apart (evaluation's path), and the
    loss and gradients bit for bit those of a step without them: over chunks of 7 rows and blocks of 3, with a
    third of the targets the argmax (so a wrong count of hits, a block's softmax copied to the wrong rows, or a
    logit read after its softmax replaced it, changes a figure)."""
    from shardtune.model import loss as loss_module

    monkeypatch.setattr(loss_module, "PREDICTION_BLOCK_ELEMENTS", 3 * 300)
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 50, 16, generator=gen, requires_grad=True)
    weight = torch.randn(300, 16, generator=gen, requires_grad=True)
    targets = torch.randint(0, 300, (2, 50), generator=gen)
    with torch.no_grad():
        argmax = (hidden @ weight.t()).argmax(-1)
    targets[:, ::3] = argmax[:, ::3]
    targets[0, :20] = IGNORE_INDEX
    keep = targets != IGNORE_INDEX
    found = {}
    for with_predictions in (False, True):
        total, sums = linear_cross_entropy_sums(hidden, weight, targets, 7, with_predictions)
        found[with_predictions] = (total, *torch.autograd.grad(total * 0.5, (hidden, weight)), sums)
    with torch.no_grad():  # the same chunks' logits, summed apart
        rows, row_targets = hidden[keep], targets[keep]
        expected = sum(prediction_sums(rows[i : i + 7] @ weight.t(), row_targets[i : i + 7]) for i in range(0, 80, 7))
    for plain, fused in zip(found[False][:3], found[True][:3]):
        assert torch.equal(plain, fused)
    assert found[False][3] is None
    assert found[True][3][0] >= int(keep[:, ::3].sum())  # the argmax targets are all hits
    assert torch.equal(found[True][3], expected)


@pytest.mark.parametrize("with_predictions", [False, True])
def test_rowwise_cross_entropy_keeps_one_chunks_softmax_for_backward_bit_for_bit(with_predictions, monkeypatch):
    """GRPO's and DPO's per-token log-probabilities (RowwiseLinearCrossEntropy): when the rows fit one chunk, the
    softmax forward computes (with the entropies: the same one) is kept for backward instead of recomputing the
    logits; the gradients are bit for bit those of the recomputing path, and equal the full logits' autograd (a
    kept softmax without its one-hot subtracted, or not scaled per row, moves them by O(1)); per-token losses and
    predictions are unchanged; rows over one chunk recompute, equal too."""
    from shardtune.model import loss as loss_module

    gen = torch.Generator().manual_seed(0)
    rows = torch.randn(40, 16, generator=gen, requires_grad=True)
    weight = torch.randn(300, 16, generator=gen, requires_grad=True)
    targets = torch.randint(0, 300, (40,), generator=gen)
    scale = torch.randn(40, generator=gen)  # a different gradient per row, as through DPO's and GRPO's losses

    def run(keep: bool, chunk_rows: int):
        monkeypatch.setattr(loss_module, "KEEP_ONE_CHUNK_SOFTMAX", keep)
        found = [] if with_predictions else None
        losses = RowwiseLinearCrossEntropy.apply(rows, weight, targets, chunk_rows, found)
        grads = torch.autograd.grad((losses * scale).sum(), (rows, weight))
        return losses, grads, torch.cat(found) if found else None

    kept, recomputed = run(True, 40), run(False, 40)
    assert torch.equal(kept[0], recomputed[0])
    for a, b in zip(kept[1], recomputed[1]):
        assert torch.equal(a, b)
    if with_predictions:
        assert torch.equal(kept[2], recomputed[2])
    full = F.cross_entropy(rows @ weight.t(), targets, reduction="none")
    expected = torch.autograd.grad((full * scale).sum(), (rows, weight))
    for lean_losses, grads, _ in (kept, run(True, 7)):  # one chunk kept; six chunks recomputed
        torch.testing.assert_close(lean_losses, full, rtol=1e-5, atol=1e-6)
        for got, want in zip(grads, expected):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_lean_loss_under_ddp(tiny_model, process_group):
    bare = load_model(str(tiny_model))
    use_varlen_attention(bare)
    model = DistributedDataParallel(bare)
    assert_same(model, model, BATCHES["packing"]())


def test_lean_loss_under_fsdp2(tiny_model, process_group):
    def sharded():
        model = load_model(str(tiny_model))
        for layer in model.model.layers:
            fully_shard(layer)
        return fully_shard(model)

    lean_model, full_model = sharded(), sharded()
    for _ in range(2):  # the second step runs with the root's parameters as FSDP2 leaves them after a step
        assert_same(lean_model, full_model, BATCHES["padding"]())


@pytest.mark.parametrize("method", ["lora", "prefix"])
def test_lean_loss_under_peft(method, tiny_model):
    import peft

    config = (
        peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj", "lm_head"], task_type="CAUSAL_LM")
        if method == "lora"
        else peft.PrefixTuningConfig(num_virtual_tokens=5, task_type="CAUSAL_LM")
    )
    torch.manual_seed(0)
    model = peft.get_peft_model(load_model(str(tiny_model)), config)
    if method == "lora":
        assert lean_head(model) is None, "a LoRA-adapted head is not a plain Linear: the plain path must be taken"
        config = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
        model = peft.get_peft_model(load_model(str(tiny_model)), config)
    for p in model.parameters():  # non-zero LoRA B, so that every adapter weight gets a gradient
        if p.requires_grad:
            torch.nn.init.normal_(p, std=0.02)
    assert lean_head(model) is not None
    assert_same(model, copy.deepcopy(model), BATCHES["padding"]())


def test_eval_without_gradients_gives_the_same_loss(tiny_model):
    model = load_model(str(tiny_model))
    batch = BATCHES["packing"]()
    with torch.no_grad():
        assert token_loss_sum(model, batch, CPU).item() == pytest.approx(
            full_logits_loss_sum(model, batch, CPU).item(), rel=1e-6
        )


# relative precision of each format (unit roundoff): 8 and 11 significant bits
FORMAT_EPS = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


@pytest.mark.parametrize("dtype", list(FORMAT_EPS), ids=str)
def test_chunked_cross_entropy_in_low_precision_matches_fp32_whatever_the_chunking(dtype):
    """The bf16 / fp16 branch (FSDP2's mixed precision and pure bf16 hand the head bf16 rows and weights): loss and
    gradients within the format's precision of the fp32 computation on the same (rounded) inputs, with one chunk and
    with 112; the weight gradient is accumulated across chunks in fp32 (accumulating it in bf16 gives 1.2e-2 here,
    in fp16 1.5e-3: beyond the tolerance)."""
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(4, 512, 32, generator=gen).to(dtype)
    weight = (torch.randn(500, 32, generator=gen) * 0.3).to(dtype)
    targets = torch.randint(0, 500, (4, 512), generator=gen)
    targets[:, :100] = IGNORE_INDEX
    h32, w32 = hidden.float().requires_grad_(), weight.float().requires_grad_()
    full = F.cross_entropy((h32 @ w32.t()).reshape(-1, 500), targets.reshape(-1), reduction="sum")
    e_hidden, e_weight = torch.autograd.grad(full, (h32, w32))
    eps = FORMAT_EPS[dtype]
    for chunk_rows in (4096, 16):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        lean = linear_cross_entropy_sum(h, w, targets, chunk_rows=chunk_rows)
        d_hidden, d_weight = torch.autograd.grad(lean, (h, w))
        assert lean.dtype == torch.float32 and d_hidden.dtype == d_weight.dtype == dtype
        assert lean.item() == pytest.approx(full.item(), rel=eps / 10)
        for got, expected in ((d_hidden, e_hidden), (d_weight, e_weight)):
            assert float((got.double() - expected.double()).norm() / expected.double().norm()) <= eps, chunk_rows


def test_chunk_size_holds_at_most_128_mib_of_logits_on_cpu_and_1_gib_on_cuda():
    vocab_size = 128_256  # Llama 3
    for device_type, budget_bytes, min_rows in (("cpu", 128 << 20, 256), ("cuda", 1 << 30, 2048)):
        rows = default_chunk_rows(device_type, vocab_size)
        assert min_rows <= rows and rows * vocab_size * 4 <= budget_bytes, device_type
