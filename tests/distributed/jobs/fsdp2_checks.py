"""Tasks for tests/distributed/test_fsdp2_weighting.py: the weights of the per-rank batch core under FSDP2.

A float64 MLP, ``fully_shard`` on each Linear and on the root, trained on a plan of per-rank sizes (0 included) on
the pool's ranks, each backward's loss scaled by :class:`~lightning_dynamix.distributed.SyncWindowWeighting`'s
factor times the world size (FSDP2's reduce-scatter averages where DDP's hook sums), a rank without samples running
one sample of the step's global batch at weight 0 (so it takes part in every all-gather and reduce-scatter), the
window's correction applied to the sharded gradients after its last backward.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from lightning_dynamix.distributed import SyncWindowWeighting

NUM_SAMPLES, FEATURES = 96, 8


def data() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(NUM_SAMPLES, FEATURES, generator=generator, dtype=torch.float64)
    return x, torch.randn(NUM_SAMPLES, 1, generator=generator, dtype=torch.float64)


def network() -> torch.nn.Sequential:
    torch.manual_seed(1)
    layers = [torch.nn.Linear(FEATURES, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(16, 1)).double()


def steps(plan: list[list[int]]) -> list[list[list[int]]]:
    """Every step's indices per rank: the plan's sizes over consecutive samples."""
    cursor, out = 0, []
    for sizes in plan:
        out.append([list(range(cursor + sum(sizes[:r]), cursor + sum(sizes[: r + 1]))) for r in range(len(sizes))])
        cursor += sum(sizes)
    return out


def train(plan: list[list[int]], accumulate: int, estimate: str) -> list[torch.Tensor]:
    """The full parameters after training ``plan`` in windows of ``accumulate`` steps; ``estimate``: ``"exact"``
    (each window's samples known at its first backward) or ``"first"`` (its first step's, as when sizes change
    inside it: the correction at the window's end makes up the difference)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    x, y = data()
    model = network()
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    weighting = SyncWindowWeighting(rank)
    batches = steps(plan)
    for start in range(0, len(batches), accumulate):
        window = list(range(start, min(start + accumulate, len(batches))))
        total = sum(len(indices) for step in window for indices in batches[step])
        for step in window:
            last = step == window[-1]
            model.set_requires_gradient_sync(last)
            sizes = [len(indices) for indices in batches[step]]
            guess = total if estimate == "exact" else sum(sizes) * len(window)
            factor = weighting.add_backward(step, sizes, window_estimate=guess) * world
            indices = batches[step][rank] or [i for each in batches[step] for i in each][:1]  # a placeholder
            loss = F.mse_loss(model(x[indices]), y[indices])
            (loss * factor).backward()
        correction = weighting.sync_weight()
        if correction != 1.0:
            for parameter in model.parameters():
                parameter.grad.mul_(correction)
        weighting.reset()
        optimizer.step()
        optimizer.zero_grad()
    return [parameter.full_tensor().detach() for parameter in model.parameters()]


def train_mixed(plan: list[list[int]], weighted: bool) -> list[torch.Tensor]:
    """The full parameters after training ``plan`` in float32 under ``MixedPrecisionPolicy(param_dtype=bfloat16,
    reduce_dtype=float32)``, each rank's loss weighted by the batch core (``weighted``) or not (plain FSDP2's mean
    of the ranks' means), a rank without samples on a placeholder at weight 0 either way."""
    world, rank = dist.get_world_size(), dist.get_rank()
    x, y = (t.float() for t in data())
    model = network().float()
    mesh = init_device_mesh("cpu", (world,))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    weighting = SyncWindowWeighting(rank)
    for step, indices_per_rank in enumerate(steps(plan)):
        sizes = [len(indices) for indices in indices_per_rank]
        training = sum(1 for b in sizes if b > 0)
        factor = weighting.add_backward(step, sizes) * world if weighted else world / training * (sizes[rank] > 0)
        indices = indices_per_rank[rank] or [i for each in indices_per_rank for i in each][:1]
        loss = F.mse_loss(model(x[indices]).float(), y[indices])
        (loss * factor).backward()
        weighting.reset()
        optimizer.step()
        optimizer.zero_grad()
    return [parameter.full_tensor().detach().float() for parameter in model.parameters()]
