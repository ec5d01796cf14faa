"""GlobalBatchNorm on a GPU, and torch's SyncBatchNorm beside it, with uneven per-rank batches (skipped without CUDA).

Three processes share one GPU (gloo carries the CUDA tensors: NCCL refuses two ranks on one device) and
train a model with BatchNorm2d and BatchNorm1d on splits of every global batch that are uneven and change;
their parameters and running statistics must equal one process on the whole global batch on the same GPU.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

from lightning_dynamix.distributed import free_port

pytestmark = [pytest.mark.distributed, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]

SPLITS = [(2, 7, 1), (5, 1, 4), (1, 1, 8), (3, 3, 4)]
WORLD = 3


def network(dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(),
        nn.Linear(4 * 5 * 5, 6), nn.BatchNorm1d(6), nn.Linear(6, 2),
    ).to("cuda", dtype)  # fmt: skip


def batches(dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    data = [
        (torch.randn(sum(s), 3, 5, 5, generator=generator), torch.randint(2, (sum(s),), generator=generator))
        for s in SPLITS
    ]
    return [(x.to("cuda", dtype), y.cuda()) for x, y in data]


def train(model: nn.Module, rank: int | None, dtype: torch.dtype) -> dict[str, list]:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for sizes, (x, y) in zip(SPLITS, batches(dtype), strict=True):
        if rank is not None:  # this rank's slice, its loss weighted by its share: the sum is the global mean
            start = sum(sizes[:rank])
            x, y = x[start : start + sizes[rank]], y[start : start + sizes[rank]]
        loss = F.cross_entropy(model(x), y, reduction="sum") / sum(sizes)
        optimizer.zero_grad()
        loss.backward()
        if rank is not None:
            for p in model.parameters():
                dist.all_reduce(p.grad)
        optimizer.step()
    return {k: v.double().cpu().flatten().tolist() for k, v in model.state_dict().items()}


def _rank(rank: int, port: int, kind: str, dtype: torch.dtype, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        model = network(dtype)
        if kind == "global":
            from lightning_dynamix.distributed.batch_norm import convert_batch_norm

            model = convert_batch_norm(model)
        else:
            model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
        state = train(model, rank, dtype)
        with open(f"{out}/{kind}-{rank}.json", "w") as f:
            json.dump(state, f)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("kind", ["global", "torch-sync"])
def test_batch_norm_over_uneven_ranks_on_a_gpu_equals_one_process(tmp_path, kind, dtype):
    expected = train(network(dtype), None, dtype)
    mp.start_processes(_rank, args=(free_port(), kind, dtype, str(tmp_path)), nprocs=WORLD, start_method="spawn")
    tolerance = 1e-6 if dtype == torch.float64 else 1e-4
    worst = {}
    for rank in range(WORLD):
        with open(tmp_path / f"{kind}-{rank}.json") as f:
            state = json.load(f)
        for key, values in expected.items():
            diff = max((abs(a - b) for a, b in zip(state[key], values, strict=True)), default=0.0)
            worst[key] = max(worst.get(key, 0.0), diff)
    print(kind, dtype, torch.cuda.get_device_name(), "largest difference", max(worst.values()))
    assert max(worst.values()) <= tolerance, worst
