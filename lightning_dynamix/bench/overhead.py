"""``dynamix bench overhead``: what the package costs where it has nothing to balance.

HeterogeneousDDPStrategy with equal sizes against Lightning's ddp (optionally with DynamixCallback or
PreemptionCheckpoint, whose own time is measured inside the runs), ``--sharded``: HeterogeneousFSDPStrategy against
Lightning's ModelParallelStrategy (plain FSDP2), or ``--fault-tolerant``: FaultTolerantStrategy replicas against
HeterogeneousDDPStrategy nodes; in interleaved rounds (:mod:`lightning_dynamix.bench.rounds`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Literal

import torch
from lightning.pytorch import Trainer
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy

from lightning_dynamix import DynamixCallback, PreemptionCheckpoint
from lightning_dynamix._stats import bootstrap_median_interval
from lightning_dynamix.bench.harness import is_launcher_rank_zero
from lightning_dynamix.bench.records import arguments_record, machine_description
from lightning_dynamix.bench.rounds import interleaved_rounds
from lightning_dynamix.bench.sharded import ShardedDemoClassifier
from lightning_dynamix.bench.timing import StepTimer
from lightning_dynamix.data.synthetic import DemoClassifier
from lightning_dynamix.distributed import free_port
from lightning_dynamix.metrics import StepClock
from lightning_dynamix.metrics.system import CpuQuota
from lightning_dynamix.strategies import HeterogeneousDDPStrategy, HeterogeneousFSDPStrategy

NUM_CLASSES = 10


def add_job_arguments(parser: argparse.ArgumentParser) -> None:
    """The job both benchmarks time: processes, and an MLP with its batch size."""
    parser.add_argument("--devices", type=int, default=2, help="processes (default 2)")
    parser.add_argument("--batch-size", type=int, default=128, help="batch size of every rank (default 128)")
    parser.add_argument("--features", type=int, default=512, help="input features (default 512)")
    parser.add_argument("--hidden", type=int, default=1024, help="width of the hidden layers (default 1024)")
    parser.add_argument("--output", type=Path, default=None, help="also write the results as JSON here")


def network_name(args: argparse.Namespace) -> str:
    return f"MLP {args.features}-{args.hidden}-{args.hidden}-{NUM_CLASSES}"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of ``dynamix bench overhead``."""
    add_job_arguments(parser)
    parser.add_argument("--rounds", type=int, default=20, help="back-to-back pairs of runs (default 20)")
    parser.add_argument("--steps", type=int, default=60, help="timed steps per run (default 60)")
    parser.add_argument("--warmup", type=int, default=10, help="untimed steps at the start of each run (default 10)")
    parser.add_argument(
        "--with-callback",
        action="store_true",
        help="add DynamixCallback (pid, a decision every --interval steps) to the heterogeneous_ddp runs",
    )
    parser.add_argument("--interval", type=int, default=10, help="steps per decision with --with-callback")
    parser.add_argument(
        "--fault-tolerant",
        action="store_true",
        help="instead: FaultTolerantStrategy (torchft replicas meeting at a lighthouse, no failures) against"
        " HeterogeneousDDPStrategy with equal sizes, each process started by the bench as a node of its own",
    )
    parser.add_argument(
        "--sharded",
        action="store_true",
        help="instead: HeterogeneousFSDPStrategy with equal sizes against Lightning's ModelParallelStrategy (plain"
        " FSDP2), the MLP sharded with fully_shard on each layer",
    )
    parser.add_argument(
        "--with-preemption",
        action="store_true",
        help="add PreemptionCheckpoint (a check for a notice every step: one all-reduce) to the heterogeneous_ddp runs",
    )


_PER_STEP_HOOKS = (
    "on_train_batch_start",
    "on_before_backward",
    "on_after_backward",
    "on_before_optimizer_step",
    "on_before_zero_grad",
    "on_train_batch_end",
)


class CallbackCost:
    """Wall time spent inside one DynamixCallback's per-step hooks, split into decision steps and the others.

    Wraps the instance's hook methods (the callback's code is unchanged). A step counts as a
    decision step when the callback's ``history`` grew during it.
    """

    def __init__(self, callback: DynamixCallback) -> None:
        self.callback = callback
        self.ordinary: list[float] = []
        self.decisions: list[float] = []
        self._current = 0.0
        for name in _PER_STEP_HOOKS:
            setattr(callback, name, self._timed(getattr(callback, name), name == "on_train_batch_end"))

    def _timed(self, hook: Any, closes_step: bool) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            decided_before = len(self.callback.history)
            start = time.perf_counter()
            out = hook(*args, **kwargs)
            self._current += time.perf_counter() - start
            if closes_step:
                (self.decisions if len(self.callback.history) > decided_before else self.ordinary).append(self._current)
                self._current = 0.0
            return out

        return timed

    def per_step(self, interval: int) -> float:
        """Seconds per step: the median ordinary step's cost plus the median decision's spread over ``interval``."""
        ordinary = statistics.median(self.ordinary) if self.ordinary else 0.0
        decision = statistics.median(self.decisions) if self.decisions else 0.0
        return ordinary + decision / interval


class HookCost:
    """Wall time of every call to one hook of a callback instance (its code unchanged), seconds."""

    def __init__(self, callback: Any, name: str) -> None:
        self.seconds: list[float] = []
        hook = getattr(callback, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return hook(*args, **kwargs)
            finally:
                self.seconds.append(time.perf_counter() - start)

        setattr(callback, name, timed)


def step_clock_cost(
    steps: int = 20000, buckets: int = 2, cpu_quota: CpuQuota | Literal["find"] | None = "find"
) -> float:
    """Seconds per step of the StepClock calls made outside the callback (loader, comm hook, backward).

    ``cpu_quota`` as :class:`~lightning_dynamix.metrics.StepClock` takes it: by default the calling
    process's, whose CPU-time counter the clock reads twice a step.
    """
    clock = StepClock(cpu_quota=cpu_quota)
    start = time.perf_counter()
    for _ in range(steps):
        clock.data_start()
        clock.data_end(128)
        for _ in range(buckets):
            clock.bucket_done(clock.bucket_ready(4096))
        clock.backward_end()
        clock.step_end()
    return (time.perf_counter() - start) / steps


def _median_step(strategy: object, args: argparse.Namespace, extra_callbacks: list[Any] | None = None) -> float:
    timer = StepTimer(warmup=args.warmup)
    trainer = Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=strategy,
        max_steps=args.warmup + args.steps,
        logger=False,
        callbacks=[timer, *(extra_callbacks or [])],
        # a PreemptionCheckpoint is a ModelCheckpoint, which Lightning refuses with checkpointing off
        enable_checkpointing=any(isinstance(c, PreemptionCheckpoint) for c in extra_callbacks or []),
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    # no per-step synchronised logging: Lightning's own sync adds a barrier that would hide our costs
    model = (ShardedDemoClassifier if args.sharded else DemoClassifier)(
        num_samples=8192,
        num_features=args.features,
        num_classes=NUM_CLASSES,
        hidden=args.hidden,
        batch_size=args.batch_size,
        sync_dist=False,
    )
    trainer.fit(model)
    # the job's step time: every rank waits for the slowest in the all-reduce
    return max(t.median_step_seconds for t in timer.timings)


def _fault_tolerant_job_step(variant: str, args: argparse.Namespace, out: Path, name: str) -> float:
    """One job of ``--fault-tolerant``: ``args.devices`` processes started here; the slowest's median step, seconds."""
    import subprocess
    import sys

    from lightning_dynamix.bench.cluster import node_environment
    from lightning_dynamix.distributed import job_environment
    from lightning_dynamix.distributed.fault_tolerance import Lighthouse

    job = [str(x) for x in (args.steps, args.warmup, args.batch_size, args.features, args.hidden, args.devices)]
    with contextlib.ExitStack() as stack:
        lighthouse = stack.enter_context(Lighthouse(min_replicas=args.devices)) if variant == "torchft" else None
        port = free_port()
        processes = []
        for rank in range(args.devices):
            # one thread per process in both (Lightning's DDP would give a node of one process every core)
            if lighthouse is not None:
                env = job_environment(TORCHFT_LIGHTHOUSE=lighthouse.address, REPLICA_GROUP_ID=f"replica-{rank}")
            else:
                env = node_environment(rank, args.devices, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            env["OMP_NUM_THREADS"] = "1"
            command = [sys.executable, "-m", "lightning_dynamix.bench.overhead_worker"]
            command += [str(out / f"{name}-{rank}.json"), variant, *job]
            log = stack.enter_context((out / f"{name}-{rank}.log").open("w"))
            processes.append(subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT))
        codes = [process.wait(timeout=600) for process in processes]
    if any(codes):
        logs = "\n".join(
            (out / f"{name}-{rank}.log").read_text(errors="replace")[-2000:] for rank in range(args.devices)
        )
        raise RuntimeError(f"dynamix bench overhead --fault-tolerant: {variant} exited with {codes}\n{logs}")
    return max(
        json.loads((out / f"{name}-{rank}.json").read_text())["median_step_seconds"] for rank in range(args.devices)
    )


def _run_fault_tolerant(args: argparse.Namespace) -> None:
    """FaultTolerantStrategy against HeterogeneousDDPStrategy, equal sizes, no failures, alternating ABBA."""
    with tempfile.TemporaryDirectory(prefix="dynamix-bench-overhead-") as tmp:
        steps = interleaved_rounds(
            ("heterogeneous_ddp", "torchft"),
            args.rounds,
            lambda variant, index: _fault_tolerant_job_step(variant, args, Path(tmp), f"{variant}-{index}"),
        )
    ddp_steps, ft_steps = steps["heterogeneous_ddp"], steps["torchft"]
    ratios = [ft / ddp for ft, ddp in zip(ft_steps, ddp_steps, strict=True)]
    low, high = bootstrap_median_interval(ratios)
    result = {
        "benchmark": "overhead",
        "variant": "fault_tolerant (torchft) against heterogeneous_ddp",
        "median_ratio": statistics.median(ratios),
        "median_ratio_95ci": [low, high],
        "ratios": ratios,
        "median_step_ms_heterogeneous_ddp": 1e3 * statistics.median(ddp_steps),
        "median_step_ms_fault_tolerant": 1e3 * statistics.median(ft_steps),
        "config": arguments_record(args),
        "machine": machine_description(),
    }
    print(
        f"\ndynamix bench overhead --fault-tolerant: {args.devices} processes (gloo, CPU), batch {args.batch_size}"
        f" per rank, {network_name(args)}, {args.rounds} rounds of {args.steps} timed steps"
    )
    print(f"{'round':>5}  {'heterogeneous_ddp (ms/step)':>27}  {'fault_tolerant (ms/step)':>24}  {'ratio':>6}")
    for i, (ddp, ft, ratio) in enumerate(zip(ddp_steps, ft_steps, ratios)):
        print(f"{i:>5}  {1e3 * ddp:>27.2f}  {1e3 * ft:>24.2f}  {ratio:>6.3f}")
    print(
        f"median step-time ratio fault_tolerant / heterogeneous_ddp: {result['median_ratio']:.3f}"
        f" (95% bootstrap interval {low:.3f} to {high:.3f}; goal <= 1.03)"
    )
    if args.output is not None:
        args.output.write_text(json.dumps(result, indent=2))


def run(args: argparse.Namespace) -> None:
    """Plain Lightning DDP against HeterogeneousDDPStrategy with equal sizes, alternating ABBA."""
    if args.sharded and (args.fault_tolerant or args.with_preemption):
        raise SystemExit("dynamix bench overhead: --sharded runs neither --fault-tolerant nor --with-preemption")
    if args.fault_tolerant:
        if args.with_callback or args.with_preemption:
            raise SystemExit(
                "dynamix bench overhead: --fault-tolerant runs neither --with-callback nor --with-preemption"
            )
        _run_fault_tolerant(args)
        return
    torch.set_num_threads(1)  # one thread per process: two processes competing for each core blur the difference
    costs: list[float] = []  # the callback's own seconds per step, rank 0, one per run with it
    checks: list[float] = []  # PreemptionCheckpoint's seconds per step (its all-reduce), rank 0, one per run

    def measure(variant: str, _: int) -> float:
        if variant == "ddp":
            plain = ModelParallelStrategy(args.devices, 1) if args.sharded else DDPStrategy()
            return _median_step(plain, args)
        callbacks: list[Any] = []
        cost = check = None
        if args.with_callback:
            callbacks = [DynamixCallback("pid", interval=args.interval, warmup_steps=args.warmup)]
            cost = CallbackCost(callbacks[0])
        if args.with_preemption:
            # nothing is written there unless a rank gets SIGTERM during the benchmark
            preemption = PreemptionCheckpoint(dirpath=Path(tempfile.gettempdir()) / "dynamix-bench-preemption")
            check = HookCost(preemption, "on_train_batch_end")
            callbacks.append(preemption)
        ours = HeterogeneousFSDPStrategy if args.sharded else HeterogeneousDDPStrategy
        step = _median_step(ours(batch_sizes=[args.batch_size] * args.devices), args, callbacks)
        if cost is not None:
            costs.append(cost.per_step(args.interval))
        if check is not None:
            checks.append(statistics.median(check.seconds[args.warmup :]))
        return step

    steps = interleaved_rounds(("ddp", "ours"), args.rounds, measure)
    plain_steps, ours_steps = steps["ddp"], steps["ours"]
    ratios = [ours / plain for ours, plain in zip(ours_steps, plain_steps, strict=True)]
    if not is_launcher_rank_zero():
        return
    low, high = bootstrap_median_interval(ratios)
    plain_name = "fsdp2" if args.sharded else "ddp"
    ours_name = ("heterogeneous_fsdp" if args.sharded else "heterogeneous_ddp") + (
        " + DynamixCallback" if args.with_callback else ""
    )
    ours_name += " + PreemptionCheckpoint" if args.with_preemption else ""
    result = {
        "benchmark": "overhead",
        "variant": ours_name,
        "median_ratio": statistics.median(ratios),
        "median_ratio_95ci": [low, high],
        "ratios": ratios,
        f"median_step_ms_{plain_name}": 1e3 * statistics.median(plain_steps),
        f"median_step_ms_{ours_name.split()[0]}": 1e3 * statistics.median(ours_steps),
        "config": arguments_record(args),
        "machine": machine_description(),
    }
    print(
        f"\ndynamix bench overhead: {args.devices} processes (gloo, CPU), batch {args.batch_size} per rank,"
        f" {network_name(args)}, {args.rounds} rounds of {args.steps} timed steps"
    )
    header = f"{ours_name} (ms/step)"
    plain_header = f"{plain_name} (ms/step)"
    print(f"{'round':>5}  {plain_header:>13}  {header:>{len(header)}}  {'ratio':>6}")
    for i, (plain, ours, ratio) in enumerate(zip(plain_steps, ours_steps, ratios)):
        print(f"{i:>5}  {1e3 * plain:>13.2f}  {1e3 * ours:>{len(header)}.2f}  {ratio:>6.3f}")
    goal = 1.02 if args.with_callback or args.sharded else 1.01
    print(
        f"median step-time ratio {ours_name} / {plain_name}: {result['median_ratio']:.3f}"
        f" (95% bootstrap interval {low:.3f} to {high:.3f}; goal <= {goal});"
        f" median steps {1e3 * statistics.median(plain_steps):.2f} ms vs {1e3 * statistics.median(ours_steps):.2f} ms"
    )
    if args.with_callback:
        clock = step_clock_cost()
        callback = statistics.median(costs)
        step = statistics.median(plain_steps)
        result["callback_ms_per_step"] = 1e3 * callback
        result["step_clock_ms_per_step"] = 1e3 * clock
        result["callback_cost_fraction_of_ddp_step"] = (callback + clock) / step
        print(
            f"the callback's own work, measured inside the runs (rank 0): {1e3 * callback:.3f} ms per step in its"
            f" hooks (decisions included, spread over {args.interval} steps) + {1e3 * clock:.3f} ms of step-clock"
            f" calls = {100 * (callback + clock) / step:.2f}% of the median ddp step (goal <= 2%)"
        )
    if args.with_preemption:
        check = statistics.median(checks)
        result["preemption_check_ms_per_step"] = 1e3 * check
        result["preemption_check_fraction_of_ddp_step"] = check / statistics.median(plain_steps)
        print(
            f"PreemptionCheckpoint's check for a notice, measured inside the runs (rank 0): {1e3 * check:.3f} ms per"
            f" step = {100 * result['preemption_check_fraction_of_ddp_step']:.2f}% of the median ddp step"
        )
    if args.output is not None:
        args.output.write_text(json.dumps(result, indent=2))
