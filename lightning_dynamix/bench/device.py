"""``dynamix bench device``: one call that checks the device paths on this machine's accelerator.

Every check trains the built-in classifier (``ClassificationTask``) under Lightning in processes of its
own, whose ranks this command launches as nodes of one device each: two ranks share one GPU the way a
machine with one GPU runs them (gloo carries the CUDA tensors, as NCCL refuses two ranks on one device).
A job's fits run one after another in the same processes (a process's start, imports and CUDA context
cost about 20 s on a GPU machine). On a machine without a GPU the same checks run on the CPU. The report
is one table (and JSON), each row also printed and written as its check ends:

How it works, in full: ``docs/internals.md``, section ``lightning_dynamix/bench/device.py``.
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

from lightning_dynamix.bench.cluster import node_environment
from lightning_dynamix.distributed import job_environment

CHECKS = ("exactness", "timing", "pid", "memory", "mixed", "offload", "nvml")
PRECISIONS = ("32-true", "16-mixed", "bf16-mixed")
NUM_SAMPLES, FEATURES = 8192, 64
HIDDEN = {"cpu": 1024, "cuda": 4096}  # steps long enough that a sleep's or a spin's error is small beside them
# the timing and pid checks' samples a step: on a GPU a step bound by the device's work, not by the CPU launching
# its kernels (at 64 samples a large GPU's step is mostly launches around little arithmetic: the device idles
# between kernels, a spin fills those gaps, and a device three times slower would not be; docs/benchmarks/device.md)
TIMING_BATCH = {"cpu": 64, "cuda": 8192}
UNEVEN = {0: [10, 54], 4: [40, 24], 8: [22, 42], 12: [51, 13]}  # step -> sizes (64 a step)
# the memory check: rank 1 trains 2048 then 4096 samples (its steps measure the bytes a sample needs), its
# memory is then limited to about 6144, and it is given 7168 (8192 a step on a GPU: margins of hundreds of MB
# beside the caching allocator's rounding); 64 a step against an emulated limit elsewhere
MEMORY = {
    "cuda": ({0: [6144, 2048], 2: [4096, 4096], 4: [1024, 7168]}, 6144),
    "cpu": ({0: [32, 32], 4: [8, 56]}, 40),
}
OFFLOAD_SETUPS = ("in-process", "1 server", "1 server, staleness 1")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    every = ",".join(CHECKS)
    parser.add_argument("--checks", default=every, help=f"which checks, comma-separated (default {every})")
    parser.add_argument("--accelerator", choices=("auto", "cpu", "cuda"), default="auto", help="default: cuda if any")
    precisions = ",".join(PRECISIONS)
    parser.add_argument("--precisions", default=precisions, help=f"exactness's precisions (default {precisions})")
    parser.add_argument("--steps", type=int, default=16, help="steps of each exactness and memory job (default 16)")
    parser.add_argument("--timing-steps", type=int, default=60, help="steps of each timing job (default 60)")
    parser.add_argument("--budget", type=float, default=240.0, help="seconds one job may take (default 240)")
    parser.add_argument("--offload-rounds", type=int, default=2, help="rounds of the offload check (default 2)")
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
    # each row as its check ends, and the JSON rewritten: a run cut short still reports what it finished
    print(f"dynamix bench device on {card} ({accelerator})", flush=True)
    with tempfile.TemporaryDirectory(prefix="dynamix-device-") as folder:
        out = Path(folder)
        runner = _Runner(out, accelerator, args.budget)
        for check in checks:
            started = time.perf_counter()
            try:
                new = globals()[f"_check_{check}"](runner, args)
            except Exception as error:  # one check's failure is its row; the others still run
                print(f"check {check} failed:\n{error}", file=sys.stderr, flush=True)
                last = str(error).strip().splitlines()[-1][:200] if str(error).strip() else type(error).__name__
                new = [_row(check, f"error: {last}", "runs", False)]
            for row in new:
                row["seconds"] = round(time.perf_counter() - started, 1)
                print(f"{row['check']}: {row['result']} [{row['target']}] {row['verdict']}", flush=True)
            rows += new
            if args.output is not None:
                record = {"machine": machine_description(), "card": card, "config": arguments_record(args)}
                args.output.write_text(json.dumps({**record, "rows": rows}, indent=2))
    print(f"\ndynamix bench device on {card} ({accelerator})")
    print(f"{'check':<24} {'result':<58} {'target':<34} verdict")
    for row in rows:
        print(f"{row['check']:<24} {row['result']:<58} {row['target']:<34} {row['verdict']}")


class _Runner:
    """Launches a job's ranks (one device each, as nodes) and collects what each wrote."""

    def __init__(self, out: Path, accelerator: str, budget: float) -> None:
        self.out, self.accelerator, self.budget = out, accelerator, budget
        self.jobs = 0
        self.timing: dict[str, Any] | None = None  # the timing check's run at factor 1, for nvml

    def __call__(self, world: int, runs: list[dict[str, Any]], **job: Any) -> list[list[dict[str, Any]]]:
        """Each run's result on every rank (``[run][rank]``): the runs are fits one after another in the same
        processes (a process's start, imports and CUDA context cost seconds on a GPU machine); a
        ``RuntimeError`` with the log of a rank that failed or ran past the budget."""
        started = time.perf_counter()
        name, procs = self._launch(world, range(world), runs, job)
        failed = self._wait(procs)
        kinds = ",".join(sorted({run["kind"] for run in runs}))
        took = time.perf_counter() - started
        print(f"  {len(runs)} {kinds} run(s) on {world} rank(s): {took:.1f} s", file=sys.stderr, flush=True)
        if failed is not None:
            rank, code = failed
            text = (self.out / f"{name}-{rank}.log").read_text()[-3000:]
            what = "ran past --budget" if code is None else f"exited with {code}"
            raise RuntimeError(f"{kinds} job, rank {rank} {what}:\n{text}")
        by_rank = [json.loads((self.out / f"{name}-{rank}.json").read_text()) for rank in range(world)]
        return [[results[index] for results in by_rank] for index in range(len(runs))]

    def failure(self, world: int, ranks: list[int], runs: list[dict[str, Any]], **job: Any) -> str:
        """The log of ``ranks`` of a job that must fail (the others not launched); a ``RuntimeError`` if it did not."""
        name, procs = self._launch(world, ranks, runs, job)
        failed = self._wait(procs)
        logs = "".join((self.out / f"{name}-{rank}.log").read_text() for rank in ranks)
        if failed is None or failed[1] is None:
            raise RuntimeError(f"the job on ranks {ranks} was to fail at once, but did not:\n{logs[-3000:]}")
        return logs

    def _launch(
        self, world: int, ranks: Any, runs: list[dict[str, Any]], job: dict[str, Any]
    ) -> tuple[str, list[tuple[int, Any, Any]]]:
        from lightning_dynamix.distributed import free_port

        self.jobs += 1
        name = f"job{self.jobs}"
        spec = dict(job, runs=runs, name=name, world=world, accelerator=self.accelerator, out=str(self.out))
        port = free_port()
        procs = []
        for rank in ranks:
            env = node_environment(rank, world, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            if job.get("gpu_per_rank"):  # each rank's node sees its own GPU as device 0
                env["CUDA_VISIBLE_DEVICES"] = str(rank)
            command = [sys.executable, "-m", "lightning_dynamix.bench.device", "--job", json.dumps(spec)]
            log = open(self.out / f"{name}-{rank}.log", "w")  # noqa: SIM115 - closed in _wait
            procs.append((rank, subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT), log))
        return name, procs

    def _wait(self, procs: list[tuple[int, Any, Any]]) -> tuple[int, int | None] | None:
        """The first rank that failed and its exit code (``None``: past the budget), after every process ended."""
        deadline = time.monotonic() + self.budget
        failed = None
        for rank, proc, log in procs:
            try:
                code = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                code = None
            log.close()
            if code != 0 and failed is None:
                failed = (rank, code)
        if failed is not None:
            for _, proc, _ in procs:
                proc.kill()
                proc.wait()
        return failed


def _timed(*sizes: int) -> dict[str, Any]:
    """A timing or pid run's sizes, and samples for a few steps an epoch."""
    return {"sizes": list(sizes), "num_samples": max(NUM_SAMPLES, 4 * sum(sizes))}


def _row(check: str, result: str, target: str, passed: bool | None) -> dict[str, Any]:
    """A row with a verdict; ``passed=None``: a figure reported without one (the target says where it is judged)."""
    verdict = "figure" if passed is None else ("pass" if passed else "FAIL")
    return {"check": check, "result": result, "target": target, "verdict": verdict}


def _not_run(check: str, reason: str, target: str) -> dict[str, Any]:
    return {"check": check, "result": reason, "target": target, "verdict": "not run"}


def _difference(first: str, second: str) -> float:
    """The largest difference of any parameter between two jobs' saved parameters."""
    import torch

    one, other = torch.load(first), torch.load(second)
    return max(float((one[key].double() - other[key].double()).abs().max()) for key in one)


def _check_exactness(runner: _Runner, args: argparse.Namespace) -> list[dict[str, Any]]:
    rows, precisions = [], []
    for precision in str(args.precisions).split(","):
        if precision == "16-mixed" and runner.accelerator != "cuda":
            rows.append(_not_run(f"exactness {precision}", "float16 autocast with a GradScaler needs CUDA", "-"))
        else:
            precisions.append(precision)
    if not precisions:
        return rows
    common = [dict(kind="train", precision=precision, steps=args.steps) for precision in precisions]
    ones = runner(1, [dict(run, sizes=[64], plan={}) for run in common])
    splits = runner(
        2,
        [dict(run, sizes=sizes, plan=plan) for run in common for sizes, plan in (([32, 32], {}), (UNEVEN[0], UNEVEN))],
    )
    for index, precision in enumerate(precisions):
        one, even, uneven = ones[index][0], splits[2 * index][0], splits[2 * index + 1][0]
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
    cases = [(clock, factor) for clock in ("step clock", "perf_counter") for factor in (1.0, 3.0)]
    batch = TIMING_BATCH[runner.accelerator]
    runs = [
        dict(kind="timing", factor=factor, host_time=clock == "perf_counter", steps=args.timing_steps, **_timed(batch))
        for clock, factor in cases
    ]
    jobs = runner(1, runs)
    runner.timing = jobs[0][0]  # the step clock at factor 1: nvml's metrics
    results = {case: job[0] for case, job in zip(cases, jobs, strict=True)}
    rows = []
    for clock in ("step clock", "perf_counter"):
        slow, own = results[(clock, 3.0)], results[(clock, 1.0)]["compute_time"]
        ratio = slow["compute_time"] / own
        # on a CPU the emulator sleeps, and waking late is multiplied too: the target is the GPU's spin kernel
        judged = clock == "step clock" and runner.accelerator == "cuda"
        passed = abs(ratio - 3.0) <= 0.3 if judged else None
        target = "within 10% of 3 (on a GPU)" if clock == "step clock" else "(beside it: host timing)"
        result = f"compute ratio {ratio:.2f} ({own * 1e3:.2f} ms at 1x)"
        spin = slow.get("spin")
        if clock == "step clock" and spin:  # the spin kernel itself, timed with events of its own
            result += f"; a spin asked {spin['asked'] * 1e3:.2f} ms ran {spin['ran'] * 1e3:.2f} ms"
        rows.append(_row(f"timing 1:3, {clock}", result, target, passed))
    return rows


def _check_pid(runner: _Runner, args: argparse.Namespace) -> list[dict[str, Any]]:
    import torch

    if runner.accelerator == "cuda" and torch.cuda.device_count() < 2:
        reason = "needs two GPUs: two ranks on one GPU share its time"
        return [_not_run("pid 1:3", reason, ">= 0.95 of ideal")]
    clocks = ("step clock", "perf_counter")
    half = TIMING_BATCH[runner.accelerator] // 2
    runs = [
        dict(kind="pid", host_time=clock == "perf_counter", steps=args.timing_steps * 4, **_timed(half, half))
        for clock in clocks
    ]
    cuda = runner.accelerator == "cuda"
    # a GPU each (NCCL refuses two ranks on one device); gloo on a CPU
    jobs = runner(2, runs, backend="nccl" if cuda else None, gpu_per_rank=cuda)
    rows = []
    for clock, job in zip(clocks, jobs, strict=True):
        fraction = job[0]["throughput_to_ideal"]
        # on a CPU the balance is dynamix bench balance's to judge (the emulator sleeps there)
        passed = fraction >= 0.95 if clock == "step clock" and cuda else None
        result = f"{fraction:.3f} of the ideal sum of speeds"
        rows.append(_row(f"pid 1:3, {clock}", result, ">= 0.95 of ideal (on GPUs)", passed))
    return rows


def _check_memory(runner: _Runner, args: argparse.Namespace) -> list[dict[str, Any]]:
    plan, limit = MEMORY[runner.accelerator]
    total = sum(plan[0])
    common = dict(precision="32-true", steps=args.steps, num_samples=max(NUM_SAMPLES, total * args.steps))
    one = runner(1, [dict(kind="train", sizes=[total], plan={}, **common)])[0][0]
    # the limited run last: a memory fraction stays with the process
    even, limited = runner(
        2,
        [
            dict(kind="train", sizes=[total // 2] * 2, plan={}, **common),
            dict(kind="train", sizes=plan[0], plan=plan, memory_limit=limit, **common),
        ],
    )
    error = _difference(limited[0]["params"], one["params"])
    even_error = _difference(even[0]["params"], one["params"])
    recovered = limited[0]["recovered"]
    how = "a memory fraction" if runner.accelerator == "cuda" else "an emulated limit"
    largest = max(sizes[1] for sizes in plan.values())
    return [
        _row(
            "memory",
            f"{recovered} step(s) recovered under {how} (~{limit} samples, given {largest}), cap"
            f" {limited[0]['caps'][1]}; |param - one process| {error:.2e}, even {even_error:.2e}",
            ">= 1 recovered, <= 2 x even + 1e-6",
            recovered >= 1 and error <= 2 * even_error + 1e-6,
        )
    ]


def _check_mixed(runner: _Runner, args: argparse.Namespace) -> list[dict[str, Any]]:
    target = "nccl refused naming gloo; gloo <= 1e-9"
    if runner.accelerator != "cuda":
        return [_not_run("mixed GPU + CPU", "needs a GPU: a GPU rank beside a CPU rank", target)]
    devices = ["cuda", "cpu"]
    # the CPU rank alone: it refuses before the process group, which the GPU rank would wait on for its timeout
    common = dict(kind="train", precision="64-true", steps=args.steps)
    log = runner.failure(2, [1], [dict(common, sizes=[32, 32], plan={})], devices=devices, backend="nccl")
    refused = "process_group_backend='gloo'" in log
    one = runner(1, [dict(common, sizes=[64], plan={})])[0][0]
    mixed = runner(2, [dict(common, sizes=UNEVEN[0], plan=UNEVEN)], devices=devices)[0][0]
    error = _difference(mixed["params"], one["params"])
    said = "the CPU rank refused nccl naming gloo" if refused else "nccl NOT refused as expected"
    result = f"{said}; gloo, float64: |param - one process on the GPU| {error:.2e}"
    return [_row("mixed GPU + CPU", result, target, refused and error <= 1e-9)]


def _check_offload(runner: _Runner, args: argparse.Namespace) -> list[dict[str, Any]]:
    output = runner.out / "offload.json"
    command = [sys.executable, "-m", "lightning_dynamix.bench.offload", "--skip-memory"]
    command += ["--accelerator", runner.accelerator, "--servers", "1", "--rounds", str(args.offload_rounds)]
    command += ["--steps", "30", "--setups", ";".join(OFFLOAD_SETUPS), "--output", str(output)]
    try:
        proc = subprocess.run(command, capture_output=True, text=True, env=job_environment(), timeout=runner.budget)
    except subprocess.TimeoutExpired:
        raise RuntimeError("offload check ran past --budget") from None
    if proc.returncode != 0:
        raise RuntimeError(f"offload check exited with {proc.returncode}:\n{proc.stderr[-3000:]}")
    speed = json.loads(output.read_text())["speed"]
    where = "on the GPU" if runner.accelerator == "cuda" else "in the trainer"
    base = speed["in-process"]["median_step_ms"]
    parts = [f"tables {where} {base:.2f} ms/step"]
    for name in OFFLOAD_SETUPS[1:]:
        parts.append(f"{name} {speed[name]['median_step_ms']:.2f} ({speed[name]['step_time_vs_in_process']:.2f}x)")
    return [_row("offload DLRM", "; ".join(parts), "figures (bench offload)", None)]


def _check_nvml(runner: _Runner, args: argparse.Namespace) -> list[dict[str, Any]]:
    if runner.accelerator != "cuda":
        return [_not_run("nvml", "no GPU: the GPU metrics are NaN by design", "finite on a GPU")]
    run = dict(kind="timing", factor=1.0, host_time=False, steps=args.timing_steps, **_timed(TIMING_BATCH["cuda"]))
    job = runner.timing or runner(1, [run])[0][0]
    metrics = job["gpu_metrics"]
    finite = all(value == value for value in metrics.values())  # NaN != NaN
    shown = ", ".join(f"{k} {v:.1f}" for k, v in metrics.items())
    return [_row("nvml", shown, "all finite", finite)]


# --------------------------------------------------------------------------------------------- one job


def _job(spec: dict[str, Any]) -> list[dict[str, Any]]:
    """One rank of a job: its runs, fits one after another, and what the checks read of each."""
    import torch

    rank = int(os.environ.get("NODE_RANK", "0"))
    accelerator = spec["devices"][rank] if spec.get("devices") else spec["accelerator"]
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // max(spec["world"], 1)))
    if accelerator == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    return [_fit(spec, dict(run), index, rank, accelerator) for index, run in enumerate(spec["runs"])]


def _fit(job: dict[str, Any], spec: dict[str, Any], index: int, rank: int, accelerator: str) -> dict[str, Any]:
    """One run of a job on this rank: trains and returns what the check reads (rank 0's is read for timings)."""
    import torch
    from lightning.pytorch import Callback, Trainer

    from lightning_dynamix.bench.timing import timed_trainer
    from lightning_dynamix.callbacks import ClusterMetricsMonitor, DynamixCallback, HeterogeneityEmulator
    from lightning_dynamix.data.workloads import ClassificationDataModule, ClassificationTask
    from lightning_dynamix.metrics import HostClock
    from lightning_dynamix.strategies import HeterogeneousDDPStrategy

    world, kind = job["world"], spec["kind"]
    # a plan moves samples between ranks, never the global batch: one process trains the same global batches
    plan = {int(step): sizes for step, sizes in spec.get("plan", {}).items()} if world > 1 else {}
    sizes = spec.get("sizes") or ([64] if world == 1 else [32, 32])

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
    emulator = None
    if kind == "timing":
        emulator = HeterogeneityEmulator([spec["factor"]])
        callbacks.append(emulator)
        monitor: Any = ClusterMetricsMonitor(interval=5, warmup_steps=5, gradient_noise_scale=False)
        callbacks.append(monitor)
    elif kind == "pid":
        callbacks.append(HeterogeneityEmulator([1.0, 3.0]))
        monitor = DynamixCallback("pid", interval=5, warmup_steps=5)
        callbacks.append(monitor)
    elif limit is not None and accelerator != "cuda":
        callbacks.append(HeterogeneityEmulator([1.0] * world, memory_limits=[None, limit]))
    if limit is not None and accelerator == "cuda" and rank == 1:
        callbacks.append(_memory_fraction(limit, plan))
    backend = job.get("backend") or "gloo"
    if accelerator == "cuda":
        torch.cuda.reset_peak_memory_stats()
    strategy = HeterogeneousDDPStrategy(
        batch_sizes=sizes, seed=1, process_group_backend=backend, timeout=timedelta(seconds=120)
    )
    trainer = timed_trainer(
        strategy, spec["steps"], callbacks, accelerator, num_nodes=world, precision=spec.get("precision", "32-true")
    )
    samples = spec.get("num_samples", NUM_SAMPLES)
    data = ClassificationDataModule(num_samples=samples, num_features=FEATURES, batch_size=sizes[0], seed=0)
    task = ClassificationTask(num_features=FEATURES, hidden=HIDDEN[job["accelerator"]], depth=2, seed=0, lr=0.05)
    trainer.fit(task, datamodule=data)
    result: dict[str, Any] = {
        "rank": rank,
        "recovered": strategy.steps_recovered_from_out_of_memory,
        "caps": strategy.current_batch_size_caps,
    }
    if kind == "train":  # a file: the GPU's model has 17M parameters
        result["params"] = str(Path(job["out"], f"{job['name']}-{index}-{rank}.pt"))
        torch.save({k: v.detach().cpu() for k, v in task.state_dict().items()}, result["params"])
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
    if kind == "timing" and accelerator == "cuda":
        result["spin"] = _spin_length(torch.device("cuda", 0), emulator.slept)
    return result


def _spin_length(device: Any, asked: float) -> dict[str, float] | None:
    """The emulator's spin kernel (calibrated anew) asked for ``asked`` seconds, timed with events of its own."""
    import torch

    from lightning_dynamix.callbacks.emulator import CudaSpin

    if asked <= 0:
        return None
    spin = CudaSpin(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    spin.spin(asked)
    end.record()
    end.synchronize()
    return {"asked": asked, "ran": start.elapsed_time(end) / 1000.0, "cycles_per_s": spin.cycles_per_s}


def _memory_fraction(samples: int, plan: dict[int, list[int]]) -> Any:
    """A callback that limits rank 1's GPU memory to about ``samples`` samples a step, from its steps' bytes.

    The plan gives rank 1 two sizes before the step that exceeds ``samples``; the peak bytes the allocator
    held in the steps at each (``max_memory_allocated``) give the bytes a sample costs, and the process's
    memory fraction is set to the peak at the second size plus that many more samples.
    """
    import torch
    from lightning.pytorch import Callback

    steps = sorted(plan)
    first, second = plan[steps[0]][1], plan[steps[1]][1]

    class MemoryFraction(Callback):
        def __init__(self) -> None:
            self.peaks: list[int] = []

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, idx: int) -> None:
            if trainer.global_step not in (steps[1], steps[2]):
                return
            self.peaks.append(torch.cuda.max_memory_allocated())
            torch.cuda.reset_peak_memory_stats()
            if trainer.global_step == steps[2]:
                per_sample = max(1.0, (self.peaks[1] - self.peaks[0]) / (second - first))
                # from the peak of tensors, not what the allocator reserved: cached blocks of earlier steps or runs
                # would hide the limit (where they do, no step runs out of memory)
                wanted = self.peaks[1] + (samples - second) * per_sample
                torch.cuda.empty_cache()
                fraction = min(1.0, wanted / torch.cuda.get_device_properties(0).total_memory)
                torch.cuda.set_per_process_memory_fraction(fraction, 0)
                print(f"memory fraction {fraction:.5f}: {per_sample / 2**10:.1f} KiB a sample", flush=True)

    return MemoryFraction()


def main(argv: list[str] | None = None) -> None:
    """``python -m lightning_dynamix.bench.device [options]``: the check without the ``dynamix`` command's other
    dependencies (gymnasium, stable-baselines3), for a GPU machine's image; with ``--job``, one rank of a job."""
    parser = argparse.ArgumentParser(
        prog="python -m lightning_dynamix.bench.device", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--job", default=None, help=argparse.SUPPRESS)
    add_arguments(parser)
    args = parser.parse_args(argv)
    if args.job is None:
        run(args)
        return
    spec = json.loads(args.job)
    results = _job(spec)
    Path(spec["out"], f"{spec['name']}-{results[0]['rank']}.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main()
