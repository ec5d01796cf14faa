"""``dynamix plan`` and the offload, plan, placement and replan benches, run as a user runs them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.cli.commands import dynamix, dynamix_here, dynamix_with_pid

pytestmark = pytest.mark.distributed


def test_bench_offload_times_every_set_up_and_finds_the_tables_a_memory_budget_allows(tmp_path):
    out = tmp_path / "offload.json"
    dynamix(
        "bench", "offload", "--rounds", "1", "--steps", "2", "--warmup", "1", "--batch-size", "64", "--servers", "1",
        "--max-rows", "32768", "--memory-budget-mib", "4096", "--output", str(out),
        cwd=tmp_path,
    )  # fmt: skip
    result = json.loads(out.read_text())
    assert set(result["speed"]) == {"in-process"} | {
        f"{servers}{staleness}{pipelined}"
        for servers in ("1 server",)  # the set-ups of the servers asked for
        for staleness in ("", ", staleness 1")
        for pipelined in ("", ", not pipelined", ", before")
    }
    assert all(row["median_step_ms"] > 0 for row in result["speed"].values())
    assert set(result["memory"]) == {"in-process", "1 server"}
    for name in ("in-process", "1 server"):
        memory = result["memory"][name]
        assert memory["largest_rows_per_table"] == 32768  # both probed sizes fit 4 GiB
        assert [p["rows"] for p in memory["probes"]] == [16384, 32768]
        assert all(p["peak_mib"] > 0 for p in memory["probes"])
    error = dynamix_here("bench", "offload", "--servers", "3", "--skip-memory", cwd=tmp_path, fails=True)
    assert "`--servers` must list 1 and/or 2, got '3'" in error
    error = dynamix_here("bench", "offload", "--setups", "1 server", "--skip-memory", cwd=tmp_path, fails=True)
    assert "`--setups` must name in-process" in error


def test_bench_plan_runs_the_plan_with_the_strategy_and_sets_the_measured_throughput_beside_the_predictions(
    tmp_path,
):
    out = tmp_path / "plan.json"
    dynamix(
        "bench", "plan", "--servers", "2", "--rounds", "1", "--steps", "3", "--warmup", "1", "--batch-size", "64",
        "--repeats", "2", "--output", str(out), cwd=tmp_path,
    )  # fmt: skip
    result = json.loads(out.read_text())
    row = result["plans"]["2"]
    plan = row["plan"]
    # the tables on the 2 servers the catalogue makes the plan rent, the dense layers on the trainer
    tables = [layer for layer, kind in zip(plan["layers"], plan["kinds"]) if kind == "sparse"]
    assert len(tables) == 26
    assert [(s["resource"], s["units"]) for s in plan["stages"]] == [("embedding-server", 2), ("trainer", 1)]
    assert row["predicted_sequential_samples_per_s"] <= row["predicted_pipelined_samples_per_s"]
    assert row["measured_samples_per_s"] > 0
    assert row["measured_staleness_1_samples_per_s"] > 0
    assert plan["runner"] == result["runner"]  # the plan run is priced with the runner's terms measured here
    assert result["runner"]["step_seconds"] > 0
    assert row["requests_per_step"] == 2 + 2  # one lookup for all 26 tables and one push, per server


def test_bench_plan_with_the_servers_on_a_slow_link_prices_their_rows_at_its_rate_and_is_bound_by_it(
    tmp_path, hosts_available
):
    from lightning_dynamix.bench.hosts import MIN_BURST, leftovers

    out = tmp_path / "plan.json"
    _, pid = dynamix_with_pid(
        "bench", "plan", "--servers", "1", "--rounds", "1", "--steps", "2", "--warmup", "1", "--repeats", "2",
        "--links", "0,20", "--output", str(out), cwd=tmp_path,
    )  # fmt: skip
    result = json.loads(out.read_text())
    assert result["links_mbit_per_s"] == [None, 20.0]
    # the catalogue: the server's type at its host's 20 Mbit/s, the trainer's at the loopback's rate
    assert result["link_bytes_per_s"] == {"trainer": result["loopback_bytes_per_s"], "embedding-server": 2.5e6}
    row = result["plans"]["1"]
    servers = row["plan"]["stages"][0]
    rows = sum(result["runner"]["rows"].values())  # distinct rows a batch of 512 looks up, over 26 tables
    # the rows come back over the link before the gradients go (16 values of 4 bytes a row)
    assert servers["serial_seconds_per_sample"] == pytest.approx(rows * 64 / 2.5e6 / 512)
    # each step's rows cross the server's 20 Mbit/s link, less the token bucket's 4 KiB at once: a lower bound
    # the shaper sets, which a slower or busier machine only adds to
    step = 1 / row["measured_samples_per_s"] * 512
    assert step >= (rows * 64 - MIN_BURST) / 2.5e6
    assert leftovers(prefix=f"dx{pid}n") == []  # its hosts are gone (another test's may live beside)
    error = dynamix_here("bench", "plan", "--links", "0,20,20", cwd=tmp_path, fails=True)
    assert "--links (TRAINER,SERVER)" in error
    assert "gives 3 hosts a rate" in error


def test_bench_offload_with_the_server_on_a_slow_link_is_bound_by_it(tmp_path, hosts_available):
    import torch

    from lightning_dynamix.bench.hosts import MIN_BURST, leftovers
    from lightning_dynamix.data import CTRDataModule

    out = tmp_path / "offload.json"
    _, pid = dynamix_with_pid(
        "bench", "offload", "--rounds", "1", "--steps", "2", "--warmup", "1", "--servers", "1", "--skip-memory",
        "--setups", "in-process;1 server", "--links", "0,20", "--output", str(out), cwd=tmp_path,
    )  # fmt: skip
    result = json.loads(out.read_text())
    assert result["config"]["links"] == [None, 20.0]
    # the distinct rows of a batch of 512 (the bench's data), 16 values of 4 bytes each, come back from the
    # server over its 20 Mbit/s link at every step, less the token bucket's 4 KiB at once: a lower bound the
    # shaper sets (a fifth off for another batch's rows)
    data = CTRDataModule(num_samples=512 * 4, num_val_samples=1, batch_size=512)
    data.setup("fit")
    _, sparse, _ = next(iter(data.train_dataloader()))
    rows = sum(len(torch.unique(sparse[:, table])) for table in range(sparse.shape[1]))
    assert result["speed"]["1 server"]["median_step_ms"] / 1e3 >= (0.8 * rows * 64 - MIN_BURST) / 2.5e6
    assert set(result["speed"]) == {"in-process", "1 server"}  # the set-ups asked for, each run on the hosts
    assert leftovers(prefix=f"dx{pid}n") == []


def test_bench_placement_sets_rl_and_greedy_against_the_optimum_on_random_chains_and_the_dlrm_example(tmp_path):
    out = tmp_path / "placement.json"
    dynamix_here(
        "bench", "placement", "--problems", "3", "--max-layers", "6", "--samples", "2", "--search", "2",
        "--dp-layers", "10", "--dp-problems", "2", "--output", str(out), cwd=tmp_path,
    )  # fmt: skip
    result = json.loads(out.read_text())
    assert result["config"]["search"] == 2
    for solver in ("rl", "greedy"):
        row = result["against_exact"][solver]
        assert row["problems"] + result["against_exact"]["skipped_infeasible_problems"] == 3
        assert 0 <= row["within_1_percent"] <= row["within_5_percent"] <= 1
    dlrm = result["dlrm"]
    assert {row["profile"] for row in dlrm} == {"layers alone", "with the runner's terms"}
    assert [row["fraction_of_reach"] for row in dlrm] == [0.1, 0.25, 0.5, 0.75, 0.95] * 2
    for row in dlrm:  # no solver beats the exact optimum
        assert row["optimum_per_hour"] > 0
        assert float(row["rl_gap"]) >= -1e-9
        assert float(row["greedy_gap"]) >= -1e-9
    error = dynamix_here("bench", "placement", "--samples", "1", "--search", "3", cwd=tmp_path, fails=True)
    assert "--samples must be >= 0 (>= 2 with --search" in error


# a profile of the layers of PLAN_ARGS's model, measured once (2-core VM): a plan made from it never moves
SAVED_PROFILE = Path(__file__).parent / "data" / "dlrm_small_profile.json"
# the layers alone: what a step of the strategy pays beside them is measured in one test only
PLAN_ARGS = [
    "plan", "--model", "dlrm", "--resources", str(Path(__file__).parents[2] / "examples/placement/catalogue.yaml"),
    "--data-args", '{"num_samples": 1024, "table_sizes": [100, 2000, 30], "batch_size": 128}', "--no-runner",
    "--repeats", "2",
]  # fmt: skip


def test_plan_includes_what_a_step_of_the_strategy_pays_beside_the_layers_and_keeps_it_in_the_plan_file(tmp_path):
    from lightning_dynamix.placement import CostModel, ModelProfile, PlacementPlan, load_catalogue

    with_runner = [arg for arg in PLAN_ARGS if arg != "--no-runner"]
    saved, out = tmp_path / "profile.json", tmp_path / "plan.json"
    # a target any machine reaches: the profile is measured here, fresh
    output = dynamix(
        *with_runner, "--throughput", "1000", "--save-profile", str(saved), "--output", str(out), cwd=tmp_path
    )
    assert "runner, per step: loop and round trip" in output
    plan, profile = PlacementPlan.load(out), ModelProfile.load(saved)
    runner = profile.runner
    assert runner is not None
    assert plan.runner == runner.to_dict()  # the fixed terms, in the plan file
    assert runner.batch_size == 128
    assert set(runner.rows) == {"embeddings.0", "embeddings.1", "embeddings.2"}
    for term in ("step_seconds", "loader_seconds", "optimizer_seconds", "trainer_row_seconds"):
        assert plan.runner[term] > 0, term
    # a server's work per row is not asserted: it is the difference of two timings (its pass over the rows less its
    # pass per table), clamped at 0, which noise on a busy machine can make 0 (it is in the plan file, above)
    # how the measured terms compare (a step against a request's round trip) is this machine's noise: not asserted
    # a server's own work on its tables, timed apart, is part of what it adds to a step, and printed
    assert (
        0 < plan.runner["server_table_seconds"] <= plan.runner["request_seconds"] or not plan.runner["request_seconds"]
    )
    assert f"(its tables {1e3 * plan.runner['server_table_seconds']:.2f} ms)" in output
    # the same placement priced without them forecasts more than the strategy can do
    resources = load_catalogue(PLAN_ARGS[4])
    index = {r.name: i for i, r in enumerate(resources)}
    assignment = [index[name] for name in plan.assignment]
    bare = CostModel(profile.with_runner(None), resources, 1000.0).plan(assignment)
    priced = CostModel(profile, resources, 1000.0).plan(assignment)
    assert priced.sequential_throughput < bare.sequential_throughput
    assert plan.throughput >= 1000


def test_plan_prints_the_placement_beside_all_cpu_and_all_gpu_and_writes_a_plan_for_the_strategy(tmp_path):
    from lightning_dynamix.placement import PlacementPlan, load_catalogue

    # planned from a saved profile (tests/cli/data), so the placement and its margin are the same on every machine
    from_saved = [arg for arg in PLAN_ARGS if arg not in ("--repeats", "2")] + ["--profile", str(SAVED_PROFILE)]
    output = dynamix_here(*from_saved, "--throughput", "2000000", "--output", str(tmp_path / "plan.json"), cwd=tmp_path)
    assert "embeddings.1" in output
    assert "runner: not included" in output
    assert (
        "margin: a profile 2.1% slower gets another placement (cpu-highmem-16 x1 layers 0-1, gpu-a10g x1 layers 2-12);"
        " a profile up to 25% faster gets the same placement" in output
    )
    assert "within this profile's own spread (20.5%): profiled again, it may differ" in output
    assert "--save-profile and --profile" not in output  # it was planned from a saved one
    per_hour = {
        line.split()[0]: float(line.split()[1])
        for line in output.splitlines()
        if line.strip().startswith(("chosen", "all-cpu", "all-gpu"))
    }
    assert per_hour["chosen"] <= min(per_hour["all-cpu"], per_hour["all-gpu"])  # the optimum beats both
    plan = PlacementPlan.load(tmp_path / "plan.json")
    assert plan.cost_per_hour == pytest.approx(per_hour["chosen"], abs=1e-3)
    assert len(plan.layers) == len(plan.assignment) == len(plan.kinds)
    assert set(plan.assignment) <= {r.name for r in load_catalogue(PLAN_ARGS[4])}
    assert plan.throughput >= 2_000_000


def test_the_plan_s_margin_warns_where_an_edge_lies_within_the_profile_s_spread():
    from lightning_dynamix.cli.plan import _margin_line
    from lightning_dynamix.placement import CostModel, LayerProfile, ModelProfile, ResourceType

    # a unit makes 1,000 samples/s: 2,920 need 3 units, and a profile 2.7% slower a fourth
    layer = LayerProfile("dense", "dense", {"cpu": 1e-3}, 1000, 0, spread={"cpu": 0.05})
    unit = ResourceType("unit", "cpu", 1.0, 8, 2**30, 1e9, {"dense": 1.0, "sparse": 1.0})
    profile = ModelProfile((layer,), 10, {"cpu": 1e-3}, {"cpu": 0.02})
    line = _margin_line(CostModel(profile, [unit], 2920.0), profile, saved=False)
    assert "2.7% slower gets another placement (unit x4 layers 0-0); a profile up to 25% faster gets the" in line
    assert "within this profile's own spread (5.0%): profiled again, it may differ; --save-profile" in line
    assert "--save-profile" not in _margin_line(CostModel(profile, [unit], 2920.0), profile, saved=True)
    # 2,500 need 3 units up to 20% slower, 2 from 20% faster: both edges beyond the spread, no warning
    assert "spread" not in _margin_line(CostModel(profile, [unit], 2500.0), profile, saved=False)


def test_plan_says_where_the_default_strategy_runs_the_stages_below_the_target():
    from lightning_dynamix.cli.plan import _one_after_another_line
    from lightning_dynamix.placement import CostModel, LayerProfile, ModelProfile, ResourceType

    # a table on a server type, the dense layer on a trainer type: each stage makes 1,000 samples/s, so
    # the pipeline meets 1,000 and the stages one after another 500
    table = LayerProfile("table", "sparse", {"cpu": 1e-3}, 2**20, 0)
    dense = LayerProfile("dense", "dense", {"cpu": 1e-3}, 1000, 0)
    server = ResourceType("server", "cpu", 1.0, 1, 2**30, 1e9, {"dense": 1.0, "sparse": 1.0})
    trainer = ResourceType("trainer", "cpu", 1.0, 1, 2**30, 1e9, {"dense": 1.0, "sparse": 1.0})
    plan = CostModel(ModelProfile((table, dense), 1, {}), [server, trainer], 1000.0).plan([0, 1])
    assert (plan.throughput, plan.sequential_throughput) == pytest.approx((1000, 500))
    line = _one_after_another_line(plan)
    assert "met with the 2 stages overlapped (1000 samples/s)" in line
    assert "staleness=0, its default, runs them one after another: 500 samples/s" in line


def test_a_saved_profile_plans_the_same_placement_again_and_another_model_s_is_refused(tmp_path):
    from lightning_dynamix.placement import ModelProfile, PlacementPlan

    saved, first, again = tmp_path / "profile.json", tmp_path / "first.json", tmp_path / "again.json"
    printed = dynamix_here(
        *PLAN_ARGS, "--throughput", "2000000", "--save-profile", str(saved), "--output", str(first), cwd=tmp_path
    )
    assert "layers' spread" in printed  # how far the timings can be trusted
    profile = ModelProfile.load(saved)
    assert [layer.name for layer in profile.layers][:3] == ["embeddings.0", "embeddings.1", "embeddings.2"]
    assert all(set(layer.spread) == {"cpu"} for layer in profile.layers)
    without_repeats = PLAN_ARGS[:-2]
    printed = dynamix_here(
        *without_repeats, "--throughput", "2000000", "--profile", str(saved), "--output", str(again), cwd=tmp_path
    )
    assert f"read from {saved}" in printed
    a, b = PlacementPlan.load(first), PlacementPlan.load(again)
    assert (a.assignment, a.cost_per_hour, a.throughput) == (b.assignment, b.cost_per_hour, b.throughput)
    # the solvers compared on the one profile: the RL scheduler with its active search
    rl = tmp_path / "rl.json"
    args = [*without_repeats, "--throughput", "2000000", "--profile", str(saved), "--solver", "rl"]
    dynamix_here(*args, "--rl-search", "2", "--output", str(rl), cwd=tmp_path)
    assert PlacementPlan.load(rl).solver == "rl"
    assert PlacementPlan.load(rl).cost_per_hour >= a.cost_per_hour * (1 - 1e-9)  # never below the optimum
    error = dynamix_here(*args, "--rl-search", "-1", cwd=tmp_path, fails=True)
    assert "--rl-search must be >= 0 (0: the policy alone), got -1" in error
    # a profile of another model (two tables instead of three), or one timed anew, is refused
    other = [*without_repeats]
    other[other.index("--data-args") + 1] = '{"num_samples": 1024, "table_sizes": [100, 2000], "batch_size": 128}'
    error = dynamix_here(*other, "--throughput", "2000000", "--profile", str(saved), cwd=tmp_path, fails=True)
    assert f"--profile {saved} is of another model" in error
    error = dynamix_here(*PLAN_ARGS, "--throughput", "2000000", "--profile", str(saved), cwd=tmp_path, fails=True)
    assert "--repeats 2 times a new profile" in error
    assert ModelProfile.load(saved).runner is None  # --no-runner
    (tmp_path / "broken.json").write_text('{"layers": []')
    error = dynamix_here(
        *without_repeats, "--throughput", "1", "--profile", str(tmp_path / "broken.json"), cwd=tmp_path, fails=True
    )
    assert "is not a profile written by --save-profile" in error


def test_bench_replan_counts_the_placements_fresh_profiles_choose(tmp_path):
    out = tmp_path / "replan.json"
    dynamix(
        "bench", "replan", "--runs", "2", "--no-runner", "--throughput", "100000,3e5", "--output", str(out),
        cwd=tmp_path,
    )  # fmt: skip
    result = json.loads(out.read_text())
    assert len(result["profiles"]) == 2
    for target in ("100000", "300000"):
        row = result["targets"][target]
        assert sum(placement["runs"] for placement in row["placements"]) == 2
        assert row["distinct_placements"] == len(row["placements"])
        assert len(row["margins"]) == 2  # per run, how far its profile may be off before its placement changes
        assert all(m is None or 0 <= m <= 0.25 for margin in row["margins"] for m in margin.values())
    assert "--throughput must be positive" in dynamix_here(
        "bench", "replan", "--throughput", "-5", cwd=tmp_path, fails=True
    )


def test_plan_says_the_best_reachable_throughput_when_the_target_is_out_of_reach(tmp_path):
    error = dynamix_here(*PLAN_ARGS, "--throughput", "1e12", cwd=tmp_path, fails=True)
    assert "no placement reaches 1e+12 samples/s with these resources; the best reachable is" in error
