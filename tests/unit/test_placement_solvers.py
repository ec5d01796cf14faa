"""The placement cost model and its solvers: the exact one equals brute force, plans round-trip."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from lightning_dynamix.placement import (
    CostModel,
    InfeasibleError,
    LayerProfile,
    ModelProfile,
    PlacementPlan,
    ResourceType,
    RunnerProfile,
    placement_margin,
    solve_brute_force,
    solve_dp,
    solve_greedy,
)
from lightning_dynamix.placement.random_chains import random_catalogue, random_chain
from lightning_dynamix.placement.solvers import _pareto_dp, _relaxed_dp, best_actions, completions

GIB = 2**30


@pytest.mark.parametrize("seed", range(40))
def test_dynamic_programming_equals_brute_force_on_random_chains(seed):
    rng = random.Random(seed)
    layers, types = rng.randint(1, 7), rng.randint(1, 3)
    scarce = seed % 3 == 0  # units that run out: stages of one type compete for them
    model = CostModel(random_chain(rng, layers), random_catalogue(rng, types, scarce), rng.uniform(50, 5000), 10**6)
    try:
        expected = solve_brute_force(model)
    except InfeasibleError:
        with pytest.raises(InfeasibleError):
            solve_dp(model)
        return
    found = solve_dp(model)
    assert found.cost_per_hour == pytest.approx(expected.cost_per_hour, rel=1e-9)
    assert found.throughput >= model.target * (1 - 1e-9)
    assert model.plan([model.resources.index(_by_name(model, r)) for r in found.assignment]) is not None


def _by_name(model: CostModel, name: str) -> ResourceType:
    return next(r for r in model.resources if r.name == name)


def test_scarce_units_make_the_relaxed_optimum_infeasible_and_dp_still_exact():
    # found by scanning seeds: a case where the cheapest per-stage plan uses one type twice beyond its units
    hits = 0
    for seed in range(300):
        rng = random.Random(1000 + seed)
        model = CostModel(random_chain(rng, 6), random_catalogue(rng, 2, scarce=True), rng.uniform(500, 5000), 10**6)
        if _relaxed_dp(model) is None:
            try:
                expected = solve_brute_force(model)
            except InfeasibleError:
                continue
            hits += 1
            assert solve_dp(model).cost_per_hour == pytest.approx(expected.cost_per_hour, rel=1e-9)
    assert hits > 0  # the exact fallback was exercised


def test_greedy_is_never_cheaper_than_the_optimum():
    for seed in range(30):
        rng = random.Random(seed)
        model = CostModel(random_chain(rng, 6), random_catalogue(rng, 3), rng.uniform(50, 2000), 10**6)
        try:
            greedy = solve_greedy(model)
        except InfeasibleError:
            continue
        assert greedy.cost_per_hour >= solve_dp(model).cost_per_hour * (1 - 1e-9)


def test_an_unreachable_target_says_the_best_reachable_throughput():
    profile = ModelProfile(
        (LayerProfile("only", "dense", {"cpu": 0.01}, 1000, 4),), batch_size=1, step_seconds={}
    )  # fmt: skip
    cpu = ResourceType("cpu", "cpu", 1.0, 4, GIB, 1e9, {"dense": 1.0, "sparse": 1.0})
    with pytest.raises(InfeasibleError, match=r"no placement reaches 1000 samples/s .* the best reachable is 400"):
        solve_dp(CostModel(profile, [cpu], 1000))
    plan = solve_dp(CostModel(profile, [cpu], 250, training_samples=3_600_000))
    assert plan.stages[0].units == 3  # 250 samples/s at 100 per unit
    assert plan.cost_per_hour == 3.0
    assert plan.training_cost == pytest.approx(3.0 * 3_600_000 / 250 / 3600)


def test_a_table_larger_than_every_unit_is_sharded_over_enough_units():
    table = LayerProfile("table", "sparse", {"cpu": 1e-6}, 10 * GIB, 64)
    cpu = ResourceType("cpu", "cpu", 1.0, 16, 8 * GIB, 1e9, {"dense": 1.0, "sparse": 1.0})
    plan = solve_dp(CostModel(ModelProfile((table,), 1, {}), [cpu], 1.0))
    assert plan.stages[0].units == 4  # 3 copies of 10 GiB over 8 GiB units


def test_a_pipeline_runs_at_its_slowest_stage_and_stage_after_stage_at_the_sum_of_their_times():
    table = LayerProfile("table", "sparse", {"cpu": 0.002}, GIB, 0)  # no activation: no transfer time
    dense = LayerProfile("dense", "dense", {"cpu": 0.006}, 1000, 4)
    server = ResourceType("server", "cpu", 1.0, 4, 16 * GIB, 1e9, {"dense": 1.0, "sparse": 1.0})
    trainer = ResourceType("trainer", "cpu", 2.0, 4, GIB, 1e9, {"dense": 1.0, "sparse": 1.0})
    plan = CostModel(ModelProfile((table, dense), 1, {}), [server, trainer], 300.0).plan([0, 1])
    assert [(s.resource, s.units) for s in plan.stages] == [("server", 1), ("trainer", 2)]
    assert plan.throughput == pytest.approx(2 / 0.006)  # 333: the trainers' stage is the slower (the server's: 500)
    assert plan.sequential_throughput == pytest.approx(1 / (0.002 / 1 + 0.006 / 2))  # 200: a lookup, then the rest
    assert plan.sequential_throughput < plan.throughput


def test_a_served_tables_rows_and_their_gradients_cross_the_servers_link():
    # 20 distinct rows per batch of 10, rows of 64 bytes: each goes out, its gradient comes back, its id both ways
    runner = RunnerProfile(10, 0.004, 0.002, 0.001, {"table": 20.0}, 1e-4, 4e-4, 0.003, 0.002)
    table = LayerProfile("table", "sparse", {"cpu": 0.002}, GIB, 64)
    dense = LayerProfile("dense", "dense", {"cpu": 0.006}, 1000, 4)
    profile = ModelProfile((table, dense), 10, {"cpu": 0.009}, runner=runner)
    trainer = ResourceType("trainer", "cpu", 2.0, 4, GIB, 1e9, {"dense": 1.0, "sparse": 1.0})

    def tables(link: float) -> PlacementPlan:
        server = ResourceType("server", "cpu", 1.0, 4, 16 * GIB, link, {"dense": 1.0, "sparse": 1.0})
        return CostModel(profile, [server, trainer], 1.0).plan([0, 1])

    slow, fast = tables(1e5), tables(1e9)
    # the link carries both ways at once: a pipeline pays the busier, the gradients and the ids to the server
    # (20 * (64 + 16) bytes a batch of 10): at 100 kB/s against 1 GB/s, 1.6 ms a sample more
    busier = 20 * 80 * (1 / 1e5 - 1 / 1e9) / 10
    assert slow.stages[0].seconds_per_sample - fast.stages[0].seconds_per_sample == pytest.approx(busier)
    # stage after stage a step waits for the rows (20 * 64 bytes), then for their gradients
    assert slow.stages[0].serial_seconds_per_sample == pytest.approx(20 * 64 / 1e5 / 10)
    assert 1 / slow.sequential_throughput - 1 / fast.sequential_throughput == pytest.approx(
        busier + 20 * 64 * (1 / 1e5 - 1 / 1e9) / 10
    )
    assert slow.stages[1] == fast.stages[1]  # the trainers' stage: no activations cross from a server stage


def test_the_runner_s_terms_are_charged_where_the_strategy_pays_them_and_kept_in_the_plan_file(tmp_path):
    # batch 10; a step pays 4 ms of loop, 2 ms reading the batch, 1 ms of optimiser, 3 ms per server (2 ms
    # of it the server's work on its tables); the table's 20 rows per batch cost 100 us each on the trainer
    # and 400 us on a server
    runner = RunnerProfile(10, 0.004, 0.002, 0.001, {"table": 20.0}, 1e-4, 4e-4, 0.003, 0.002)
    table = LayerProfile("table", "sparse", {"cpu": 0.002}, GIB, 0)
    dense = LayerProfile("dense", "dense", {"cpu": 0.006}, 1000, 4)
    profile = ModelProfile((table, dense), 10, {"cpu": 0.009}, runner=runner)  # 1 ms of the pass is in no layer
    server = ResourceType("server", "cpu", 1.0, 4, 16 * GIB, 1e9, {"dense": 1.0, "sparse": 2.0})
    trainer = ResourceType("trainer", "cpu", 2.0, 4, GIB, 1e9, {"dense": 1.0, "sparse": 1.0})
    plan = CostModel(profile, [server, trainer], 50.0).plan([0, 1])
    tables, dense_stage = plan.stages
    # the server stage: its layer (at speed 2), each row's trainer and server work (at speed 2), a request per
    # unit: 1 ms of round trip and 2 ms of work on its tables at speed 2
    # and the rows' ids over its 1 GB/s link (the table has no activation: no row bytes)
    rows = 0.002 / 2 + 20 * (1e-4 + 4e-4 / 2 + 16 / 1e9) / 10
    assert tables.seconds_per_sample == pytest.approx(rows)  # 1.6 ms
    assert tables.throughput == pytest.approx(1 / (tables.units * (0.001 + 0.002 / 2) / 10 + rows / tables.units))
    # the trainers: their layer, the unattributed 1 ms, and the step's fixed terms less the empty step's server
    assert dense_stage.seconds_per_sample == pytest.approx(0.006 + 0.001 + (0.004 + 0.002 + 0.001 - 0.003) / 10)
    bare = CostModel(profile.with_runner(None), [server, trainer], 50.0).plan([0, 1])
    assert plan.sequential_throughput < bare.sequential_throughput  # the runner's terms cost time
    assert plan.runner == runner.to_dict()
    assert bare.runner is None
    plan.save(tmp_path / "plan.json")  # the fixed terms are in the plan file
    assert PlacementPlan.load(tmp_path / "plan.json").runner["step_seconds"] == 0.004
    with pytest.raises(ValueError, match="measured at batch size 10, the layers at 1"):
        ModelProfile((table, dense), 1, {}).with_runner(runner)


def test_the_margin_says_how_far_a_profile_may_be_off_before_the_cheapest_placement_changes():
    # a step of 10 samples pays 5 ms of runner (loop, batch, optimiser) and 5 ms of the dense layer: a unit
    # makes 1,000 samples/s. 2,900 samples/s need 3 units; a profile 3.45% slower needs a fourth (3,000 / 2,900),
    # and 2 units would do only on one 31% faster, beyond the 25% looked at
    runner = RunnerProfile(10, 0.004, 0.0005, 0.0005)
    profile = ModelProfile((LayerProfile("dense", "dense", {"cpu": 0.0005}, 1000, 0),), 10, {"cpu": 0.0005}, {}, runner)
    unit = ResourceType("unit", "cpu", 1.0, 8, GIB, 1e9, {"dense": 1.0, "sparse": 1.0})
    margin = placement_margin(CostModel(profile, [unit], 2900.0))
    assert solve_dp(CostModel(profile, [unit], 2900.0)).stages[0].units == 3
    assert margin.slower == pytest.approx(3000 / 2900 - 1, abs=1e-4)  # the runner's terms scale with the layers
    assert margin.slower_plan is not None
    assert margin.slower_plan.stages[0].units == 4
    assert (margin.faster, margin.faster_plan, margin.limit) == (None, None, 0.25)
    margin = placement_margin(CostModel(profile, [unit], 2100.0))  # 3 units, and 2 on a profile 4.8% faster
    assert margin.faster == pytest.approx(1 - 2000 / 2100, abs=1e-4)
    assert margin.faster_plan is not None
    assert margin.faster_plan.stages[0].units == 2
    assert margin.slower is None  # 3 units hold up to 43% slower
    margin = placement_margin(CostModel(profile, [unit], 7900.0))  # 8 units, all there are: slower, none is feasible
    assert margin.slower == pytest.approx(8000 / 7900 - 1, abs=1e-4)
    assert margin.slower_plan is None
    with pytest.raises(InfeasibleError):
        placement_margin(CostModel(profile, [unit], 9000.0))
    with pytest.raises(ValueError, match="`limit` must be"):
        placement_margin(CostModel(profile, [unit], 2900.0), limit=0)
    slower = profile.scaled(2.0)  # as a machine twice as slow would measure it: the times, not the bytes
    assert (slower.layers[0].seconds, slower.step_seconds) == ({"cpu": 0.001}, {"cpu": 0.001})
    assert slower.runner is not None
    assert slower.runner.fixed_seconds == pytest.approx(2 * runner.fixed_seconds)
    assert (slower.layers[0].parameter_bytes, slower.batch_size) == (1000, 10)
    with pytest.raises(ValueError, match="`factor` must be"):
        profile.scaled(0.0)


def test_of_placements_that_cost_the_same_the_fastest_is_chosen_whatever_the_solver():
    # four equal layers over two one-unit types of one price: cutting after layer 1, 2 or 3 costs the same
    # and meets 300 samples/s; the even cut runs at 500, the others at 333. Which uneven cut a noisy
    # profile still allows changes from run to run; the even one holds.
    layers = tuple(LayerProfile(f"layer{i}", "dense", {"cpu": 1e-3}, 1000, 0) for i in range(4))
    a = ResourceType("a", "cpu", 1.0, 1, GIB, 1e9, {"dense": 1.0, "sparse": 1.0})
    b = ResourceType("b", "cpu", 1.0, 1, GIB, 1e9, {"dense": 1.0, "sparse": 1.0})
    model = CostModel(ModelProfile(layers, 1, {}), [a, b], 300.0)
    for plan in (solve_dp(model), solve_brute_force(model), _pareto_dp(model)):  # the last: the scarce-units path
        assert plan.cost_per_hour == 2.0
        assert plan.assignment in (("a", "a", "b", "b"), ("b", "b", "a", "a"))
        assert plan.throughput == pytest.approx(500)


@pytest.mark.parametrize("suffix", [".json", ".yaml"])
def test_a_plan_round_trips_through_a_file(tmp_path, suffix):
    rng = random.Random(3)
    plan = solve_dp(CostModel(random_chain(rng, 5), random_catalogue(rng, 2), 100.0, 10**6))
    plan.save(tmp_path / f"plan{suffix}")
    assert PlacementPlan.load(tmp_path / f"plan{suffix}") == plan


def test_bad_cost_model_arguments_are_refused():
    rng = random.Random(0)
    profile, resources = random_chain(rng, 3), random_catalogue(rng, 2)
    with pytest.raises(ValueError, match="`target_throughput` must be"):
        CostModel(profile, resources, 0)
    with pytest.raises(ValueError, match="`training_samples` must be an int >= 1"):
        CostModel(profile, resources, 10, training_samples=0)
    with pytest.raises(ValueError, match="`resources` is empty"):
        CostModel(profile, [], 10)
    cuda_only = ModelProfile((LayerProfile("x", "dense", {"cuda": 1e-3}, 1, 1),), 1, {})
    with pytest.raises(ValueError, match="the profile has no time for cpu"):
        CostModel(cuda_only, resources, 10)


@pytest.mark.parametrize("seed", range(12))
def test_the_best_next_types_start_the_cheapest_completion_of_any_placement_so_far(seed):
    # what the RL scheduler imitates (DAgger): from any prefix, even a bad one, the types to go on with
    rng = random.Random(seed)
    model = CostModel(random_chain(rng, rng.randint(2, 6)), random_catalogue(rng, rng.randint(2, 3)), 800.0, 10**6)
    n, types = model.num_layers, len(model.resources)
    costs = {}
    for assignment in itertools.product(range(types), repeat=n):
        plan = model.plan(assignment)
        costs[assignment] = math.inf if plan is None else plan.cost_per_hour
    go = completions(model)
    for length in range(n):
        for prefix in itertools.product(range(types), repeat=length):
            ahead = [min(c for a, c in costs.items() if a[: length + 1] == (*prefix, k)) for k in range(types)]
            best = min(ahead)
            expected = [] if best == math.inf else [k for k in range(types) if ahead[k] <= best * (1 + 1e-9)]
            assert best_actions(model, prefix, go) == expected, (prefix, ahead)
