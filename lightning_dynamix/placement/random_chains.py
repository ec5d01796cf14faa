"""Random placement problems: layer chains and catalogues, for the RL scheduler's training and for tests.

The layers and resource types span the ranges real ones do: dense layers of 0.1-100 MB and
sparse tables of 1-40 GiB, per-sample times from 10 us to 1 ms, resource types that are CPUs or GPUs
with their own prices, memories, links and speeds per layer kind.
"""

from __future__ import annotations

import math
import random

from lightning_dynamix.placement.catalogue import ResourceType
from lightning_dynamix.placement.cost import CostModel
from lightning_dynamix.placement.profile import LayerProfile, ModelProfile, RunnerProfile

GIB = 2**30


def random_chain(rng: random.Random, layers: int) -> ModelProfile:
    """A chain of ``layers`` layers, three in ten of them sparse, timed on the CPU."""
    profiles = []
    for index in range(layers):
        sparse = rng.random() < 0.3
        profiles.append(
            LayerProfile(
                name=f"layer{index}",
                kind="sparse" if sparse else "dense",
                seconds={"cpu": rng.uniform(1e-5, 1e-3)},
                parameter_bytes=int(rng.uniform(1, 40) * GIB) if sparse else int(rng.uniform(1e5, 1e8)),
                activation_bytes=int(rng.uniform(64, 65536)),
            )
        )
    return ModelProfile(tuple(profiles), batch_size=256, step_seconds={})


def random_catalogue(rng: random.Random, types: int, scarce: bool = False) -> list[ResourceType]:
    """``types`` resource types, CPU and GPU in turn; ``scarce``: 2-6 units of each, else 20-200."""
    resources = []
    for index in range(types):
        resources.append(
            ResourceType(
                name=f"type{index}",
                device="gpu" if index % 2 else "cpu",
                price_per_hour=rng.uniform(0.1, 3.0),
                units=rng.randint(2, 6) if scarce else rng.randint(20, 200),
                memory_bytes=int(rng.uniform(8, 256) * GIB),
                link_bandwidth=rng.uniform(1e8, 5e9),
                relative_speed={"dense": rng.uniform(0.5, 30), "sparse": rng.uniform(0.3, 3)},
            )
        )
    return resources


def cloud_catalogue(rng: random.Random, types: int) -> list[ResourceType]:
    """``types`` resource types drawn as a cloud's are: each a CPU or a GPU type, with the spread real
    ones have: a GPU up to 300 times a CPU core on dense layers and up to 10 times on tables, prices of
    0.1 to 10 per hour, and from 1 to 64 units to rent."""
    resources = []
    for index in range(types):
        gpu = rng.random() < 0.5
        resources.append(
            ResourceType(
                name=f"type{index}",
                device="gpu" if gpu else "cpu",
                price_per_hour=_log_uniform(rng, 0.3, 10.0) if gpu else _log_uniform(rng, 0.1, 3.0),
                units=rng.randint(1, 16) if gpu else rng.randint(2, 64),
                memory_bytes=int((_log_uniform(rng, 8, 96) if gpu else _log_uniform(rng, 16, 512)) * GIB),
                link_bandwidth=_log_uniform(rng, 1e8, 2e10),
                relative_speed={
                    "dense": _log_uniform(rng, 5, 300) if gpu else _log_uniform(rng, 1, 20),
                    "sparse": _log_uniform(rng, 1, 10),
                },
            )
        )
    return resources


def random_problem(seed: int, layers: int | tuple[int, int], types: int | tuple[int, int]) -> CostModel:
    """A cost model of a random chain and catalogue (sizes fixed, or drawn from inclusive ranges)."""
    rng = random.Random(seed)
    num_layers = layers if isinstance(layers, int) else rng.randint(*layers)
    num_types = types if isinstance(types, int) else rng.randint(*types)
    return CostModel(random_chain(rng, num_layers), random_catalogue(rng, num_types), rng.uniform(50, 2000), 10**6)


def _log_uniform(rng: random.Random, low: float, high: float) -> float:
    return math.exp(rng.uniform(math.log(low), math.log(high)))


def random_recommendation_problem(seed: int, runner: bool = False) -> CostModel:
    """A recommendation model's chain, shaped as the DLRM example's: 8-40 embedding tables (1 KiB to
    40 GiB each), then 2-16 dense layers, on 2-4 types of a :func:`cloud_catalogue`, at 50 to 20
    million samples/s.

    With ``runner``, random terms of the offload runner (:class:`RunnerProfile`: its loop, batch,
    optimiser, rows per table and their costs, a server's round trip and work per table), spread
    over the ranges ``dynamix plan`` measures.
    """
    rng = random.Random(seed)
    tables, dense = rng.randint(8, 40), rng.randint(2, 16)
    layers = []
    for index in range(tables + dense):
        sparse = index < tables
        layers.append(
            LayerProfile(
                name=f"layer{index}",
                kind="sparse" if sparse else "dense",
                seconds={"cpu": _log_uniform(rng, 1e-7, 1e-4) if sparse else _log_uniform(rng, 1e-6, 1e-3)},
                parameter_bytes=int(_log_uniform(rng, 2**10, 40 * GIB) if sparse else _log_uniform(rng, 1e4, 1e8)),
                activation_bytes=int(_log_uniform(rng, 64, 65536)),
            )
        )
    profile = ModelProfile(tuple(layers), batch_size=256, step_seconds={})
    resources = cloud_catalogue(rng, rng.randint(2, 4))
    target = _log_uniform(rng, 50, 2e7)
    if runner:
        request = _log_uniform(rng, 1e-4, 3e-3)
        terms = RunnerProfile(
            batch_size=256,
            step_seconds=_log_uniform(rng, 1e-3, 1e-2),
            loader_seconds=_log_uniform(rng, 1e-5, 2e-3),
            optimizer_seconds=_log_uniform(rng, 1e-5, 1e-3),
            rows={layer.name: float(int(_log_uniform(rng, 1, 256))) for layer in layers if layer.kind == "sparse"},
            trainer_row_seconds=_log_uniform(rng, 1e-8, 1e-6),
            server_row_seconds=_log_uniform(rng, 1e-8, 1e-6),
            request_seconds=request,
            server_table_seconds=request * rng.uniform(0, 1),
        )
        profile = profile.with_runner(terms)
    return CostModel(profile, resources, target, 10**6)
