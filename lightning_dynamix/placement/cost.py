"""The cost of running a model's layers on rented resource types at a throughput target (HeterPS).

A placement gives every layer of a chain a resource type. Consecutive layers on one type form a
*stage*; stages run as a pipeline, each data-parallel over its own units. For a stage of layers
``i..j`` on type ``k``:

How it works, in full: ``docs/internals.md``, section ``lightning_dynamix/placement/cost.py``.
"""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import yaml

from lightning_dynamix._checks import require_number
from lightning_dynamix.placement.catalogue import ResourceType
from lightning_dynamix.placement.profile import ModelProfile

_ID_BYTES = 16  # a row's id, to the server with the lookup and again with its gradient (int64 each time)


class InfeasibleError(ValueError):
    """No placement meets the throughput target with the resources of the catalogue."""


@dataclass(frozen=True)
class Stage:
    """Consecutive layers on one resource type.

    Attributes:
        first, last: the stage's first and last layer (indices into the profile, inclusive).
        resource: the resource type's name.
        device: the resource type's device (``"cpu"`` or ``"gpu"``).
        units: units rented for it.
        seconds_per_sample: one unit's seconds per sample, transfers included.
        throughput: the stage's samples/s: ``units / seconds_per_sample``, or with the runner's terms
            on a stage of embedding servers, less (each server after the first adds to a step; see
            the module).
        cost_per_hour: ``units`` times the type's price.
        serial_seconds_per_sample: what the stage adds per sample when the stages run one after another
            rather than as a pipeline (:attr:`PlacementPlan.sequential_throughput`): an embedding server's
            rows and their gradients, which a pipeline moves both ways at once and a step one after the other.
    """

    first: int
    last: int
    resource: str
    device: str
    units: int
    seconds_per_sample: float
    throughput: float
    cost_per_hour: float
    serial_seconds_per_sample: float = 0.0


@dataclass(frozen=True)
class PlacementPlan:
    """Where every layer runs, how many units each stage rents, and what that costs.

    Attributes:
        layers: the layers' names, in execution order.
        kinds: per layer, ``"sparse"`` or ``"dense"``.
        assignment: per layer, its resource type's name.
        stages: the pipeline's stages.
        throughput: predicted samples/s of the stages run as a pipeline (the slowest stage's);
            :attr:`sequential_throughput` is the prediction for stages run one after another.
        target_throughput: the samples/s the plan was made for.
        cost_per_hour: all units' price per hour.
        training_cost: the cost of ``training_samples`` samples at the target throughput.
        training_samples: samples the training cost is for.
        solver: which solver made the plan.
        runner: the runner's terms the stages include (:meth:`RunnerProfile.to_dict`), None where the
            profile had none: the layers alone were priced.
    """

    layers: tuple[str, ...]
    kinds: tuple[str, ...]
    assignment: tuple[str, ...]
    stages: tuple[Stage, ...]
    throughput: float
    target_throughput: float
    cost_per_hour: float
    training_cost: float
    training_samples: int
    solver: str = ""
    runner: dict[str, Any] | None = None

    @property
    def sequential_throughput(self) -> float:
        """Samples/s when the stages run one after another rather than as a pipeline.

        That is how :class:`~lightning_dynamix.strategies.LayerOffloadStrategy` runs a plan: a step
        looks up the embedding servers' rows, runs the dense layers, then pushes the gradients back.
        The seconds per sample are the sum over the stages of the inverse of each stage's throughput
        and of what it adds run that way (:attr:`Stage.serial_seconds_per_sample`), and the throughput is
        the inverse of that sum. It is never above :attr:`throughput`.
        """
        seconds = sum(1 / stage.throughput + stage.serial_seconds_per_sample for stage in self.stages)
        return 1 / seconds if seconds > 0 else math.inf

    def describe_stages(self) -> str:
        """The stages in one line: ``RESOURCE xUNITS layers FIRST-LAST``, comma-separated."""
        return ", ".join(f"{s.resource} x{s.units} layers {s.first}-{s.last}" for s in self.stages)

    def offloaded_layers(self) -> list[str]:
        """The sparse layers (embedding tables) the plan puts on CPU resource types: the embedding servers'."""
        return [
            self.layers[index]
            for stage in self.stages
            if stage.device == "cpu"
            for index in range(stage.first, stage.last + 1)
            if self.kinds[index] == "sparse"
        ]

    def embedding_servers(self) -> int:
        """Units of the CPU stages that hold the offloaded layers (at least 1)."""
        units = sum(
            stage.units
            for stage in self.stages
            if stage.device == "cpu" and "sparse" in self.kinds[stage.first : stage.last + 1]
        )
        return max(units, 1)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["layers"], data["kinds"], data["assignment"] = list(self.layers), list(self.kinds), list(self.assignment)
        data["stages"] = [asdict(stage) for stage in self.stages]
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PlacementPlan:
        return cls(
            layers=tuple(data["layers"]),
            kinds=tuple(data["kinds"]),
            assignment=tuple(data["assignment"]),
            stages=tuple(Stage(**stage) for stage in data["stages"]),
            throughput=float(data["throughput"]),
            target_throughput=float(data["target_throughput"]),
            cost_per_hour=float(data["cost_per_hour"]),
            training_cost=float(data["training_cost"]),
            training_samples=int(data["training_samples"]),
            solver=str(data.get("solver", "")),
            runner=data.get("runner"),
        )

    def save(self, path: str | Path) -> None:
        """Write the plan as JSON, or as YAML for a ``.yaml``/``.yml`` path."""
        path = Path(path)
        data = self.to_dict()
        text = yaml.safe_dump(data, sort_keys=False) if path.suffix in (".yaml", ".yml") else json.dumps(data, indent=2)
        path.write_text(text)

    @classmethod
    def load(cls, path: str | Path) -> PlacementPlan:
        """Read a plan written by :meth:`save` (JSON or YAML)."""
        return cls.from_dict(yaml.safe_load(Path(path).read_text()))  # JSON is YAML


class CostModel:
    """Prices placements of ``profile``'s layers on ``resources`` for a throughput target.

    Args:
        profile: the model's layers, measured.
        resources: the resource types that can be rented.
        target_throughput: samples/s the pipeline must sustain.
        training_samples: samples of the whole training, for its cost.
        parameter_copies: bytes held per parameter byte (weights, gradients, optimiser state).

    Raises:
        ValueError: for a bad argument, or a resource type that cannot run some layer at all (a
            layer whose profile has no time for its device).
    """

    def __init__(
        self,
        profile: ModelProfile,
        resources: Sequence[ResourceType],
        target_throughput: float,
        training_samples: int = 1,
        parameter_copies: float = 3.0,
    ) -> None:
        if not profile.layers:
            raise ValueError("the profile has no layers: nothing to place")
        if not resources:
            raise ValueError("`resources` is empty: give at least one resource type")
        self.profile, self.resources = profile, tuple(resources)
        self.target = require_number("target_throughput", target_throughput, 0.0, low_open=True)
        if isinstance(training_samples, bool) or not isinstance(training_samples, int) or training_samples < 1:
            raise ValueError(f"`training_samples` must be an int >= 1, got {training_samples!r}")
        self.training_samples = training_samples
        self.parameter_copies = require_number("parameter_copies", parameter_copies, 0.0)
        layers = profile.layers
        n = len(layers)
        # prefix sums of layer seconds (per type), dense and sparse bytes: every stage in O(1)
        self._seconds: list[list[float]] = []
        self._fixed: list[float] = []  # per type: what a stage of dense layers pays per sample beyond them
        self._served: list[list[float]] = []  # per type, prefix sums: tables an embedding server would hold
        self._request: list[float] = []  # per type: what each embedding server adds to a step, per sample
        self._serial: list[list[float]] = []  # per type, prefix sums: a served table's rows out, stage after stage
        runner = profile.runner
        for resource in self.resources:
            device = "cuda" if resource.device == "gpu" and "cuda" in profile.devices else "cpu"
            if device not in profile.devices:
                raise ValueError(
                    f"resource {resource.name!r} runs on {resource.device}, and the profile has no time for"
                    f" {device} (it has {list(profile.devices)}): profile the model on {device}"
                )
            seconds = [layer.seconds[device] / resource.speed(layer.kind) for layer in layers]
            fixed, served, request, serial = 0.0, [0] * n, 0.0, [0.0] * n
            if runner is not None:
                if resource.device == "cpu":  # the strategy serves these tables from embedding servers
                    speed = resource.speed("sparse")
                    row = runner.trainer_row_seconds + runner.server_row_seconds / speed
                    # its round trip as measured; its work on its tables, as its rows, at the type's speed
                    table_work = runner.server_table_seconds
                    request = (runner.request_seconds - table_work + table_work / speed) / runner.batch_size
                    for index, layer in enumerate(layers):
                        if layer.kind == "sparse":
                            rows = runner.rows.get(layer.name, 0.0) / runner.batch_size
                            # the busier way: the gradients and the ids to the server; the rows come back
                            to_server = rows * (layer.activation_bytes + _ID_BYTES) / resource.link_bandwidth
                            seconds[index] += rows * row + to_server
                            serial[index] = rows * layer.activation_bytes / resource.link_bandwidth
                            served[index] = 1
                unattributed = profile.unattributed_seconds(device) if device in profile.step_seconds else 0.0
                # the empty step's server is charged with the servers, as every other one (request)
                fixed = (runner.fixed_seconds - runner.request_seconds) / runner.batch_size
                fixed += max(unattributed, 0.0) / resource.speed("dense")
            self._seconds.append(_prefix(seconds))
            self._fixed.append(fixed)
            self._serial.append(_prefix(serial))
            self._served.append(_prefix(served))
            self._request.append(request)
        self.runner = None if runner is None else runner.to_dict()
        self._dense = _prefix([layer.parameter_bytes if layer.kind == "dense" else 0 for layer in layers])
        self._dense_count = _prefix([1 if layer.kind == "dense" else 0 for layer in layers])
        self._sparse = _prefix([layer.parameter_bytes if layer.kind == "sparse" else 0 for layer in layers])
        self._activation = [layer.activation_bytes for layer in layers]
        self.num_layers = n

    def with_target(self, target_throughput: float) -> CostModel:
        """The same model for another throughput target."""
        other = copy.copy(self)
        other.target = require_number("target_throughput", target_throughput, 0.0, low_open=True)
        return other

    def stage_seconds(self, first: int, last: int, resource: int) -> float:
        """One unit's seconds per sample for layers ``first..last`` on type ``resource``, transfers included."""
        kind = self.resources[resource]
        seconds = self._seconds[resource][last + 1] - self._seconds[resource][first]
        if kind.device != "cpu" or self._dense_count[last + 1] > self._dense_count[first]:
            seconds += self._fixed[resource]  # not a stage of embedding servers: its units run the step's loop
        elif self._served[resource][last + 1] > self._served[resource][first]:
            return seconds  # embedding servers: what crosses their link is their rows, charged with each table
        if first > 0:
            seconds += 2 * self._activation[first - 1] / kind.link_bandwidth
        if last < self.num_layers - 1:
            seconds += 2 * self._activation[last] / kind.link_bandwidth
        return seconds

    def stage(self, first: int, last: int, resource: int) -> Stage | None:
        """Stage ``first..last`` on resource type index ``resource``, or None when it cannot meet the target."""
        kind = self.resources[resource]
        seconds = self.stage_seconds(first, last, resource)
        # the stage's units are embedding servers: each one more adds its round trip and its work per table
        servers = self._served[resource][last + 1] > self._served[resource][first]
        request = self._request[resource] if servers else 0.0
        units = max(1, math.ceil(self.target * seconds * (1 - 1e-12)))
        dense = self.parameter_copies * (self._dense[last + 1] - self._dense[first])
        sparse = self.parameter_copies * (self._sparse[last + 1] - self._sparse[first])
        if sparse > 0:
            room = kind.memory_bytes - dense
            if room <= 0:
                return None
            units = max(units, math.ceil(sparse / room))
        elif dense > kind.memory_bytes:
            return None
        # every server adds to the step: more units than seconds * target may be needed
        while units <= kind.units and self.target * (units * request + seconds / units) > 1 + 1e-12:
            units += 1
        if units > kind.units:
            return None
        per_sample = units * request + seconds / units
        throughput = 1 / per_sample if per_sample > 0 else math.inf
        serial = (self._serial[resource][last + 1] - self._serial[resource][first]) / units
        return Stage(
            first, last, kind.name, kind.device, units, seconds, throughput, units * kind.price_per_hour, serial
        )

    def with_profile(self, profile: ModelProfile) -> CostModel:
        """This model (resources, target, training and parameter copies) pricing ``profile`` instead."""
        return CostModel(profile, self.resources, self.target, self.training_samples, self.parameter_copies)

    def plan(self, assignment: Sequence[int], solver: str = "") -> PlacementPlan | None:
        """The plan of a per-layer assignment of resource type indices, or None when it is infeasible."""
        if len(assignment) != self.num_layers:
            raise ValueError(f"an assignment needs one resource per layer ({self.num_layers}), got {len(assignment)}")
        stages, first = [], 0
        for index in range(1, self.num_layers + 1):
            if index == self.num_layers or assignment[index] != assignment[first]:
                stage = self.stage(first, index - 1, assignment[first])
                if stage is None:
                    return None
                stages.append(stage)
                first = index
        return self.plan_of_stages(stages, solver)

    def plan_of_stages(self, stages: Sequence[Stage], solver: str = "") -> PlacementPlan | None:
        """The plan made of ``stages`` (covering the layers in order), or None when units run out."""
        used: dict[str, int] = {}
        for stage in stages:
            used[stage.resource] = used.get(stage.resource, 0) + stage.units
        available = {r.name: r.units for r in self.resources}
        if any(units > available[name] for name, units in used.items()):
            return None
        per_hour = sum(stage.cost_per_hour for stage in stages)
        assignment = tuple(stage.resource for stage in stages for _ in range(stage.first, stage.last + 1))
        return PlacementPlan(
            layers=tuple(layer.name for layer in self.profile.layers),
            kinds=tuple(layer.kind for layer in self.profile.layers),
            assignment=assignment,
            stages=tuple(stages),
            throughput=min(stage.throughput for stage in stages),
            target_throughput=self.target,
            cost_per_hour=per_hour,
            training_cost=per_hour * self.training_samples / self.target / 3600,
            training_samples=self.training_samples,
            solver=solver,
            runner=self.runner,
        )


def _prefix(values: Sequence[float]) -> list[float]:
    sums = [0.0]
    for value in values:
        sums.append(sums[-1] + value)
    return sums
