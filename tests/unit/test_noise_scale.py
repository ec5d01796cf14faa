"""GradientNoiseScale: B_noise from uneven per-rank gradients, its moving averages and its distributed sync."""

from __future__ import annotations

import io
import json
import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lightning_dynamix.distributed import free_port
from lightning_dynamix.metrics.noise_scale import GradientNoiseScale


def feed_exact(metric, trace, sq_norm, sizes):
    """One synchronising step whose squared norms are exactly their expectations for the given tr(Σ), |G|²."""
    total = sum(sizes)
    for size in sizes:
        metric.update(sq_norm + trace / size, size, sq_norm + trace / total, total)


def test_linear_regression_estimate_matches_the_analytic_noise_scale():
    # y = x·w* + ε with x ~ N(0, I_d), ε ~ N(0, σ²), loss ½(x·w - y)²; at w = w* + δ the per-sample gradient
    # (x·δ - ε) x has mean δ and covariance (|δ|² + σ²) I + δδᵀ
    torch.manual_seed(0)
    dim, noise_std, delta_sq_norm = 10, 1.0, 0.25
    sizes = [16, 48, 80]  # three ranks, uneven
    true_trace = dim * (delta_sq_norm + noise_std**2) + delta_sq_norm
    true_noise_scale = true_trace / delta_sq_norm  # 51 samples
    w_star = torch.randn(dim, dtype=torch.float64)
    delta = torch.randn(dim, dtype=torch.float64)
    delta *= math.sqrt(delta_sq_norm) / delta.norm()
    weights = (w_star + delta).requires_grad_(True)

    def mean_gradient(x, y):
        (grad,) = torch.autograd.grad((0.5 * (x @ weights - y) ** 2).mean(), weights)
        return grad

    metric = GradientNoiseScale(ema_decay=0.9)
    for step in range(400):
        xs = [torch.randn(size, dim, dtype=torch.float64) for size in sizes]
        ys = [x @ w_star + noise_std * torch.randn(len(x), dtype=torch.float64) for x in xs]
        global_grad = mean_gradient(torch.cat(xs), torch.cat(ys))
        for size, x, y in zip(sizes, xs, ys):
            metric.update(mean_gradient(x, y).square().sum(), size, global_grad.square().sum(), sum(sizes))
        if (step + 1) % 100 == 0:
            estimate = metric.compute().item()
            metric.reset()

    print(f"B_noise estimate {estimate:.2f} vs analytic {true_noise_scale:.2f}")
    assert estimate == pytest.approx(true_noise_scale, rel=0.2)
    assert metric.noise_scale == estimate
    assert metric.trace_estimate == pytest.approx(true_trace, rel=0.15)
    assert metric.sq_norm_estimate == pytest.approx(delta_sq_norm, rel=0.15)


def test_noise_free_norms_give_trace_and_sq_norm_back():
    metric = GradientNoiseScale()
    for sizes in ([4, 12], [8, 8, 16], [3, 29]):  # changing sizes within an interval
        feed_exact(metric, trace=8.0, sq_norm=0.5, sizes=sizes)
    assert metric.compute().item() == pytest.approx(16.0, rel=1e-12)
    assert metric.trace_estimate == pytest.approx(8.0, rel=1e-12)
    assert metric.sq_norm_estimate == pytest.approx(0.5, rel=1e-12)


def test_one_rank_alone_is_unestimable_and_leaves_the_averages_alone():
    metric = GradientNoiseScale()
    feed_exact(metric, trace=8.0, sq_norm=0.5, sizes=[4, 12])
    metric.compute()
    metric.reset()
    for _ in range(3):
        metric.update(1.3, 32, 1.3, 32)  # b == B: no information on the slope
    assert math.isnan(metric.compute().item())
    assert metric.trace_estimate == pytest.approx(8.0, rel=1e-12)
    assert metric.noise_scale == pytest.approx(16.0, rel=1e-12)


def test_an_interval_without_updates_is_nan():
    metric = GradientNoiseScale()
    with pytest.warns(UserWarning, match="before the ``update``"):
        assert math.isnan(metric.compute().item())
    assert math.isnan(metric.trace_estimate)
    assert math.isnan(metric.sq_norm_estimate)


def test_a_non_finite_step_makes_the_interval_unestimable():
    metric = GradientNoiseScale()
    feed_exact(metric, trace=8.0, sq_norm=0.5, sizes=[4, 12])
    metric.update(torch.tensor(float("inf")), 4, 1.0, 16)  # an overflowed AMP step
    assert math.isnan(metric.compute().item())
    assert math.isnan(metric.trace_estimate)


def test_gradient_hidden_by_noise_is_nan_and_negative_trace_is_zero():
    metric = GradientNoiseScale()
    feed_exact(metric, trace=8.0, sq_norm=-0.1, sizes=[4, 12])
    assert math.isnan(metric.compute().item())
    assert metric.sq_norm_estimate == pytest.approx(-0.1, rel=1e-9)  # kept raw for later intervals
    metric.reset()
    feed_exact(metric, trace=8.0, sq_norm=5.0, sizes=[4, 12])
    assert metric.compute().item() > 0  # the average recovers: (0.9 * -0.1 + 5) / 1.9 > 0

    negative = GradientNoiseScale()
    feed_exact(negative, trace=-1.0, sq_norm=0.5, sizes=[4, 12])
    assert negative.compute().item() == 0.0


def test_first_interval_average_is_the_interval_estimate_exactly():
    smoothed, latest_only = GradientNoiseScale(ema_decay=0.9), GradientNoiseScale(ema_decay=0.0)
    generator = torch.Generator().manual_seed(1)
    for _ in range(7):
        local, global_ = torch.rand(2, generator=generator, dtype=torch.float64).tolist()
        for metric in (smoothed, latest_only):
            metric.update(local + 1.0, 5, global_, 21)
    assert smoothed.compute().item() == latest_only.compute().item()
    assert smoothed.trace_estimate == latest_only.trace_estimate
    assert smoothed.sq_norm_estimate == latest_only.sq_norm_estimate


def test_later_intervals_follow_the_bias_corrected_average():
    decay = 0.8
    metric = GradientNoiseScale(ema_decay=decay)
    traces = [8.0, 20.0, 2.0]
    for trace in traces:
        feed_exact(metric, trace=trace, sq_norm=0.5, sizes=[4, 12])
        metric.compute()
        metric.reset()
    weights = [decay**2, decay, 1.0]  # (1 - decay) cancels in the bias correction
    expected = sum(w * t for w, t in zip(weights, traces)) / sum(weights)
    assert metric.trace_estimate == pytest.approx(expected, rel=1e-12)
    assert metric.noise_scale == pytest.approx(expected / 0.5, rel=1e-12)


@pytest.mark.parametrize("cache", [True, False])
def test_computing_twice_folds_the_interval_once(cache):
    metric = GradientNoiseScale(ema_decay=0.5, compute_with_cache=cache)
    feed_exact(metric, trace=8.0, sq_norm=0.5, sizes=[4, 12])
    metric.compute()
    metric.reset()
    feed_exact(metric, trace=20.0, sq_norm=0.5, sizes=[4, 12])
    first = metric.compute().item()
    assert metric.compute().item() == first
    assert metric.trace_estimate == pytest.approx((0.5 * 8.0 + 20.0) / 1.5, rel=1e-12)


def test_reset_clears_the_interval_but_keeps_the_averages():
    metric = GradientNoiseScale()
    feed_exact(metric, trace=8.0, sq_norm=0.5, sizes=[4, 12])
    metric.compute()
    metric.reset()
    assert torch.count_nonzero(metric.sums) == 0
    assert metric.trace_estimate == pytest.approx(8.0, rel=1e-12)


def test_state_dict_round_trip_continues_the_averages_identically():
    original = GradientNoiseScale(ema_decay=0.7)
    for trace in (8.0, 20.0):
        feed_exact(original, trace=trace, sq_norm=0.5, sizes=[4, 12])
        original.compute()
        original.reset()
    buffer = io.BytesIO()
    torch.save(original.state_dict(), buffer)
    buffer.seek(0)
    restored = GradientNoiseScale(ema_decay=0.7)
    restored.load_state_dict(torch.load(buffer, weights_only=True))
    assert restored.trace_estimate == original.trace_estimate

    for metric in (original, restored):
        feed_exact(metric, trace=3.0, sq_norm=0.25, sizes=[6, 10])
    assert restored.compute().item() == original.compute().item()
    assert restored.trace_estimate == original.trace_estimate
    assert restored.sq_norm_estimate == original.sq_norm_estimate


def test_a_half_precision_cast_keeps_the_sums_in_float64():
    cast, uncast = GradientNoiseScale().to(torch.float16), GradientNoiseScale()
    assert cast.sums.dtype == torch.float64
    # norms of 1000.0014 and 1000.0033 are all 1000 in float16, which would hide the noise entirely
    for metric in (cast, uncast):
        feed_exact(metric, trace=1.0, sq_norm=1000.0, sizes=[300, 700])
    assert cast.compute().item() == uncast.compute().item() == pytest.approx(1e-3, rel=1e-6)


def test_calling_the_metric_only_accumulates():
    called, updated = GradientNoiseScale(), GradientNoiseScale()
    assert called(2.5, 4, 1.0, 16) is None
    updated.update(2.5, 4, 1.0, 16)
    assert called.compute().item() == updated.compute().item()


def test_tensor_inputs_with_grad_and_other_dtypes_are_accepted():
    metric = GradientNoiseScale()
    norm = torch.tensor(2.5, dtype=torch.float32, requires_grad=True)
    metric.update(norm, torch.tensor(4), torch.tensor([1.0]), torch.tensor(16))
    assert metric.sums.dtype == torch.float64
    assert metric.sums[-1].item() == 1.0


@pytest.mark.parametrize("decay", [-0.1, 1.0, 1.5, float("nan"), True, "0.9"])
def test_a_bad_ema_decay_is_rejected(decay):
    with pytest.raises(ValueError, match=rf"`ema_decay` must be a number in \[0, 1\), got {decay!r}"):
        GradientNoiseScale(ema_decay=decay)


def test_a_non_positive_batch_size_is_rejected():
    metric = GradientNoiseScale()
    with pytest.raises(ValueError, match="`local_batch_size` must be a positive number of samples, got 0"):
        metric.update(1.0, 0, 1.0, 16)


# ---------------------------------------------------------------------------------------------------------------
# distributed: two gloo processes, each updating with its own rank's values

WORLD_SIZE = 2


def rank_updates(rank):
    """(interval, local_sq_norm, local_batch_size, global_sq_norm, global_batch_size) for one rank; every rank
    derives all ranks' values from one seed, so the global values agree."""
    generator = torch.Generator().manual_seed(7)
    updates = []
    for interval in range(2):
        for _ in range(5):
            sizes = torch.randint(1, 40, (WORLD_SIZE,), generator=generator).tolist()
            noise = torch.rand(WORLD_SIZE + 1, generator=generator, dtype=torch.float64).tolist()
            total = sum(sizes)
            global_sq = 0.5 + 8.0 / total + 0.1 * noise[-1]
            updates += [
                (interval, 0.5 + 8.0 / sizes[r] + 0.1 * noise[r], sizes[r], global_sq, total) for r in range(WORLD_SIZE)
            ]
    return [u for i, u in enumerate(updates) if rank is None or i % WORLD_SIZE == rank]


def run_intervals(metric, updates):
    results = []
    for interval in range(2):
        for _, *values in (u for u in updates if u[0] == interval):
            metric.update(*values)
        results.append(metric.compute().item())
        metric.reset()
    return {"computed": results, "trace": metric.trace_estimate, "sq_norm": metric.sq_norm_estimate}


def distributed_worker(rank, port, out_dir):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD_SIZE)
    try:
        result = run_intervals(GradientNoiseScale(ema_decay=0.6), rank_updates(rank))
    finally:
        dist.destroy_process_group()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))


@pytest.mark.distributed
def test_two_gloo_ranks_compute_what_one_process_fed_every_rank_computes(tmp_path):
    mp.spawn(distributed_worker, args=(free_port(), str(tmp_path)), nprocs=WORLD_SIZE, join=True)
    results = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(WORLD_SIZE)]
    assert results[0] == results[1]  # every rank folds the same synced sums

    expected = run_intervals(GradientNoiseScale(ema_decay=0.6), rank_updates(None))
    assert results[0]["computed"] == pytest.approx(expected["computed"], rel=1e-12)
    assert results[0]["trace"] == pytest.approx(expected["trace"], rel=1e-12)
    assert results[0]["sq_norm"] == pytest.approx(expected["sq_norm"], rel=1e-12)
    # one rank's values alone would give another answer: the sync is what makes them agree
    alone = run_intervals(GradientNoiseScale(ema_decay=0.6), rank_updates(0))
    assert alone["computed"] != pytest.approx(expected["computed"], rel=1e-6)
