"""The ``dynamix`` command, run as a user runs it (the examples run in tests/docs, as the docs write them)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.distributed


def run(args: list[str], cwd: Path, timeout: float = 300) -> str:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    for name in ("LOCAL_RANK", "NODE_RANK", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK"):
        env.pop(name, None)
    proc = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-6000:]
    return output


def dynamix(*args: str, cwd: Path) -> str:
    return run([sys.executable, "-m", "lightning_dynamix.cli.main", *args], cwd=cwd)


def dynamix_here(*args: str, cwd: Path, fails: bool = False) -> str:
    """``dynamix ARGS`` run in this process, for commands that start no process and leave no state behind
    (a new Python takes 3 s to import torch and Lightning); its output, stdout and stderr together. With
    ``fails`` it must exit with an error (whose message is in the output), else it must not."""
    from lightning_dynamix.cli.main import main

    out = io.StringIO()
    code: int | str | None = 0
    with contextlib.chdir(cwd), contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            main(list(args))
        except SystemExit as exit:
            code = exit.code
            if isinstance(code, str):  # what Python prints of an uncaught SystemExit("message")
                print(code, file=sys.stderr)
    output = out.getvalue()
    assert (code not in (0, None)) == fails, f"exit code {code!r}\n{output[-6000:]}"
    return output


def test_demo_compares_static_batches_with_the_callback_and_writes_a_plot(tmp_path):
    output = dynamix("demo", "--epochs", "1", "--batch-size", "64", "--json", cwd=tmp_path)
    summary, _ = json.JSONDecoder().raw_decode(output[output.index("{\n") :])
    assert set(summary) == {"static", "pid"}
    assert summary["static"]["final_batch_sizes"] == [64, 64]
    assert sum(summary["pid"]["final_batch_sizes"]) == 128  # pid keeps the global batch
    # what the demo achieved (throughput, the split pid found) is this machine's: the README and
    # docs/benchmarks give it; here only that it is reported
    for result in summary.values():
        assert result["throughput_to_ideal"] > 0
        assert 0 <= result["final_accuracy"] <= 1
    out = tmp_path / "dynamix_runs" / "demo"
    assert (out / "demo.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert set(json.loads((out / "demo.json").read_text())) == {"static", "pid"}
    # the demo's logs are what `dynamix report` reads
    report = json.loads(dynamix_here("report", str(out / "logs"), "--json", cwd=tmp_path))
    assert [r["source"] for r in report] == [str(out / "logs" / c / "metrics.csv") for c in ("pid", "static")]
    runs = json.loads((out / "demo.json").read_text())
    assert report[0]["last_batch_sizes"] == runs["pid"]["intervals"][-1]["batch_sizes"]
    assert report[0]["intervals"] == len(runs["pid"]["intervals"])
    assert report[1]["last_batch_sizes"] == [64, 64]
    for controller in ("pid", "static"):
        assert (out / "logs" / controller / "dynamix_report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_balance_reports_throughput_against_the_ideal_and_settling(tmp_path):
    out = tmp_path / "balance.json"
    dynamix(
        "bench", "balance", "--speeds", "1,1", "--schedule", "10:1:3", "--steps", "40", "--batch-size", "32",
        "--interval", "5", "--output", str(out), cwd=tmp_path,
    )  # fmt: skip
    result = json.loads(out.read_text())
    (intervals,) = result["runs"]["pid"]
    assert [i["step"] for i in intervals] == [10, 15, 20, 25, 30, 35, 40]
    pid = result["controllers"]["pid"]
    # how soon pid settles and how close to the ideal it gets are this machine's figures (docs/benchmarks):
    # here, that the bench reports them
    assert "settling_intervals" in pid
    assert pid["throughput_to_ideal_second_half"] > 0


def test_bench_balance_runs_goodput_with_sitting_out_allowed_and_refuses_a_negative_bound(tmp_path):
    out = tmp_path / "straggler.json"
    dynamix(
        "bench", "balance", "--speeds", "1,1,8", "--controller", "goodput", "--min-batch-size", "0",
        "--keep-global-batch", "--batch-size", "16", "--hidden", "64", "--steps", "40", "--output", str(out),
        cwd=tmp_path,
    )  # fmt: skip
    sizes = [i["next_batch_sizes"] for i in json.loads(out.read_text())["runs"]["goodput"][0]]
    assert all(sum(s) == 48 for s in sizes)  # the global batch is kept
    assert all(min(s) >= 0 for s in sizes)  # whether the 8x slower rank sits out is timing: a bench figure
    refused = subprocess.run(
        [sys.executable, "-m", "lightning_dynamix.cli.main", "bench", "balance", "--min-batch-size", "-1"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert refused.returncode != 0
    assert "--min-batch-size must be >= 0" in refused.stderr


def test_bench_balance_on_a_core_shared_with_a_busy_process_judges_controllers_against_the_best_fixed_split(
    tmp_path,
):
    out = tmp_path / "balance.json"
    printed = dynamix(
        "bench", "balance", "--contention", "busy", "--speeds", "1,2", "--controller", "static,pid", "--steps", "20",
        "--batch-size", "128", "--hidden", "512", "--interval", "5", "--oracle", "--oracle-finest", "32",
        "--rounds", "2", "--oracle-confirm", "2", "--output", str(out), cwd=tmp_path,
    )  # fmt: skip
    result = json.loads(out.read_text())
    oracle = result["oracle"]
    splits = [tuple(m["split"]) for m in oracle["measured"]]
    assert splits[0] == (128, 128)  # the search starts from the even split
    assert len(splits) == len(set(splits)) >= 3
    assert all(sum(split) == 256 for split in splits)
    # the two best of the search measured again; the best mean of two is chosen
    first = sorted(oracle["measured"], key=lambda m: m["samples_per_second"])[-2:]
    confirmed = oracle["confirmed"]
    assert sorted(c["split"] for c in confirmed) == sorted(m["split"] for m in first)
    means = {tuple(c["split"]): statistics.mean(c["samples_per_second"]) for c in confirmed}
    assert oracle["best_samples_per_second_in_search"] == pytest.approx(max(means.values()))
    assert means[tuple(oracle["best_split"])] == max(means.values())
    # the best split is run again in each round, in turn with the controllers, and they are judged against that
    assert len(oracle["best_samples_per_second_rounds"]) == 2
    assert oracle["best_samples_per_second"] == statistics.median(oracle["best_samples_per_second_rounds"])
    for controller in ("static", "pid"):
        row = result["controllers"][controller]
        assert len(row["samples_per_second_rounds"]) == 2
        assert row["fraction_of_best_fixed_split"] == pytest.approx(
            row["samples_per_second_second_half"] / oracle["best_samples_per_second"]
        )
    # how much slower the busy core makes rank 1, and the split pid finds, are this machine's (a bench's figures)
    assert all(sum(i["batch_sizes"]) == 256 for i in result["runs"]["pid"][0])
    assert "best fixed split" in printed


def test_bench_balance_refuses_contention_this_machine_cannot_provide(tmp_path):
    ranks = len(os.sched_getaffinity(0)) + 1
    refused = subprocess.run(
        [sys.executable, "-m", "lightning_dynamix.cli.main", "bench", "balance", "--contention", "busy",
         "--speeds", ",".join(["1"] * ranks)],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert refused.returncode != 0
    assert f"--contention busy needs a core per rank ({ranks} ranks)" in refused.stderr


def test_bench_tta_compares_controllers_on_another_model_family_with_a_mid_run_slowdown(tmp_path):
    out = tmp_path / "tta.json"
    dynamix(
        "bench", "tta", "--controllers", "static,ppo", "--seeds", "1", "--epochs", "1", "--batch-size", "32",
        "--architecture", "transformer", "--hidden", "16", "--depth", "1", "--optimizer", "adam", "--lr", "0.003",
        "--lr-scaling", "sqrt", "--speeds", "1,1", "--schedule", "60:1:3", "--target-accuracy", "0.2",
        "--output", str(out), cwd=tmp_path,
    )  # fmt: skip
    result = json.loads(out.read_text())
    assert result["schedule"] == [[60, 1, 3.0]]
    assert set(result["controllers"]) == {"static", "ppo"}
    for controller, runs in result["runs"].items():
        (run_result,) = runs
        assert run_result["config"]["architecture"] == "transformer"
        assert run_result["config"]["controller"] == controller
        assert run_result["samples"] == 16384  # one epoch: every sample once, whatever the sizes
    static = result["runs"]["static"][0]["intervals"]
    assert all(i["batch_sizes"] == [32, 32] for i in static)
    # rank 1 is 3x slower from step 60: ppo's balancer moves samples to rank 0
    ppo = result["runs"]["ppo"][0]["intervals"]
    assert ppo[-1]["batch_sizes"][0] > ppo[-1]["batch_sizes"][1]


def test_bench_tta_with_the_oracle_trains_the_best_fixed_split_beside_the_controllers(tmp_path):
    out = tmp_path / "tta.json"
    dynamix(
        "bench", "tta", "--controllers", "pid", "--seeds", "1", "--epochs", "1", "--batch-size", "64", "--hidden", "32",
        "--speeds", "1,3", "--oracle", "--oracle-steps", "20", "--oracle-finest", "16", "--oracle-confirm", "1",
        "--output", str(out),
        cwd=tmp_path,
    )  # fmt: skip
    result = json.loads(out.read_text())
    best = result["oracle"]["best_split"]
    assert sum(best) == 128
    assert best in [m["split"] for m in result["oracle"]["measured"]]  # one of the splits the search measured
    assert list(result["controllers"]) == ["best-fixed", "pid"]
    (fixed,) = result["runs"]["best-fixed"]
    assert fixed["config"]["batch_sizes"] == best
    assert all(i["batch_sizes"] == best for i in fixed["intervals"][:-1])  # the epoch's last step takes the rest
    assert result["controllers"]["best-fixed"]["fraction_of_best_fixed_split"] == 1.0
    pid = result["controllers"]["pid"]
    assert pid["fraction_of_best_fixed_split"] == pytest.approx(
        pid["median_samples_per_second"] / result["controllers"]["best-fixed"]["median_samples_per_second"]
    )
    assert all(r[0]["samples"] == 16384 for r in result["runs"].values())


def test_bench_overhead_reports_a_ratio_per_round(tmp_path):
    out = tmp_path / "overhead.json"
    dynamix(
        "bench", "overhead", "--rounds", "2", "--steps", "5", "--warmup", "2",
        "--features", "8", "--hidden", "16", "--batch-size", "4", "--output", str(out),
        cwd=tmp_path,
    )  # fmt: skip
    result = json.loads(out.read_text())
    assert len(result["ratios"]) == 2
    assert result["median_ratio"] > 0
    assert result["machine"]["cpus"] == os.cpu_count()


def test_bench_overhead_with_the_callback_also_measures_the_callbacks_own_work(tmp_path):
    out = tmp_path / "overhead.json"
    dynamix(
        "bench", "overhead", "--with-callback", "--with-preemption", "--interval", "2", "--rounds", "1",
        "--steps", "8", "--warmup", "2",
        "--features", "8", "--hidden", "16", "--batch-size", "4", "--output", str(out),
        cwd=tmp_path,
    )  # fmt: skip
    result = json.loads(out.read_text())
    assert result["variant"] == "heterogeneous_ddp + DynamixCallback + PreemptionCheckpoint"
    assert result["callback_ms_per_step"] > 0
    assert 0 < result["preemption_check_ms_per_step"] < result["median_step_ms_ddp"]
    assert 0 < result["step_clock_ms_per_step"] < result["median_step_ms_ddp"]
    expected = (result["callback_ms_per_step"] + result["step_clock_ms_per_step"]) / result["median_step_ms_ddp"]
    assert result["callback_cost_fraction_of_ddp_step"] == pytest.approx(expected)


def test_bench_elastic_preempts_a_node_under_torch_elastic_and_loses_no_step_with_the_preemption_checkpoint(tmp_path):
    out = tmp_path / "elastic.json"
    printed = dynamix(
        # 10 steps per epoch; the node leaves at step 5 and is back at step 10, with ~15 s of training left
        "bench", "elastic", "--scenarios", "preemption", "--epochs", "30", "--num-samples", "3840",
        "--val-checks", "1", "--preempt-at", "0.5", "--back-at", "1",
        "--target", "0.5", "--workdir", str(tmp_path / "work"), "--output", str(out),
        cwd=tmp_path,
    )  # fmt: skip
    result = json.loads(out.read_text())
    (run,) = result["runs"]["PreemptionCheckpoint"]
    assert run["launches"][:2] == [[3, 0], [2, run["launches"][1][1]]]
    assert run["launches"][1][1] >= 5  # saved at or after the step of the notice
    assert run["steps_lost"] == 0
    assert run["steps"] == 30 * 10
    assert run["notice_to_training"] > 0
    assert run["notice_to_step_reached"] == run["notice_to_training"]  # nothing to train again
    assert not run["back_after_the_end"]
    # the node came back while the job still trained, or as it wound down: then torch elastic restarted
    # the group once more, which resumed the end (PreemptionCheckpoint saves it) and trained nothing
    assert run["launches"][-1][0] == 3
    if run["launches"][-1][1] < run["steps"]:
        assert run["back_to_training_on_all"] > 0
    assert "| PreemptionCheckpoint | 0 |" in printed


def test_bench_hook_compares_the_weighted_hook_with_the_built_in_reduction(tmp_path):
    out = tmp_path / "hook.json"
    dynamix(
        "bench", "hook", "--iterations", "5", "--features", "8", "--hidden", "16", "--batch-size", "4",
        "--output", str(out), cwd=tmp_path,
    )  # fmt: skip
    result = json.loads(out.read_text())
    assert result["ratio_to_builtin"]["ddp built-in"] == 1.0
    assert set(result["median_ms"]) == {
        "ddp built-in",
        "ddp built-in, again",
        "weighted hook, weight 1",
        "weighted hook, weight 0.5",
    }


def test_bench_sit_out_times_a_job_whose_sitting_ranks_change_and_refuses_an_unknown_job(tmp_path):
    # 3 ranks, the training rank moving every 4 steps: a new group of training ranks at each of the first moves
    out = tmp_path / "sit.json"
    printed = dynamix_here(
        "bench", "sit-out", "--jobs", "rotate", "--hidden", "16", "--steps", "16", "--every", "4", "--rounds", "1",
        "--output", str(out), cwd=tmp_path,
    )  # fmt: skip
    assert "rotate hidden 16" in printed
    result = json.loads(out.read_text())
    assert set(result["results"]) == {"rotate hidden 16"}
    (step,) = result["results"]["rotate hidden 16"]["step_seconds"]
    assert step > 0
    refused = dynamix_here("bench", "sit-out", "--jobs", "everything", cwd=tmp_path, fails=True)
    assert "unknown job 'everything'" in refused


def test_bench_policy_times_the_learned_controllers_decisions_at_each_world_size(tmp_path):
    import torch

    out = tmp_path / "policy.json"
    threads = torch.get_num_threads()
    dynamix_here("bench", "policy", "--world-sizes", "1,4", "--decisions", "5", "--output", str(out), cwd=tmp_path)
    assert torch.get_num_threads() == threads  # timed on one thread, then given back
    result = json.loads(out.read_text())
    assert set(result) == {"1", "4"}
    for row in result.values():
        assert row["network_median_ms"] > 0
        assert 0 < row["median_ms"] <= row["p99_ms"]


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
    for term in ("step_seconds", "loader_seconds", "optimizer_seconds", "trainer_row_seconds", "server_row_seconds"):
        assert plan.runner[term] > 0, term
    assert plan.runner["step_seconds"] > plan.runner["request_seconds"]
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
    dynamix_here(
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
