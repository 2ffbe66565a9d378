"""What the demo's figures rest on, checked without a long run: a training step gives the same bits whatever the
number of threads (1 and all this process has), so a fresh clone on another machine trains the same weights."""

from __future__ import annotations

import torch

from shardtune.data.batching import collate_flat
from shardtune.model.attention import use_varlen_attention
from shardtune.model.loading import load_model
from shardtune.model.loss import IGNORE_INDEX, token_loss_sum


def rows(num: int, seed: int) -> list[dict]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(num):
        length = int(torch.randint(60, 200, (1,), generator=gen))
        ids = torch.randint(4, 1000, (length,), generator=gen).tolist()
        out.append({"input_ids": ids, "labels": [IGNORE_INDEX] * (length // 2) + ids[length // 2 :]})
    return out


def test_a_training_step_is_bitwise_the_same_with_one_thread_and_with_all(tiny_model):
    model = load_model(str(tiny_model))
    use_varlen_attention(model)
    batch = collate_flat(rows(12, 0))
    threads = torch.get_num_threads()
    results = []
    try:
        for n in (1, max(threads, 2)):
            torch.set_num_threads(n)
            model.zero_grad(set_to_none=True)
            loss = token_loss_sum(model, batch, torch.device("cpu"))
            loss.backward()
            results.append((loss.detach().clone(), [p.grad.clone() for p in model.parameters()]))
    finally:
        torch.set_num_threads(threads)
    (loss_1, grads_1), (loss_n, grads_n) = results
    assert torch.equal(loss_1, loss_n)
    assert all(torch.equal(a, b) for a, b in zip(grads_1, grads_n))
