"""The overhead, hook, policy, elastic and device benches of ``dynamix``, run as a user runs them."""

from __future__ import annotations

import json
import math
import os

import pytest

from tests.cli.commands import dynamix, dynamix_here

pytestmark = pytest.mark.distributed


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
    # each a time of its own (how it compares with a step is the bench's figure, not this machine's to assert)
    for part in ("preemption_check_ms_per_step", "step_clock_ms_per_step", "median_step_ms_ddp"):
        assert 0 < result[part] < math.inf, part
    expected = (result["callback_ms_per_step"] + result["step_clock_ms_per_step"]) / result["median_step_ms_ddp"]
    assert result["callback_cost_fraction_of_ddp_step"] == pytest.approx(expected)


def test_bench_elastic_kills_a_torchft_replica_without_notice_and_the_others_lose_no_committed_step(tmp_path):
    out = tmp_path / "elastic.json"
    printed = dynamix(
        # 10 steps per epoch; the node is killed (SIGKILL) at step 5 and started again at step 10
        "bench", "elastic", "--scenarios", "torchft", "--signal", "kill", "--epochs", "6", "--num-samples", "3840",
        "--val-checks", "1", "--preempt-at", "0.5", "--back-at", "1", "--heartbeat-timeout", "2",
        "--target", "0.5", "--workdir", str(tmp_path / "work"), "--output", str(out),
        cwd=tmp_path,
    )  # fmt: skip
    (run,) = json.loads(out.read_text())["runs"]["per-step (torchft)"]
    assert run["steps"] == 6 * 10  # every step committed, once
    assert run["steps_lost"] == 0
    assert run["steps_trained_again"] <= 1  # the step the node died in, if it died inside one
    assert run["launches"][1][0] == 2
    assert run["launches"][1][1] >= 5
    assert run["notice_to_training"] > 0
    # the node's new process joins the job that went on, where it started before the job's end: how long a
    # process takes to start is the machine's (a loaded one may not make it; the join itself is tested on a
    # virtual clock in tests/distributed/test_fault_tolerance.py)
    if run["back_after_the_end"]:
        assert run["launches"][2][1] is None
    else:
        assert run["launches"][2][0] == 3
    assert "| per-step (torchft) | 0 |" in printed
    assert "the others' longest wait between two committed steps" in printed


def test_bench_overhead_times_fault_tolerant_replicas_beside_heterogeneous_ddp_nodes(tmp_path):
    out = tmp_path / "overhead.json"
    printed = dynamix(
        "bench", "overhead", "--fault-tolerant", "--rounds", "1", "--steps", "5", "--warmup", "2",
        "--features", "16", "--hidden", "32", "--batch-size", "8", "--output", str(out), cwd=tmp_path,
    )  # fmt: skip
    result = json.loads(out.read_text())
    assert result["variant"] == "fault_tolerant (torchft) against heterogeneous_ddp"
    assert len(result["ratios"]) == 1
    assert result["median_step_ms_fault_tolerant"] > 0
    assert result["median_step_ms_heterogeneous_ddp"] > 0
    assert "median step-time ratio fault_tolerant / heterogeneous_ddp" in printed


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


def test_bench_device_checks_exactness_and_out_of_memory_recovery_on_this_machines_device(tmp_path):
    # on a CPU: the machinery of the GPU check, end to end (ranks launched as nodes of one device each)
    printed = dynamix(
        "bench", "device", "--checks", "exactness,memory,mixed,nvml", "--precisions", "32-true,16-mixed",
        "--steps", "8", "--output", str(tmp_path / "device.json"), cwd=tmp_path,
    )  # fmt: skip
    rows = {row["check"]: row for row in json.loads((tmp_path / "device.json").read_text())["rows"]}
    assert set(rows) == {"exactness 32-true", "exactness 16-mixed", "memory", "mixed GPU + CPU", "nvml"}
    assert rows["exactness 32-true"]["verdict"] == "pass"
    assert rows["memory"]["verdict"] == "pass"  # a step ran out of (emulated) memory and was trained again
    assert rows["memory"]["result"].split()[0] != "0"
    # what needs a GPU says so, and is neither passed nor failed
    assert rows["exactness 16-mixed"]["verdict"] == rows["nvml"]["verdict"] == "not run"
    assert rows["mixed GPU + CPU"]["verdict"] == "not run"
    assert "needs CUDA" in rows["exactness 16-mixed"]["result"]
    assert "needs a GPU" in rows["mixed GPU + CPU"]["result"]
    assert "dynamix bench device on CPU" in printed
    dynamix_here("bench", "device", "--checks", "speed", cwd=tmp_path, fails=True)
