"""Solvers for the cheapest placement of a layer chain: exact (dynamic programming), brute force, greedy.

All three price placements with the same :class:`~lightning_dynamix.placement.cost.CostModel`.

* :func:`solve_dp` is exact. A dynamic programme over the layer boundaries finds, for every prefix
  of the chain and every type of its last stage, the cheapest placement. Two neighbouring stages
  are always of different types, because equal neighbours would be one stage. When the relaxed
  optimum, which counts each stage's units against its type alone, needs more units of a type than
  there are, a second programme keeps every placement whose unit counts are not dominated, so
  the answer stays exact.
* :func:`solve_brute_force` tries every assignment. It is for small chains and for tests.
* :func:`solve_greedy` is the baseline: every layer goes to the type where it alone costs least per
  sample.

Each raises :class:`~lightning_dynamix.placement.cost.InfeasibleError`, saying the best throughput
that can be reached, when no placement meets the target.

Placements of equal cost are told apart by their throughput, the highest kept: it leaves the most room
for the timings to be off, and it does not move with the noise of a profile the way the first feasible
one of a row of equal placements does (which cut between two stages of equal cost still meets the
target depends on a few percent either way).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from lightning_dynamix._checks import require_number
from lightning_dynamix.placement.cost import CostModel, InfeasibleError, PlacementPlan, Stage

MARGIN_LIMIT = 0.25  # how far placement_margin looks, either way
_MARGIN_STEP = 0.005  # its scan's step; the step where the placement changed is then bisected 6 times


def solve_dp(model: CostModel) -> PlacementPlan:
    """The cheapest feasible placement, exactly."""
    plan = _relaxed_dp(model)
    if plan is None:
        plan = _pareto_dp(model)
    if plan is None:
        raise _infeasible(model)
    return plan


@dataclass(frozen=True)
class Margin:
    """How far a profile's times may move before :func:`solve_dp` places the layers otherwise.

    Attributes:
        slower: the fraction by which every time of the profile may grow before the cheapest placement
            changes (0.04: a profile 4% slower gets another); None where it holds up to ``limit``.
        faster: the same, every time shrinking.
        slower_plan, faster_plan: the placement just beyond each edge; None where there is no edge within
            ``limit``, or where no placement is feasible beyond it.
        limit: how far either way was looked.
    """

    slower: float | None
    faster: float | None
    slower_plan: PlacementPlan | None
    faster_plan: PlacementPlan | None
    limit: float


def placement_margin(model: CostModel, limit: float = MARGIN_LIMIT) -> Margin:
    """How far every time of ``model``'s profile may move, slower or faster, before :func:`solve_dp`
    chooses another placement (another type, unit count or stage end, or none feasible).

    A profile measured again reads somewhat other times. Where a margin is smaller than that difference,
    the same command can plan otherwise: the target lies at an edge, such as where one unit more is
    needed. The profile's times are scaled in steps of 0.5% up to ``limit`` either way and the step where
    the placement changed is bisected, so an edge is found to about 0.01%; a change that is undone
    within one step can be missed. Each step solves the problem once (7 ms for the DLRM example).

    Raises:
        InfeasibleError: where no placement meets the target with the profile as it is.
        ValueError: for a ``limit`` outside (0, 1).
    """
    limit = require_number("limit", limit, 0.0, 1.0, low_open=True)
    base, _ = _scaled_placement(model, 1.0)
    if base is None:
        raise _infeasible(model)
    slower, slower_plan = _edge(model, base, 1.0, limit)
    faster, faster_plan = _edge(model, base, -1.0, limit)
    return Margin(slower, faster, slower_plan, faster_plan, limit)


def _edge(model: CostModel, base: tuple, sign: float, limit: float) -> tuple[float | None, PlacementPlan | None]:
    held = 0.0
    for step in range(1, math.ceil(limit / _MARGIN_STEP - 1e-9) + 1):
        moved = min(step * _MARGIN_STEP, limit)
        key, plan = _scaled_placement(model, 1.0 + sign * moved)
        if key == base:
            held = moved
            continue
        for _ in range(6):
            middle = (held + moved) / 2
            key, middle_plan = _scaled_placement(model, 1.0 + sign * middle)
            if key == base:
                held = middle
            else:
                moved, plan = middle, middle_plan
        return moved, plan
    return None, None


def _scaled_placement(model: CostModel, factor: float) -> tuple[tuple | None, PlacementPlan | None]:
    try:
        plan = solve_dp(model.with_profile(model.profile.scaled(factor)))
    except InfeasibleError:
        return None, None
    return tuple((stage.resource, stage.units, stage.first, stage.last) for stage in plan.stages), plan


def solve_brute_force(model: CostModel, max_assignments: int = 2_000_000) -> PlacementPlan:
    """The cheapest feasible placement, by trying every assignment (``types ** layers`` of them)."""
    count = len(model.resources) ** model.num_layers
    if count > max_assignments:
        raise ValueError(
            f"brute force would try {count} assignments (more than max_assignments={max_assignments}); use solve_dp"
        )
    assignments = itertools.product(range(len(model.resources)), repeat=model.num_layers)
    return cheapest_feasible(model, assignments, solver="brute-force")


def cheapest_feasible(model: CostModel, assignments: Iterable[Sequence[int]], solver: str) -> PlacementPlan:
    """The cheapest feasible plan among ``assignments`` (resource indices per layer).

    Raises:
        InfeasibleError: when none is feasible, with the best reachable throughput.
    """
    best: PlacementPlan | None = None
    for assignment in assignments:
        plan = model.plan(assignment, solver=solver)
        if plan is not None and (best is None or _plan_rank(plan) < _plan_rank(best)):
            best = plan
    if best is None:
        raise _infeasible(model)
    return best


def solve_greedy(model: CostModel) -> PlacementPlan:
    """Every layer on the type where it alone costs least per sample (price times its seconds)."""
    assignment = []
    for layer in range(model.num_layers):
        costs = []
        for index, resource in enumerate(model.resources):
            stage = model.stage(layer, layer, index)
            per_sample = math.inf if stage is None else resource.price_per_hour * stage.seconds_per_sample
            costs.append(per_sample)
        assignment.append(min(range(len(costs)), key=costs.__getitem__))
    plan = model.plan(assignment, solver="greedy")
    if plan is None:
        raise InfeasibleError(
            "the greedy placement (each layer on its cheapest type) is infeasible for this target;"
            f" the exact solver may still find one. {_infeasible(model)}"
        )
    return plan


def best_throughput(model: CostModel, iterations: int = 40) -> float:
    """The highest target some placement meets (samples/s; 0 when none fits in memory at any speed)."""
    fast = min(
        max(r.units / max(model.stage_seconds(layer, layer, k), 1e-30) for k, r in enumerate(model.resources))
        for layer in range(model.num_layers)
    )
    low, high = 0.0, fast * 1.000001
    for _ in range(iterations):
        middle = (low + high) / 2
        trial = model.with_target(middle)
        if _relaxed_dp(trial) is not None or _pareto_dp(trial) is not None:
            low = middle
        else:
            high = middle
    return low


def _infeasible(model: CostModel) -> InfeasibleError:
    best = best_throughput(model)
    if best <= 0:
        return InfeasibleError(
            "no placement fits: some layers' parameters do not fit the memory of any resource type that"
            " could hold them with the units available"
        )
    return InfeasibleError(
        f"no placement reaches {model.target:g} samples/s with these resources; the best reachable is"
        f" {best:.4g} samples/s"
    )


def _relaxed_dp(model: CostModel) -> PlacementPlan | None:
    n, types = model.num_layers, len(model.resources)
    inf = math.inf
    # best[j][k]: cheapest placement of layers 0..j whose last stage, on type k, ends at j, as
    # (cost, -throughput): of equal costs the fastest
    best = [[(inf, 0.0)] * types for _ in range(n)]
    back: list[list[tuple[int, Stage] | None]] = [[None] * types for _ in range(n)]
    for j in range(n):
        for k in range(types):
            for i in range(j + 1):
                stage = model.stage(i, j, k)
                if stage is None:
                    continue
                if i == 0:
                    before, previous = (0.0, -inf), -1
                else:
                    before, previous = (inf, 0.0), -1
                    for kk in range(types):
                        if kk != k and best[i - 1][kk] < before:
                            before, previous = best[i - 1][kk], kk
                    if previous < 0:
                        continue
                total = _rank(before[0] + stage.cost_per_hour, min(-before[1], stage.throughput))
                if total < best[j][k]:
                    best[j][k] = total
                    back[j][k] = (previous, stage)
    last = min(range(types), key=lambda k: best[n - 1][k])
    if best[n - 1][last][0] == inf:
        return None
    stages, j, k = [], n - 1, last
    while j >= 0:
        entry = back[j][k]
        assert entry is not None
        previous, stage = entry
        stages.append(stage)
        j, k = stage.first - 1, previous
    return model.plan_of_stages(stages[::-1], solver="dp")


def completions(model: CostModel) -> list[list[tuple[float, float]]]:
    """The relaxed programme run from the end of the chain: ``go[i][k]`` ranks (cost per hour, minus the
    throughput) the cheapest placement of layers ``i..`` whose first stage, on type ``k``, starts at
    ``i``; ``go[n]`` is the empty rest. Every placement that continues a given start is priced with it
    (:func:`best_actions`), as the relaxed optimum is: each stage's units against its type alone."""
    n, types = model.num_layers, len(model.resources)
    go = [[(math.inf, 0.0)] * types for _ in range(n)] + [[(0.0, -math.inf)] * types]
    for i in reversed(range(n)):
        for k in range(types):
            for j in range(i, n):
                stage = model.stage(i, j, k)
                rest = _after(go, j + 1, k)
                if stage is not None and rest[0] < math.inf:
                    go[i][k] = min(go[i][k], _rank(stage.cost_per_hour + rest[0], min(stage.throughput, -rest[1])))
    return go


def best_actions(model: CostModel, assignment: Sequence[int], go: list[list[tuple[float, float]]]) -> list[int]:
    """The types for layer ``len(assignment)`` that the cheapest completion of ``assignment`` (resource
    indices of the layers before it) starts with, given ``go = completions(model)``: every type within
    a billionth of the cheapest cost (no tie-break: any of them is as cheap); empty when no completion
    is feasible."""
    m, types = len(assignment), len(model.resources)
    if m == 0:
        costs = [go[0][k][0] for k in range(types)]
    else:
        previous, start = assignment[-1], m - 1
        while start > 0 and assignment[start - 1] == previous:
            start -= 1
        costs = []
        for k in range(types):
            if k == previous:  # the open stage goes on, to some later end
                ends = [(model.stage(start, j, k), _after(go, j + 1, k)[0]) for j in range(m, model.num_layers)]
            else:  # it ends here, and a stage on k starts
                ends = [(model.stage(start, m - 1, previous), go[m][k][0])]
            costs.append(min((s.cost_per_hour + rest for s, rest in ends if s is not None), default=math.inf))
    best = min(costs)
    if best == math.inf:
        return []
    return [k for k, cost in enumerate(costs) if cost <= best + 1e-9 * max(abs(best), 1.0)]


def _after(go: list[list[tuple[float, float]]], i: int, k: int) -> tuple[float, float]:
    """The best rest from layer ``i`` on whose first stage is not on type ``k`` (the empty rest at the end)."""
    if i == len(go) - 1:
        return go[i][0]
    return min(go[i][kk] for kk in range(len(go[i])) if kk != k) if len(go[i]) > 1 else (math.inf, 0.0)


def _pareto_dp(model: CostModel) -> PlacementPlan | None:
    n, types = model.num_layers, len(model.resources)
    available = [r.units for r in model.resources]
    # front[j][k]: non-dominated (cost, units per type, stages) of placements of 0..j ending on type k at j
    front: list[list[list[tuple[float, tuple[int, ...], tuple[Stage, ...]]]]] = [
        [[] for _ in range(types)] for _ in range(n)
    ]
    for j in range(n):
        for k in range(types):
            candidates = []
            for i in range(j + 1):
                stage = model.stage(i, j, k)
                if stage is None:
                    continue
                starts = [(0.0, (0,) * types, ())] if i == 0 else [
                    entry for kk in range(types) if kk != k for entry in front[i - 1][kk]
                ]  # fmt: skip
                for cost, used, stages in starts:
                    units = tuple(u + (stage.units if t == k else 0) for t, u in enumerate(used))
                    if units[k] <= available[k]:
                        candidates.append((cost + stage.cost_per_hour, units, (*stages, stage)))
            front[j][k] = _non_dominated(candidates)
    finals = [entry for k in range(types) for entry in front[n - 1][k]]
    if not finals:
        return None
    return model.plan_of_stages(min(finals, key=_entry_rank)[2], solver="dp")


def _plan_rank(plan: PlacementPlan) -> tuple[float, float]:
    return _rank(plan.cost_per_hour, plan.throughput)


def _entry_rank(entry: tuple[float, tuple[int, ...], tuple[Stage, ...]]) -> tuple[float, float]:
    return _rank(entry[0], min(stage.throughput for stage in entry[2]))


def _rank(cost_per_hour: float, throughput: float) -> tuple[float, float]:
    """How placements are ordered: by cost (to a billionth, so that sums in another order tie), then the
    fastest first."""
    return (round(cost_per_hour, 9), -throughput)


def _non_dominated(
    candidates: list[tuple[float, tuple[int, ...], tuple[Stage, ...]]],
) -> list[tuple[float, tuple[int, ...], tuple[Stage, ...]]]:
    kept: list[tuple[float, tuple[int, ...], tuple[Stage, ...]]] = []
    for candidate in sorted(candidates, key=lambda e: (_entry_rank(e), e[1])):
        if not any(all(a <= b for a, b in zip(other[1], candidate[1])) for other in kept):
            kept.append(candidate)  # cheaper (or as cheap and faster) came first: kept only if it saves units
    return kept
