"""The ``dynamix`` demo and the balance, time-to-accuracy and sit-out benches, run as a user runs them."""

from __future__ import annotations

import json
import os
import statistics

import pytest

from tests.cli.commands import dynamix, dynamix_fails, dynamix_here

pytestmark = pytest.mark.distributed


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
        assert 0 <= result["network_share"] <= 1  # measured on loopback: how small is this machine's
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
    shares = [i["network_share"] for i in runs["pid"]["intervals"]]
    assert report[0]["network_share_median"] == pytest.approx(statistics.median(shares))
    for controller in ("pid", "static"):
        assert (out / "logs" / controller / "dynamix_report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_balance_reports_throughput_against_the_ideal_and_settling(tmp_path):
    out = tmp_path / "balance.json"
    dynamix(
        "bench", "balance", "--speeds", "1,1", "--schedule", "10:1:3", "--steps", "40", "--batch-size", "32",
        "--interval", "5", "--fixed-splits", "32,32;48,16", "--output", str(out), cwd=tmp_path,
    )  # fmt: skip
    result = json.loads(out.read_text())
    # each phase between the changes, every row against the best of the fixed splits in that phase
    table = result["controllers"]
    for name, split in (("fixed 32,32", [32, 32]), ("fixed 48,16", [48, 16])):
        (fixed,) = result["runs"][name]
        assert all(i["batch_sizes"] == split for i in fixed)
    for k, (start, end) in enumerate([(0, 10), (10, 40)]):
        best = max(table[name]["phases"][k]["samples_per_second"] for name in ("fixed 32,32", "fixed 48,16"))
        for name, row in table.items():
            phase = row["phases"][k]
            assert (phase["from_step"], phase["to_step"]) == (start, end)
            inside = [i["throughput"] for i in result["runs"][name][0] if i["step"] - 5 >= start and i["step"] <= end]
            assert phase["samples_per_second"] == statistics.median(inside)
            assert phase["fraction_of_best_fixed_split"] == pytest.approx(phase["samples_per_second"] / best)
    # settled: the decisions after the change, up to the first from which every later one stays within 10% of
    # the phase's last decision
    decided = [i["next_batch_sizes"] for i in result["runs"]["pid"][0] if 10 < i["step"] <= 40]
    within = [all(abs(b - f) <= 0.1 * f for b, f in zip(sizes, decided[-1])) for sizes in decided]
    unsettled = max((k + 1 for k, ok in enumerate(within) if not ok), default=0)
    assert table["pid"]["phases"][1]["settling_decisions"] == unsettled + 1
    assert table["fixed 48,16"]["phases"][1]["settling_decisions"] is None
    refused = dynamix_here(
        "bench", "balance", "--fixed-splits", "32,31", "--batch-size", "32", cwd=tmp_path, fails=True
    )
    assert "--fixed-splits: 32,31 must give each of the 2 ranks a size, summing to the global batch 64" in refused
    (intervals,) = result["runs"]["pid"]
    assert [i["step"] for i in intervals] == [10, 15, 20, 25, 30, 35, 40]
    pid = result["controllers"]["pid"]
    # how soon pid settles and how close to the ideal it gets are this machine's figures (docs/benchmarks):
    # here, that the bench reports them
    assert "settling_intervals" in pid
    assert pid["throughput_to_ideal_second_half"] > 0
    later_shares = [i["network_share"] for i in intervals if i["step"] > 20]
    assert pid["network_share_second_half"] == statistics.median(later_shares)
    # how far pid kept moving each rank's size over the second half (steps after 20), from the intervals
    later = [i["batch_sizes"] for i in intervals if i["step"] > 20]
    (spread,) = pid["size_spread_second_half"]
    for rank, reported in enumerate(spread):
        mine = [sizes[rank] for sizes in later]
        assert (reported["min"], reported["max"]) == (min(mine), max(mine))
        assert reported["of_global_batch"] == (max(mine) - min(mine)) / 64


def test_bench_balance_runs_goodput_with_sitting_out_allowed_and_refuses_a_negative_bound(tmp_path):
    out = tmp_path / "straggler.json"
    dynamix(
        "bench", "balance", "--speeds", "1,1,8", "--controllers", "goodput", "--min-batch-size", "0",
        "--keep-global-batch", "--batch-size", "16", "--hidden", "64", "--steps", "40", "--output", str(out),
        cwd=tmp_path,
    )  # fmt: skip
    sizes = [i["next_batch_sizes"] for i in json.loads(out.read_text())["runs"]["goodput"][0]]
    assert all(sum(s) == 48 for s in sizes)  # the global batch is kept
    assert all(min(s) >= 0 for s in sizes)  # whether the 8x slower rank sits out is timing: a bench figure
    refused = dynamix_fails("bench", "balance", "--min-batch-size", "-1", cwd=tmp_path)
    assert "--min-batch-size must be >= 0" in refused


def test_bench_balance_on_a_core_shared_with_a_busy_process_judges_controllers_against_the_best_fixed_split(
    tmp_path,
):
    out = tmp_path / "balance.json"
    printed = dynamix(
        "bench", "balance", "--contention", "busy", "--speeds", "1,2", "--controllers", "static,pid", "--steps", "20",
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
        # each round against that round's run of the best split, over its second half and over the whole run
        halves = [a / b for a, b in zip(row["samples_per_second_rounds"], oracle["best_samples_per_second_rounds"])]
        assert row["fraction_of_best_fixed_split_rounds"] == pytest.approx(halves)
        wholes = zip(row["samples_per_second_whole_run_rounds"], oracle["best_samples_per_second_whole_run_rounds"])
        assert row["fraction_of_best_fixed_split_whole_run_rounds"] == pytest.approx([a / b for a, b in wholes])
        steps = [i["step"] for i in result["runs"][controller][0]]
        assert row["settled_at_step_rounds"][0] in steps
    # how much slower the busy core makes rank 1, and the split pid finds, are this machine's (a bench's figures)
    assert all(sum(i["batch_sizes"]) == 256 for i in result["runs"]["pid"][0])
    assert "best fixed split" in printed
    assert "first within 2% of its final split at step" in printed


def test_bench_balance_refuses_contention_this_machine_cannot_provide(tmp_path):
    ranks = len(os.sched_getaffinity(0)) + 1
    refused = dynamix_fails(
        "bench", "balance", "--contention", "busy", "--speeds", ",".join(["1"] * ranks), cwd=tmp_path
    )
    assert f"--contention busy needs a core per rank ({ranks} ranks)" in refused


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
    # rank 1 is 3x slower from step 60: ppo's balancer ends with no more samples on it (how far it moves them
    # to rank 0 is the bench's figure: it depends on this machine's timing)
    ppo = result["runs"]["ppo"][0]["intervals"]
    assert ppo[-1]["batch_sizes"][0] >= ppo[-1]["batch_sizes"][1]


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


def test_bench_tta_trains_fixed_global_batches_and_times_the_controllers_against_the_first_to_the_target(tmp_path):
    out = tmp_path / "tta.json"
    dynamix(
        "bench", "tta", "--controllers", "goodput", "--seeds", "1", "--epochs", "1", "--batch-size", "64",
        "--hidden", "32", "--speeds", "1,1", "--oracle-global-batches", "64,256", "--lr-scaling", "linear",
        "--lr", "0.1", "--target-accuracy", "0.15", "--num-samples", "4096", "--output", str(out),
        "--log-dir", str(tmp_path / "logs"),
        cwd=tmp_path,
    )  # fmt: skip
    result = json.loads(out.read_text())
    # every run's metrics, for dynamix report and dynamix calibrate
    for row, controller in (("fixed@64", "static"), ("fixed@256", "static"), ("goodput", "goodput")):
        assert "dynamix/" in (tmp_path / "logs" / f"{row}-seed0" / controller / "metrics.csv").read_text()
    # without --oracle, the even split scaled to each global batch, the learning rate by the rule
    assert result["fixed_runs"] == {
        "fixed@64": {"batch_sizes": [32, 32], "lr": pytest.approx(0.05)},
        "fixed@256": {"batch_sizes": [128, 128], "lr": pytest.approx(0.2)},
    }
    for name, fixed in result["fixed_runs"].items():
        (run,) = result["runs"][name]
        assert run["config"]["batch_sizes"] == fixed["batch_sizes"]
        assert run["config"]["lr"] == pytest.approx(fixed["lr"])
        assert all(i["batch_sizes"] == fixed["batch_sizes"] for i in run["intervals"][:-1])
    table = result["controllers"]
    times = {name: table[name]["median_time_to_target"] for name in result["fixed_runs"]}
    assert None not in times.values()  # a low target: every fixed run reaches it
    best = min(times, key=lambda name: times[name])
    assert result["best_fixed"] == best
    assert table["best-fixed"]["row"] == best
    assert table[best]["time_to_target_of_best_fixed"] == 1.0
    goodput = table["goodput"]
    if goodput["median_time_to_target"] is not None:
        assert goodput["time_to_target_of_best_fixed"] == pytest.approx(goodput["median_time_to_target"] / times[best])
    refused = dynamix_here("bench", "tta", "--oracle-global-batches", "256,x", cwd=tmp_path, fails=True)
    assert "--oracle-global-batches: must be comma-separated whole numbers of samples, got '256,x'" in refused
    refused = dynamix_here("bench", "tta", "--oracle-global-batches", "256,256", cwd=tmp_path, fails=True)
    assert "must be distinct global batches >= 1 sample, got '256,256'" in refused
    refused = dynamix_here("bench", "tta", "--lr-scaling", "cubic", cwd=tmp_path, fails=True)
    assert "--lr-scaling: `lr_scaling` must be one of ['none', 'linear', 'sqrt', 'adascale'], got 'cubic'" in refused
    refused = dynamix_here("bench", "tta", "--pid-max-global-batch", "100", cwd=tmp_path, fails=True)
    assert "--pid-max-global-batch must be at least the initial global batch (256" in refused


def test_bench_sit_out_times_a_job_whose_sitting_ranks_change_and_refuses_an_unknown_job(tmp_path):
    # 3 ranks, the training rank moving every 4 steps: a new group of training ranks at each of the first moves
    out = tmp_path / "sit.json"
    printed = dynamix(
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


def test_bench_balance_and_tta_train_the_resnet_with_per_rank_or_global_batch_norm(tmp_path):
    out = tmp_path / "resnet.json"
    dynamix(
        "bench", "balance", "--architecture", "resnet", "--hidden", "4", "--speeds", "1,8", "--controllers", "pid",
        "--batch-size", "8", "--steps", "20", "--interval", "3", "--output", str(out), cwd=tmp_path,
    )  # fmt: skip
    result = json.loads(out.read_text())
    decided = [i["next_batch_sizes"] for i in result["runs"]["pid"][0] if i["next_batch_sizes"]]
    assert decided
    assert all(min(s) >= 2 for s in decided)
    assert result["runs"]["pid"][0]
    assert result["config"]["architecture"] == "resnet"
    printed = dynamix(
        "bench", "tta", "--architecture", "resnet", "--hidden", "4", "--sync-batchnorm", "--controllers", "static",
        "--seeds", "1", "--epochs", "1", "--num-samples", "256", "--batch-size", "16", "--target-accuracy", "0.2",
        cwd=tmp_path,
    )  # fmt: skip
    assert "resnet (hidden 4" in printed
    assert "global BatchNorm" in printed


def test_bench_balance_with_each_rank_on_a_host_of_its_own_link_is_bound_by_the_slow_link_and_its_changes(
    tmp_path, hosts_available
):
    from lightning_dynamix.data.workloads import ClassificationTask

    out = tmp_path / "links.json"
    dynamix(
        "bench", "balance", "--controllers", "static", "--speeds", "1,1", "--links", "0,20", "--steps", "20",
        "--schedule", "12:1:link=5", "--hidden", "256", "--batch-size", "32", "--output", str(out), cwd=tmp_path,
    )  # fmt: skip
    result = json.loads(out.read_text())
    assert result["config"]["links"] == [None, 20.0]
    assert result["config"]["load_changes"] == [{"step": 12, "rank": 1, "kind": "link", "value": 5.0}]
    # every all-reduce crosses rank 1's link, 20 Mbit/s and 5 from step 12: the gradient's bits each way a step
    # (2 ranks), of which the token bucket lets 4 KiB through at once (half of it asked). A lower bound the shaper
    # sets: a slower or busier machine only adds to it, and no machine passes the link faster (on loopback a step
    # of this model takes a few ms)
    gradient_bits = 32 * sum(p.numel() for p in ClassificationTask(hidden=256, depth=2).parameters())
    (intervals,) = result["runs"]["static"]
    assert [i["step"] for i in intervals] == [10, 15, 20]
    assert min(intervals[0]["step_time"]) >= 0.5 * gradient_bits / 20e6
    assert min(intervals[2]["step_time"]) >= 0.5 * gradient_bits / 5e6  # steps 16-20: all on the slower link


@pytest.mark.parametrize(
    ("links", "message"),
    [("10,fast", "'fast' in '10,fast'"), ("10", "gives 1 hosts a rate, but the job has 2"), ("10,-3", "'-3'")],
)
def test_bench_balance_refuses_bad_links_naming_the_value(tmp_path, links, message):
    error = dynamix_here("bench", "balance", "--speeds", "1,1", "--links", links, cwd=tmp_path, fails=True)
    assert message in error


def test_bench_balance_and_tta_train_the_language_model_weighted_by_tokens(tmp_path):
    out = tmp_path / "lm.json"
    dynamix(
        "bench", "balance", "--architecture", "causal-lm", "--hidden", "16", "--speeds", "1,3",
        "--controllers", "static", "--batch-size", "8", "--steps", "12", "--interval", "3", "--group-by-length", "64",
        "--output", str(out), cwd=tmp_path,
    )  # fmt: skip
    result = json.loads(out.read_text())
    assert result["config"]["group_by_length"] == 64
    row = result["controllers"]["static"]
    assert all(rate > 0 for rate in row["tokens_per_second_rounds"])
    assert 0 < row["tokens_to_ideal_second_half"] <= 1.05
    assert 0 <= row["padding_second_half"] < 0.2  # alike lengths: 4-39 tokens at random pad ~40 %
    interval = result["runs"]["static"][0][-1]
    assert all(work > 0 for work in interval["work"])  # token positions per step, every rank
    printed = dynamix(
        "bench", "tta", "--architecture", "causal-lm", "--hidden", "16", "--depth", "1", "--controllers", "static",
        "--seeds", "1", "--epochs", "1", "--num-samples", "256", "--batch-size", "16", "--optimizer", "adam",
        "--lr", "0.003", "--target-loss", "4.8", cwd=tmp_path,
    )  # fmt: skip
    assert "causal-lm (hidden 16" in printed
    assert "target loss 4.8" in printed
    assert "tokens/s / ideal" in printed
    failed = dynamix_fails("bench", "balance", "--group-by-length", "64", cwd=tmp_path)
    assert "--group-by-length needs --architecture causal-lm" in failed


def test_bench_balance_reads_the_training_split_streamed_from_a_litdata_dataset(tmp_path):
    out = tmp_path / "streamed.json"
    dynamix(
        "bench", "balance", "--streaming", "in-order", "--controllers", "pid", "--speeds", "1,1", "--steps", "20",
        "--batch-size", "32", "--num-samples", "2048", "--output", str(out), cwd=tmp_path,
    )  # fmt: skip
    result = json.loads(out.read_text())
    directory = result["config"]["streaming_dir"]
    assert directory is not None
    assert result["config"]["streaming_in_order"] is True
    assert not os.path.exists(directory)  # the dataset written for the runs is gone after them
    (intervals,) = result["runs"]["pid"]
    assert [i["step"] for i in intervals] == [10, 15, 20]
    assert all(sum(i["batch_sizes"]) == 64 for i in intervals)
    refused = dynamix_here("bench", "balance", "--streaming", "--architecture", "resnet", cwd=tmp_path, fails=True)
    assert "--streaming reads the mlp and transformer workloads' data, not --architecture resnet" in refused
