"""Placement: which layers run on which resource type, at the least cost for a throughput target (HeterPS).

:func:`profile_model` measures a model's layers; a catalogue of :class:`ResourceType` says what can be
rented, at what price; a :class:`CostModel` prices placements of the layers on them for a throughput
target, and the solvers find the cheapest (:func:`solve_dp` exactly, :func:`solve_brute_force` for small
chains, :func:`solve_greedy` as the baseline), as a :class:`PlacementPlan`; :func:`placement_margin` says how far
the profile's times may be off before the cheapest placement changes.
"""

from lightning_dynamix.placement.catalogue import ResourceType, load_catalogue
from lightning_dynamix.placement.cost import CostModel, InfeasibleError, PlacementPlan, Stage
from lightning_dynamix.placement.profile import (
    LayerProfile,
    ModelProfile,
    RunnerProfile,
    available_devices,
    profile_model,
)
from lightning_dynamix.placement.solvers import (
    Margin,
    best_throughput,
    placement_margin,
    solve_brute_force,
    solve_dp,
    solve_greedy,
)

__all__ = [
    "CostModel",
    "InfeasibleError",
    "LayerProfile",
    "Margin",
    "ModelProfile",
    "PlacementPlan",
    "ResourceType",
    "RunnerProfile",
    "Stage",
    "available_devices",
    "best_throughput",
    "load_catalogue",
    "placement_margin",
    "profile_model",
    "solve_brute_force",
    "solve_dp",
    "solve_greedy",
]
