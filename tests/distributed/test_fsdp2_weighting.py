"""The per-rank batch core's weights under FSDP2 (``fully_shard``), on the pool's gloo ranks in float64: uneven
sizes, a rank with none, gradient accumulation with ``set_requires_gradient_sync``, a window whose size was guessed
wrong, all equal one process on the global batches (jobs/fsdp2_checks.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.distributed.conftest import import_job

pytestmark = pytest.mark.distributed

PLANS = {
    2: [[5, 2], [1, 6], [0, 7], [3, 0], [4, 4], [2, 5], [6, 1], [0, 3]],
    3: [[5, 2, 1], [0, 6, 2], [3, 0, 0], [4, 4, 4], [2, 5, 0], [1, 1, 6]],
}


def one_process(plan: list[list[int]], accumulate: int) -> list[torch.Tensor]:
    job = import_job("fsdp2_checks")
    x, y = job.data()
    model = job.network()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = job.steps(plan)
    for start in range(0, len(batches), accumulate):
        indices = [i for step in batches[start : start + accumulate] for each in step for i in each]
        optimizer.zero_grad()
        F.mse_loss(model(x[indices]), y[indices]).backward()
        optimizer.step()
    return [parameter.detach() for parameter in model.parameters()]


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize(("accumulate", "estimate"), [(1, "exact"), (2, "exact"), (3, "first")])
def test_sharded_training_with_uneven_sizes_equals_one_process_on_the_global_batches(
    pools, world_size, accumulate, estimate
):
    plan = PLANS[world_size]
    results = pools(world_size).run("fsdp2_checks", "train", plan=plan, accumulate=accumulate, estimate=estimate)
    expected = one_process(plan, accumulate)
    for result in results:
        worst = max((got - want).abs().max().item() for got, want in zip(result, expected))
        assert worst <= 1e-12, f"max abs difference {worst}"


def test_bf16_mixed_precision_keeps_the_weights_within_bf16_s_rounding_of_one_process(pools):
    """Under MixedPrecisionPolicy (bf16 compute, float32 reduce-scatter) the weighted job stays within bf16's rounding
    of one float32 process on the global batches, where plain FSDP2's unweighted mean of the ranks' means is off."""
    plan = PLANS[2]
    weighted = pools(2).run("fsdp2_checks", "train_mixed", plan=plan, weighted=True)[0]
    unweighted = pools(2).run("fsdp2_checks", "train_mixed", plan=plan, weighted=False)[0]
    expected = [p.float() for p in one_process(plan, 1)]

    def distance(params):
        return max(((got - want).abs().max() / want.abs().max()).item() for got, want in zip(params, expected))

    assert distance(weighted) <= 2e-2  # bf16 keeps 8 bits of mantissa: 0.4% a rounding, over 8 steps
    assert distance(unweighted) >= 5 * distance(weighted)
