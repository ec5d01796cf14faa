"""FSDP2 with per-rank batch sizes on a GPU (skipped without CUDA): two processes share the device over gloo.

NCCL refuses two ranks on one device, so the processes join a gloo group and ``fully_shard`` over a CUDA device
mesh: whether gloo carries FSDP2's all-gathers and reduce-scatters of CUDA tensors is part of what this checks. Each
rank's loss carries ``W * n_r / N`` (the package's weighting under FSDP2's averaging reduce-scatter), a rank with 0
samples runs one sample of the step at weight 0; in float32 the parameters must equal one process on the whole
global batch on the same GPU, and in bf16 (``MixedPrecisionPolicy``) stay within bf16's rounding of it, where plain
FSDP2's unweighted mean of the ranks' means is far off.
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

from lightning_dynamix.distributed import SyncWindowWeighting, free_port

pytestmark = [pytest.mark.distributed, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]

SPLITS = [(5, 2), (0, 7), (1, 6), (4, 0), (3, 4)]
WORLD = 2


def network() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 1)).cuda()


def data() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    total = sum(sum(s) for s in SPLITS)
    x, y = torch.randn(total, 8, generator=generator), torch.randn(total, 1, generator=generator)
    return x.cuda(), y.cuda()


def one_process() -> list[list[float]]:
    model, (x, y) = network(), data()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    cursor = 0
    for sizes in SPLITS:
        optimizer.zero_grad()
        F.mse_loss(model(x[cursor : cursor + sum(sizes)]), y[cursor : cursor + sum(sizes)]).backward()
        optimizer.step()
        cursor += sum(sizes)
    return [p.detach().float().cpu().flatten().tolist() for p in model.parameters()]


def _rank(rank: int, port: int, precision: str, weighted: bool, out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        model, (x, y) = network(), data()
        mesh = init_device_mesh("cuda", (WORLD,))
        options = {}
        if precision == "bf16":
            options["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh, **options)
        fully_shard(model, mesh=mesh, **options)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        weighting, cursor = SyncWindowWeighting(rank), 0
        for step, sizes in enumerate(SPLITS):
            start = cursor + sum(sizes[:rank])
            indices = list(range(start, start + sizes[rank])) or [cursor]  # a placeholder: the step's first sample
            if weighted:
                factor = weighting.add_backward(step, sizes) * WORLD
            else:  # plain FSDP2: the mean of the training ranks' means
                factor = WORLD / sum(1 for b in sizes if b > 0) * (sizes[rank] > 0)
            (F.mse_loss(model(x[indices]).float(), y[indices]) * factor).backward()
            weighting.reset()
            optimizer.step()
            optimizer.zero_grad()
            cursor += sum(sizes)
        params = [p.full_tensor().detach().float().cpu().flatten().tolist() for p in model.parameters()]
        if rank == 0:
            with open(f"{out}/{precision}-{weighted}.json", "w") as f:
                json.dump(params, f)
    finally:
        dist.destroy_process_group()


def _distance(params: list[list[float]], expected: list[list[float]]) -> float:
    return max(
        max(abs(a - b) for a, b in zip(got, want, strict=True)) / max(abs(b) for b in want)
        for got, want in zip(params, expected, strict=True)
    )


def run(tmp_path, precision: str, weighted: bool) -> list[list[float]]:
    args = (free_port(), precision, weighted, str(tmp_path))
    mp.start_processes(_rank, args=args, nprocs=WORLD, start_method="spawn")
    with open(tmp_path / f"{precision}-{weighted}.json") as f:
        return json.load(f)


def test_fsdp2_with_uneven_sizes_on_a_gpu_equals_one_process_in_float32(tmp_path):
    distance = _distance(run(tmp_path, "float32", weighted=True), one_process())
    print("fsdp2 float32", torch.cuda.get_device_name(), "largest relative difference", distance)
    assert distance <= 1e-5


def test_fsdp2_with_uneven_sizes_in_bf16_stays_within_bf16_s_rounding_of_one_process(tmp_path):
    expected = one_process()
    weighted = _distance(run(tmp_path, "bf16", weighted=True), expected)
    unweighted = _distance(run(tmp_path, "bf16", weighted=False), expected)
    print("fsdp2 bf16", torch.cuda.get_device_name(), "weighted", weighted, "unweighted", unweighted)
    assert weighted <= 2e-2
    assert unweighted >= 5 * weighted
