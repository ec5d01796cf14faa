"""SyncWindowWeighting: weighted sums of uneven per-rank gradients equal the global-batch gradient."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_dynamix.distributed import SyncWindowWeighting


def per_sample_grads(weights, x, y):
    """Gradients of 0.5 * (x @ w - y)^2 for each sample, shape (n, d)."""
    return (x @ weights - y).unsqueeze(1) * x


@settings(max_examples=150, deadline=None)
@given(
    world_size=st.integers(1, 4),
    window=st.integers(1, 4),
    reduction=st.sampled_from(["mean", "sum"]),
    lightning_scaling=st.booleans(),
    estimate_error=st.sampled_from([0, 0, 3, -2]),
    data=st.data(),
)
def test_window_of_uneven_changing_sizes_gives_the_exact_global_gradient(
    world_size, window, reduction, lightning_scaling, estimate_error, data
):
    torch.manual_seed(0)
    dim = 3
    weights = torch.randn(dim, dtype=torch.float64)
    # sizes[m][r]: rank r's batch size in micro-step m of the window (changing freely)
    sizes = [data.draw(st.lists(st.integers(1, 5), min_size=world_size, max_size=world_size)) for _ in range(window)]
    # what the caller expects the window to hold when it starts; may be off (sizes changed later)
    estimate = max(1, sum(map(sum, sizes)) + estimate_error)
    loss_scale = 1.0 / window if lightning_scaling else 1.0
    weightings = [SyncWindowWeighting(r, reduction) for r in range(world_size)]
    accumulated = [torch.zeros(dim, dtype=torch.float64) for _ in range(world_size)]
    all_grads = []
    for step, step_sizes in enumerate(sizes):
        for r in range(world_size):
            x = torch.randn(step_sizes[r], dim, dtype=torch.float64)
            y = torch.randn(step_sizes[r], dtype=torch.float64)
            grads = per_sample_grads(weights, x, y)
            all_grads.append(grads)
            loss_grad = grads.mean(0) if reduction == "mean" else grads.sum(0)
            factor = weightings[r].add_backward(step, step_sizes, loss_scale, estimate if step == 0 else None)
            accumulated[r] += factor * loss_scale * loss_grad
    reduced = sum(w.sync_weight() * g for w, g in zip(weightings, accumulated))
    every_sample = torch.cat(all_grads)
    expected = every_sample.mean(0) if reduction == "mean" else every_sample.sum(0)
    torch.testing.assert_close(reduced, expected, rtol=1e-12, atol=1e-12)
    if estimate_error == 0:  # a right estimate leaves the gradients untouched in the hook
        assert all(w.sync_weight() == 1.0 for w in weightings)


def test_without_accumulation_the_factor_is_the_share_of_the_global_batch_and_the_hook_weight_one():
    weighting = SyncWindowWeighting(rank=1)
    assert weighting.add_backward(0, [2, 6]) == pytest.approx(6 / 8)
    assert weighting.sync_weight() == 1.0


def test_repeated_backward_of_one_step_counts_its_samples_once():
    weighting = SyncWindowWeighting(rank=0)
    weighting.add_backward(3, [2, 2])
    weighting.add_backward(3, [2, 2])
    assert weighting.window_samples == 4


def test_unknown_loss_reduction_is_refused():
    with pytest.raises(ValueError, match=r"`loss_reduction`.*'avg'"):
        SyncWindowWeighting(0, "avg")  # type: ignore[arg-type]
