"""The ``dynamix`` command and the LightningCLI example, run as a user runs them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
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


def test_demo_compares_static_batches_with_the_callback_and_writes_a_plot(tmp_path):
    output = dynamix("demo", "--epochs", "1", "--batch-size", "64", "--json", cwd=tmp_path)
    summary, _ = json.JSONDecoder().raw_decode(output[output.index("{\n") :])
    assert set(summary) == {"static", "pid"}
    assert summary["static"]["final_batch_sizes"] == [64, 64]
    assert sum(summary["pid"]["final_batch_sizes"]) == 128  # pid keeps the global batch
    # rank 1 is 3x slower: pid gives it fewer samples than rank 0
    assert summary["pid"]["final_batch_sizes"][1] < summary["pid"]["final_batch_sizes"][0]
    for result in summary.values():
        assert 0 < result["throughput_to_ideal"] <= 1.05
        assert 0 <= result["final_accuracy"] <= 1
    out = tmp_path / "dynamix_runs" / "demo"
    assert (out / "demo.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert set(json.loads((out / "demo.json").read_text())) == {"static", "pid"}
    # the demo's logs are what `dynamix report` reads
    report = json.loads(dynamix("report", str(out / "logs"), "--json", cwd=tmp_path))
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
        "bench", "balance", "--speeds", "1,1", "--schedule", "10:1:3", "--steps", "30", "--batch-size", "32",
        "--interval", "5", "--output", str(out), cwd=tmp_path,
    )  # fmt: skip
    result = json.loads(out.read_text())
    assert [i["step"] for i in result["intervals"]] == [10, 15, 20, 25, 30]
    assert result["settling_intervals"] is not None
    assert 0 < result["throughput_to_ideal_second_half"] <= 1.05


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
        "bench", "overhead", "--with-callback", "--interval", "2", "--rounds", "1", "--steps", "8", "--warmup", "2",
        "--features", "8", "--hidden", "16", "--batch-size", "4", "--output", str(out),
        cwd=tmp_path,
    )  # fmt: skip
    result = json.loads(out.read_text())
    assert result["variant"] == "heterogeneous_ddp + DynamixCallback"
    assert result["callback_ms_per_step"] > 0
    assert 0 < result["step_clock_ms_per_step"] < result["median_step_ms_ddp"]
    expected = (result["callback_ms_per_step"] + result["step_clock_ms_per_step"]) / result["median_step_ms_ddp"]
    assert result["callback_cost_fraction_of_ddp_step"] == pytest.approx(expected)


@pytest.mark.parametrize(("config", "sizes"), [("class_path.yaml", "(16, 48)"), ("registered_name.yaml", "(32, 32)")])
def test_lightning_cli_yaml_selects_and_trains_with_the_strategy(tmp_path, config, sizes):
    output = run(
        [
            sys.executable,
            str(ROOT / "examples" / "lightning" / "train.py"),
            "fit",
            "--config",
            str(ROOT / "examples" / "lightning" / config),
            "--trainer.max_epochs=1",
            f"--trainer.default_root_dir={tmp_path}",
        ],
        cwd=tmp_path,
    )
    assert f"trained with HeterogeneousDDPStrategy, per-rank batch sizes {sizes}" in output
    assert "`Trainer.fit` stopped: `max_epochs=1` reached." in output


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


def test_accelerate_example_runs_under_both_launchers_and_resumes(tmp_path):
    script = str(ROOT / "examples" / "accelerate" / "train.py")
    bin_dir = Path(sys.executable).parent
    first = run(
        [str(bin_dir / "accelerate"), "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
         "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", "0", script, "--epochs", "1"],
        cwd=tmp_path,
    )  # fmt: skip
    assert "epoch 0: validation accuracy" in first
    resumed = run([str(bin_dir / "torchrun"), "--standalone", "--nproc_per_node", "2", script, "--epochs", "2",
                   "--resume"], cwd=tmp_path)  # fmt: skip
    assert "epoch 0:" not in resumed  # it continued after the saved epoch
    assert "epoch 1: validation accuracy" in resumed
    (report,) = json.loads(dynamix("report", "dynamix_runs/accelerate", "--json", cwd=tmp_path))
    assert report["ranks"] == 2
    assert report["last_step"] > 64  # both runs' intervals, one epoch of 64 steps each
    assert report["last_batch_sizes"][0] > report["last_batch_sizes"][1]  # the slowed rank 1 got fewer samples
