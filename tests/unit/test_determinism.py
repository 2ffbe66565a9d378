"""What reruns can rely on, checked without a long run.

At a given thread count and CPU kernel set, a training step gives the same bits every time: torch's CPU kernels and
MKL split their work into the same chunks each call, so two runs of one configuration on one machine log identical
metrics and weights (tests/distributed/test_equivalence.py, test_checkpoint.py's resumes compare with == 0.0).

Across thread counts the bits are not promised: a sum split over more threads is added in another order, and whether
that moves a last bit depends on the kernels (an Intel AVX-512 host differs between 1 thread and 2 for this batch, and
so does an AMD one on MKL's other code path, MKL_CBWR=COMPATIBLE; with its default path it happens not to). shardtune
does not pin threads to hide this: the launcher gives each process its share of the cores (OMP_NUM_THREADS = cores /
processes), and one thread would waste the rest. So another machine, or another thread count, trains the same weights
up to float rounding, amplified by the optimizer over the steps run (tests/rounding.py; the demo prints the machine
and thread count beside its figures).
"""

from __future__ import annotations

import pytest
import torch

from shardtune.data.batching import collate_flat
from shardtune.model.attention import use_varlen_attention
from shardtune.model.loading import load_model
from shardtune.model.loss import IGNORE_INDEX, token_loss_sum

EPS = torch.finfo(torch.float32).eps  # 1.19e-7


def rows(num: int, seed: int) -> list[dict]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(num):
        length = int(torch.randint(60, 200, (1,), generator=gen))
        ids = torch.randint(4, 1000, (length,), generator=gen).tolist()
        out.append({"input_ids": ids, "labels": [IGNORE_INDEX] * (length // 2) + ids[length // 2 :]})
    return out


@pytest.fixture(scope="module")
def model(tiny_model):
    model = load_model(str(tiny_model))
    use_varlen_attention(model)
    return model


def step(model, batch: dict, num_threads: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The loss and the gradients of one training step computed with ``num_threads`` threads."""
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(num_threads)
        model.zero_grad(set_to_none=True)
        loss = token_loss_sum(model, batch, torch.device("cpu"))
        loss.backward()
        return loss.detach().clone(), [p.grad.clone() for p in model.parameters()]
    finally:
        torch.set_num_threads(threads)


def relative_differences(a: tuple, b: tuple) -> list[float]:
    """|loss_a - loss_b| / |loss_a|, then ||grad_a - grad_b|| / ||grad_a|| per parameter (Frobenius norms)."""
    (loss_a, grads_a), (loss_b, grads_b) = a, b
    out = [float((loss_a.double() - loss_b.double()).abs() / loss_a.double().abs())]
    return out + [float((x.double() - y.double()).norm() / x.double().norm()) for x, y in zip(grads_a, grads_b)]


def test_a_training_step_is_bitwise_the_same_each_time_at_a_given_thread_count(model):
    batch = collate_flat(rows(12, 0))
    for num_threads in (1, max(torch.get_num_threads(), 2)):
        (loss_a, grads_a), (loss_b, grads_b) = step(model, batch, num_threads), step(model, batch, num_threads)
        assert torch.equal(loss_a, loss_b), num_threads
        assert all(torch.equal(a, b) for a, b in zip(grads_a, grads_b)), num_threads


def test_a_training_step_with_other_thread_counts_differs_by_float_rounding_only(model):
    """Another thread count regroups the step's sums. The longest are a weight gradient's: one term per token of the
    batch (K = 1,399). Two orders of a float32 sum of K terms differ by at most ~K * eps of the sum of the terms'
    magnitudes (Higham, Accuracy and Stability of Numerical Algorithms, 4.2); the loss's terms are positive, so that
    is K * eps of the loss. A gradient's terms have mixed signs: they cancel to ~1/sqrt(K) of their magnitudes, and
    the regrouping error is a random walk of ~sqrt(K) * eps of them, so K * eps of the gradient again. K * eps
    (1.7e-4) bounds every relative difference; measured with default, AVX2 and AVX-512 kernels, both MKL code paths
    and 1 to 16 threads: 0 for the loss, <= 8e-7 for the gradients. A step on the batch less one example differs by
    > 7e-2 in the loss and in every gradient: the comparison can fail."""
    batch = collate_flat(rows(12, 0))
    num_tokens = batch["input_ids"].numel()
    bound = num_tokens * EPS
    one = step(model, batch, 1)
    for num_threads in sorted({3, max(torch.get_num_threads(), 2)}):
        differences = relative_differences(one, step(model, batch, num_threads))
        assert max(differences) <= bound, (num_threads, max(differences), bound)
    other = step(model, collate_flat(rows(12, 0)[:-1]), 1)
    assert min(relative_differences(one, other)) > 1e-2 > bound
