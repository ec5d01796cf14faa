"""``dynamix bench device``: one call that checks the device paths on this machine's accelerator.

Every check trains the built-in classifier (``ClassificationTask``) under Lightning in processes of its
own, whose ranks this command launches as nodes of one device each: two ranks share one GPU the way a
machine with one GPU runs them (gloo carries the CUDA tensors, as NCCL refuses two ranks on one device).
On a machine without a GPU the same checks run on the CPU. The report is one table (and JSON):

* ``exactness <precision>`` (``32-true``, ``16-mixed`` with its GradScaler, ``bf16-mixed``): two ranks on
  uneven sizes that change every few steps, against one process training the same global batches at the
  same precision, the largest difference of any parameter; beside it the difference two ranks at an even
  split make (what the precision's rounding allows). Passes where the uneven split differs by no more than
  twice the even split's, plus 1e-6.
* ``timing 1:3``: one rank under ``HeterogeneityEmulator`` at factor 1, then 3, its compute per step as the
  step clock measures it (CUDA events on a GPU) and, in a run beside it, as ``perf_counter`` measures it:
  the ratio of the two factors for each clock. Passes where the step clock's ratio is within 10% of 3.
* ``pid 1:3``: two ranks, one three times slower, ``DynamixCallback("pid")``: throughput against the ideal
  (the sum of the ranks' own speeds) over the last intervals, for the step clock and for ``perf_counter``
  timing. Passes at >= 0.95 for the step clock. Needs a device per rank: on one GPU the two ranks would share
  its time, so it is reported as not run. On a CPU ``timing`` and ``pid`` report their figures without a
  verdict: the emulator sleeps there, and its balance is ``dynamix bench balance``'s to judge.
* ``memory``: two ranks; rank 1's memory holds fewer samples than a resize gives it (a per-process memory
  fraction on a GPU, ``HeterogeneityEmulator(memory_limits=...)`` elsewhere): the step that ran out of memory
  trained again split anew, against one process. Passes where a step was recovered and the parameters are
  as close as the exactness check's.
* ``nvml``: the GPU metrics gathered with every rank's measurements (utilisation, memory, power,
  temperature) finite; on a CPU they are NaN by design, and the check is reported as not run.

Run with ``--checks`` to choose; ``--budget`` bounds each job's seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

CHECKS = ("exactness", "timing", "pid", "memory", "nvml")
PRECISIONS = ("32-true", "16-mixed", "bf16-mixed")
NUM_SAMPLES, FEATURES = 8192, 64
HIDDEN = {"cpu": 1024, "cuda": 4096}  # steps long enough that a sleep's or a spin's error is small beside them
UNEVEN = {0: [10, 54], 4: [40, 24], 8: [22, 42], 12: [51, 13]}  # step -> sizes (64 a step)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    every = ",".join(CHECKS)
    parser.add_argument("--checks", default=every, help=f"which checks, comma-separated (default {every})")
    parser.add_argument("--accelerator", choices=("auto", "cpu", "cuda"), default="auto", help="default: cuda if any")
    precisions = ",".join(PRECISIONS)
    parser.add_argument("--precisions", default=precisions, help=f"exactness's precisions (default {precisions})")
    parser.add_argument("--steps", type=int, default=16, help="steps of each exactness and memory job (default 16)")
    parser.add_argument("--timing-steps", type=int, default=60, help="steps of each timing job (default 60)")
    parser.add_argument("--budget", type=float, default=240.0, help="seconds one job may take (default 240)")
    parser.add_argument("--output", type=Path, default=None, help="also write the results as JSON here")


# --------------------------------------------------------------------------------------------- the command


def run(args: argparse.Namespace) -> None:
    """Run the checks and print one table."""
    import torch

    from lightning_dynamix.bench.records import arguments_record, machine_description

    checks = [c.strip() for c in str(args.checks).split(",") if c.strip()]
    for check in checks:
        if check not in CHECKS:
            raise SystemExit(f"--checks: unknown check {check!r}; choose from {', '.join(CHECKS)}")
    for precision in str(args.precisions).split(","):
        if precision not in PRECISIONS:
            raise SystemExit(f"--precisions: unknown precision {precision!r}; choose from {', '.join(PRECISIONS)}")
    if args.steps < 8:
        raise SystemExit(f"--steps must be >= 8 (the sizes change at steps 4 and 8), got {args.steps}")
    accelerator = args.accelerator
    if accelerator == "auto":
        accelerator = "cuda" if torch.cuda.is_available() else "cpu"
    if accelerator == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--accelerator cuda: CUDA is not available on this machine")
    card = torch.cuda.get_device_name(0) if accelerator == "cuda" else "CPU"
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="dynamix-device-") as folder:
        out = Path(folder)
        runner = _Runner(out, accelerator, args.budget)
        for check in checks:
            started = time.perf_counter()
            new = getattr(sys.modules[__name__], f"_check_{check}")(runner, args)
            for row in new:
                row["seconds"] = round(time.perf_counter() - started, 1)
            rows += new
    print(f"\ndynamix bench device on {card} ({accelerator})")
    print(f"{'check':<24} {'result':<58} {'target':<34} verdict")
    for row in rows:
        print(f"{row['check']:<24} {row['result']:<58} {row['target']:<34} {row['verdict']}")
    if args.output is not None:
        record = {"machine": machine_description(), "card": card, "config": arguments_record(args), "rows": rows}
        args.output.write_text(json.dumps(record, indent=2))


class _Runner:
    """Launches a job's ranks (one device each, as nodes) and collects what each wrote."""

    def __init__(self, out: Path, accelerator: str, budget: float) -> None:
        self.out, self.accelerator, self.budget = out, accelerator, budget
        self.jobs = 0

    def __call__(self, world: int, **spec: Any) -> list[dict[str, Any]]:
        from lightning_dynamix.distributed.ports import free_port

        self.jobs += 1
        name = f"job{self.jobs}"
        spec.update(name=name, world=world, accelerator=self.accelerator, out=str(self.out))
        port = free_port()
        procs = []
        for rank in range(world):
            env = dict(os.environ, PYTHONUNBUFFERED="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            env.update(WORLD_SIZE=str(world), NODE_RANK=str(rank), LOCAL_RANK="0")
            for unset in ("RANK", "GROUP_RANK", "LOCAL_WORLD_SIZE"):
                env.pop(unset, None)
            command = [sys.executable, "-m", "lightning_dynamix.bench.device", "--job", json.dumps(spec)]
            log = open(self.out / f"{name}-{rank}.log", "w")  # noqa: SIM115 - closed below
            procs.append((subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT), log))
        deadline = time.monotonic() + self.budget
        failed = None
        for rank, (proc, log) in enumerate(procs):
            try:
                code = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                code = None
            log.close()
            if code != 0 and failed is None:
                failed = (rank, code)
        if failed is not None:
            for proc, _ in procs:
                proc.kill()
            rank, code = failed
            text = (self.out / f"{name}-{rank}.log").read_text()[-3000:]
            what = "ran past --budget" if code is None else f"exited with {code}"
            raise RuntimeError(f"{spec['kind']} job, rank {rank} {what}:\n{text}")
        return [json.loads((self.out / f"{name}-{rank}.json").read_text()) for rank in range(world)]


def _row(check: str, result: str, target: str, passed: bool | None) -> dict[str, Any]:
    verdict = "not run" if passed is None else ("pass" if passed else "FAIL")
    return {"check": check, "result": result, "target": target, "verdict": verdict}


def _difference(first: dict[str, Any], second: dict[str, Any]) -> float:
    return max(abs(a - b) for key in first for a, b in zip(first[key], second[key], strict=True))


def _check_exactness(runner: _Runner, args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    for precision in str(args.precisions).split(","):
        if precision == "16-mixed" and runner.accelerator != "cuda":
            rows.append(_row(f"exactness {precision}", "float16 autocast with a GradScaler needs CUDA", "-", None))
            continue
        common = dict(kind="train", precision=precision, steps=args.steps)
        one = runner(1, sizes=[64], plan={}, **common)[0]
        even = runner(2, sizes=[32, 32], plan={}, **common)[0]
        uneven = runner(2, sizes=UNEVEN[0], plan=UNEVEN, **common)[0]
        even_error, error = _difference(even["params"], one["params"]), _difference(uneven["params"], one["params"])
        rows.append(
            _row(
                f"exactness {precision}",
                f"uneven {error:.2e}, even {even_error:.2e} (largest |param - one process|)",
                "uneven <= 2 x even + 1e-6",
                error <= 2 * even_error + 1e-6,
            )
        )
    return rows


def _check_timing(runner: _Runner, args: argparse.Namespace) -> list[dict[str, Any]]:
    results = {}
    for clock in ("step clock", "perf_counter"):
        for factor in (1.0, 3.0):
            job = runner(1, kind="timing", factor=factor, host_time=clock == "perf_counter", steps=args.timing_steps)[0]
            results[(clock, factor)] = job["compute_time"]
    rows = []
    for clock in ("step clock", "perf_counter"):
        ratio = results[(clock, 3.0)] / results[(clock, 1.0)]
        own = results[(clock, 1.0)]
        # on a CPU the emulator sleeps, and waking late is multiplied too: the target is the GPU's spin kernel
        judged = clock == "step clock" and runner.accelerator == "cuda"
        passed = abs(ratio - 3.0) <= 0.3 if judged else None
        target = "within 10% of 3 (on a GPU)" if clock == "step clock" else "(beside it: host timing)"
        rows.append(
            _row(f"timing 1:3, {clock}", f"compute ratio {ratio:.2f} ({own * 1e3:.2f} ms at 1x)", target, passed)
        )
    return rows


def _check_pid(runner: _Runner, args: argparse.Namespace) -> list[dict[str, Any]]:
    import torch

    if runner.accelerator == "cuda" and torch.cuda.device_count() < 2:
        reason = "needs two GPUs: two ranks on one GPU share its time"
        return [_row("pid 1:3", reason, ">= 0.95 of ideal", None)]
    rows = []
    for clock in ("step clock", "perf_counter"):
        jobs = runner(2, kind="pid", host_time=clock == "perf_counter", steps=args.timing_steps * 4)
        fraction = jobs[0]["throughput_to_ideal"]
        # on a CPU the balance is dynamix bench balance's to judge (the emulator sleeps there)
        passed = fraction >= 0.95 if clock == "step clock" and runner.accelerator == "cuda" else None
        result = f"{fraction:.3f} of the ideal sum of speeds"
        rows.append(_row(f"pid 1:3, {clock}", result, ">= 0.95 of ideal (on GPUs)", passed))
    return rows


def _check_memory(runner: _Runner, args: argparse.Namespace) -> list[dict[str, Any]]:
    plan = {0: [32, 32], 4: [8, 56]}  # rank 1's memory holds about 40 samples
    common = dict(precision="32-true", steps=args.steps, plan=plan)
    one = runner(1, kind="train", sizes=[64], **common)[0]
    even = runner(2, kind="train", sizes=[32, 32], **{**common, "plan": {}})[0]
    limited = runner(2, kind="train", sizes=[32, 32], memory_limit=40, **common)
    error, even_error = _difference(limited[0]["params"], one["params"]), _difference(even["params"], one["params"])
    recovered = limited[0]["recovered"]
    how = "a memory fraction" if runner.accelerator == "cuda" else "an emulated limit"
    return [
        _row(
            "memory",
            f"{recovered} step(s) recovered under {how}, cap {limited[0]['caps'][1]};"
            f" |param - one process| {error:.2e}",
            ">= 1 recovered, <= 2 x even + 1e-6",
            recovered >= 1 and error <= 2 * even_error + 1e-6,
        )
    ]


def _check_nvml(runner: _Runner, args: argparse.Namespace) -> list[dict[str, Any]]:
    if runner.accelerator != "cuda":
        return [_row("nvml", "no GPU: the GPU metrics are NaN by design", "finite on a GPU", None)]
    job = runner(1, kind="timing", factor=1.0, host_time=False, steps=args.timing_steps)[0]
    metrics = job["gpu_metrics"]
    finite = all(value == value for value in metrics.values())  # NaN != NaN
    shown = ", ".join(f"{k} {v:.1f}" for k, v in metrics.items())
    return [_row("nvml", shown, "all finite", finite)]


# --------------------------------------------------------------------------------------------- one job


def _job(spec: dict[str, Any]) -> dict[str, Any]:
    """One rank of a job: trains and returns what the check reads (rank 0's is the one read for timings)."""
    import torch
    from lightning.pytorch import Callback, Trainer

    from lightning_dynamix.bench.timing import timed_trainer
    from lightning_dynamix.callbacks import ClusterMetricsMonitor, DynamixCallback, HeterogeneityEmulator
    from lightning_dynamix.data.workloads import ClassificationDataModule, ClassificationTask
    from lightning_dynamix.metrics import HostClock
    from lightning_dynamix.strategies import HeterogeneousDDPStrategy

    world, kind, accelerator = spec["world"], spec["kind"], spec["accelerator"]
    rank = int(os.environ.get("NODE_RANK", "0"))
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // max(world, 1)))
    if accelerator == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    # a plan moves samples between ranks, never the global batch: one process trains the same global batches
    plan = {int(step): sizes for step, sizes in spec.get("plan", {}).items()} if world > 1 else {}
    sizes = spec.get("sizes") or ([64] if world == 1 else [32, 32])
    if kind == "pid":
        sizes = [32, 32]

    class Plan(Callback):
        """The sizes the check asks for, from the given steps on; the step clock on the host where asked."""

        def setup(self, trainer: Trainer, pl_module: Any, stage: str) -> None:
            if spec.get("host_time"):
                trainer.strategy.enable_step_clock(time_source=HostClock())

        def on_train_batch_end(self, trainer: Trainer, pl_module: Any, outputs: Any, batch: Any, idx: int) -> None:
            wanted = plan.get(trainer.global_step)
            if wanted is not None and trainer.global_step > 0:
                trainer.strategy.set_batch_sizes(wanted)

    callbacks: list[Any] = [Plan()]
    limit = spec.get("memory_limit")
    if kind == "timing":
        callbacks.append(HeterogeneityEmulator([spec["factor"]]))
        monitor: Any = ClusterMetricsMonitor(interval=5, warmup_steps=5, gradient_noise_scale=False)
        callbacks.append(monitor)
    elif kind == "pid":
        callbacks.append(HeterogeneityEmulator([1.0, 3.0]))
        monitor = DynamixCallback("pid", interval=5, warmup_steps=5)
        callbacks.append(monitor)
    elif limit is not None and accelerator != "cuda":
        callbacks.append(HeterogeneityEmulator([1.0] * world, memory_limits=[None, limit]))
    if limit is not None and accelerator == "cuda" and rank == 1:
        torch.cuda.set_per_process_memory_fraction(_fraction_for(limit), 0)
    strategy = HeterogeneousDDPStrategy(
        batch_sizes=sizes,
        seed=1,
        process_group_backend="nccl" if kind == "pid" and accelerator == "cuda" else "gloo",
        timeout=timedelta(seconds=120),
    )
    trainer = timed_trainer(
        strategy, spec["steps"], callbacks, accelerator, num_nodes=world, precision=spec.get("precision", "32-true")
    )
    data = ClassificationDataModule(num_samples=NUM_SAMPLES, num_features=FEATURES, batch_size=sizes[0], seed=0)
    task = ClassificationTask(num_features=FEATURES, hidden=HIDDEN[accelerator], depth=2, seed=0, lr=0.05)
    trainer.fit(task, datamodule=data)
    result: dict[str, Any] = {
        "rank": rank,
        "recovered": strategy.steps_recovered_from_out_of_memory,
        "caps": strategy.current_batch_size_caps,
        "params": {k: v.detach().double().cpu().flatten().tolist() for k, v in task.state_dict().items()},
    }
    if kind in ("timing", "pid"):
        states = [record.state for record in monitor.history][1:]  # the first interval: still settling
        own = [s.workers[0].compute_time for s in states]
        result["compute_time"] = statistics.median(own) if own else float("nan")
        last = states[-3:]
        result["throughput_to_ideal"] = (
            statistics.median(s.throughput / s.ideal_throughput for s in last) if last else float("nan")
        )
        worker = states[-1].workers[0] if states else None
        names = ("gpu_util", "gpu_mem_util", "gpu_power_w", "gpu_temperature_c")
        result["gpu_metrics"] = {n: getattr(worker, n) if worker else float("nan") for n in names}
    if kind != "train":
        result.pop("params")
    return result


def _fraction_for(samples: int) -> float:
    """The memory fraction of GPU 0 that holds about ``samples`` samples of the bench's model besides its state."""
    import torch
    from torch import nn

    hidden = HIDDEN["cuda"]
    model = nn.Sequential(nn.Linear(FEATURES, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU())
    model = nn.Sequential(*model, nn.Linear(hidden, 10)).cuda()
    torch.cuda.reset_peak_memory_stats()
    peaks = []
    for batch in (64, 128):
        model(torch.randn(batch, FEATURES, device="cuda")).sum().backward()
        peaks.append(torch.cuda.max_memory_reserved())
    per_sample = max(1.0, (peaks[1] - peaks[0]) / 64)
    base = peaks[0] - 64 * per_sample
    total = torch.cuda.get_device_properties(0).total_memory
    del model
    torch.cuda.empty_cache()
    return min(1.0, (base + 3 * per_sample * samples) / total)


def main() -> None:
    parser = argparse.ArgumentParser(description="one job of dynamix bench device")
    parser.add_argument("--job", required=True, help="the job's spec, as JSON")
    spec = json.loads(parser.parse_args().job)
    result = _job(spec)
    Path(spec["out"], f"{spec['name']}-{result['rank']}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
