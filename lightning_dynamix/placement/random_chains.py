"""Random placement problems: layer chains and catalogues, for the RL scheduler's training and for tests.

The layers and resource types span the ranges real ones do: dense layers of 0.1-100 MB and
sparse tables of 1-40 GiB, per-sample times from 10 us to 1 ms, resource types that are CPUs or GPUs
with their own prices, memories, links and speeds per layer kind.
"""

from __future__ import annotations

import random

from lightning_dynamix.placement.catalogue import ResourceType
from lightning_dynamix.placement.cost import CostModel
from lightning_dynamix.placement.profile import LayerProfile, ModelProfile

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


def random_problem(seed: int, layers: int | tuple[int, int], types: int | tuple[int, int]) -> CostModel:
    """A cost model of a random chain and catalogue (sizes fixed, or drawn from inclusive ranges)."""
    rng = random.Random(seed)
    num_layers = layers if isinstance(layers, int) else rng.randint(*layers)
    num_types = types if isinstance(types, int) else rng.randint(*types)
    return CostModel(random_chain(rng, num_layers), random_catalogue(rng, num_types), rng.uniform(50, 2000), 10**6)
