"""``dynamix bench elastic``: what a preemption costs a job under torch elastic, with and without PreemptionCheckpoint.

Three torchrun agents on this machine (one node each, ``--nnodes 2:3``, see
:class:`~lightning_dynamix.bench.cluster.LocalElasticCluster`) train the built-in classification
task with a PID-controlled HeterogeneousDDPStrategy, their speeds emulated (default 1:1:3). Three
scenarios (``--scenarios``) run back to back, each a new job:

How it works, in full: ``docs/internals.md``, section ``lightning_dynamix/bench/elastic.py``.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from lightning_dynamix._stats import median_or
from lightning_dynamix.bench.arguments import floats
from lightning_dynamix.bench.cluster import LocalElasticCluster
from lightning_dynamix.bench.hosts import Hosts, HostsUnavailable, check_hosts, describe_links, parse_links
from lightning_dynamix.bench.records import arguments_record, machine_description
from lightning_dynamix.bench.rounds import interleaved_rounds
from lightning_dynamix.distributed import job_environment

SCENARIOS = {  # key on the command line: (name in the results, what the worker does on a change of nodes)
    "never": ("never preempted", None),
    "preemption": ("PreemptionCheckpoint", "preemption"),
    "periodic": ("periodic (Lightning's default)", "periodic"),
    "torchft": ("per-step (torchft)", "torchft"),
}
RESTART_SCENARIOS = ("never", "preemption", "periodic")  # the default: torch elastic's


def _scenarios(text: str) -> list[str]:
    names = [name.strip() for name in text.split(",")]
    unknown = [name for name in names if name not in SCENARIOS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown scenario(s) {unknown} in {text!r}; valid: {', '.join(SCENARIOS)}")
    return names


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--speeds", type=floats, default=(1.0, 1.0, 3.0), help="speed of each node (default 1,1,3)")
    parser.add_argument("--epochs", type=int, default=8, help="training epochs (default 8)")
    parser.add_argument("--num-samples", type=int, default=16384, help="training samples per epoch (default 16384)")
    parser.add_argument("--batch-size", type=int, default=128, help="initial batch size of every rank (default 128)")
    parser.add_argument("--hidden", type=int, default=768, help="width of the classifier's layers (default 768)")
    parser.add_argument("--lr", type=float, default=0.1, help="learning rate (default 0.1)")
    parser.add_argument("--interval", type=int, default=5, help="optimizer steps per PID decision (default 5)")
    parser.add_argument("--val-checks", type=int, default=4, help="validations per epoch (default 4)")
    parser.add_argument("--target", type=float, default=0.8, help="target validation accuracy (default 0.8)")
    parser.add_argument(
        "--preempt-at",
        type=float,
        default=2.625,
        help="the fastest node gets its notice at this epoch (a fraction, in full global batches per epoch:"
        " 2.625 = 5/8 into epoch 2, half-way between two of Lightning's periodic checkpoints at 4 validations"
        " per epoch; default 2.625)",
    )
    parser.add_argument(
        "--back-at", type=float, default=4.375, help="the node starts again when the job reaches this epoch (4.375)"
    )
    parser.add_argument(
        "--scenarios",
        type=_scenarios,
        default=list(RESTART_SCENARIOS),
        help=f"comma-separated, run in this order each round, of {','.join(SCENARIOS)}"
        f" (default {','.join(RESTART_SCENARIOS)})",
    )
    parser.add_argument(
        "--signal",
        choices=("term", "kill"),
        default="term",
        help="what the preempted node gets: term (a notice, SIGTERM) or kill (SIGKILL, no notice); default term",
    )
    parser.add_argument(
        "--heartbeat-timeout",
        type=float,
        default=0.5,
        help="per-step (torchft): seconds without a replica's heartbeat before the lighthouse drops it (0.5)",
    )
    parser.add_argument("--rounds", type=int, default=1, help="times each scenario runs, interleaved (default 1)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the data, weights and order (default 0)")
    parser.add_argument("--workdir", type=Path, default=None, help="keep the jobs' logs and timelines here")
    parser.add_argument("--output", type=Path, default=None, help="also write the results as JSON here")
    parser.add_argument(
        "--links",
        default=None,
        help="put each node on a host of its own (network namespaces, root) with this link rate, Mbit/s, one a node"
        " (0 or -: no limit), e.g. 1000,1000,50; the rendezvous store on a host of its own (default: loopback)",
    )


def _check(args: argparse.Namespace) -> None:
    if len(args.speeds) < 2 or any(s <= 0 for s in args.speeds):
        raise SystemExit(f"--speeds must give at least 2 positive speeds (one node each), got {args.speeds}")
    if not 0 < args.preempt_at < args.back_at < args.epochs:
        raise SystemExit(
            f"need 0 < --preempt-at < --back-at < --epochs, got {args.preempt_at}, {args.back_at}, {args.epochs}"
        )
    for name in ("rounds", "epochs", "num_samples", "batch_size", "val_checks", "interval"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.heartbeat_timeout <= 0:
        raise SystemExit(f"--heartbeat-timeout must be > 0 seconds, got {args.heartbeat_timeout}")
    if args.links is not None and "torchft" in args.scenarios:
        raise SystemExit("dynamix bench elastic: --links is not supported with the torchft scenario yet")
    if args.links is not None:
        try:
            args.links = parse_links(args.links, len(args.speeds))
            check_hosts()
        except (ValueError, HostsUnavailable) as error:
            raise SystemExit(f"dynamix bench elastic: {error}") from None


def _timeline(out: Path) -> list[dict[str, Any]]:
    path = out / "timeline"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def _wait_for_step(out: Path, cluster: LocalElasticCluster, step: int, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(e["event"] == "step" and e["step"] >= step for e in _timeline(out)):
            return
        if all(node.poll() is not None for node in cluster.nodes.values()):
            break
        time.sleep(0.05)
    logs = "\n".join(f"--- {name}\n{cluster.log(name)[-2000:]}" for name in cluster.nodes)
    raise RuntimeError(f"the job did not reach step {step}\n{logs}")


def run_scenario(args: argparse.Namespace, mode: str | None, out: Path, run_id: str) -> dict[str, Any]:
    """One job: the nodes start, the fastest may be preempted and come back; returns what the timeline shows."""
    names = [f"node-{i}" for i in range(len(args.speeds))]
    fastest = names[max(range(len(names)), key=lambda i: args.speeds[i])]
    out.mkdir(parents=True, exist_ok=True)
    config = {
        "mode": mode or "preemption",
        "slowdowns": {name: max(args.speeds) / s for name, s in zip(names, args.speeds, strict=True)},
        "epochs": args.epochs,
        "num_samples": args.num_samples,
        "batch_size": args.batch_size,
        "hidden": args.hidden,
        "lr": args.lr,
        "interval": args.interval,
        "val_checks_per_epoch": args.val_checks,
        "seed": args.seed,
        "timeout": 60,
        "speeds": dict(zip(names, args.speeds, strict=True)),
        "ft_timeout": 10.0,
    }
    (out / "config.json").write_text(json.dumps(config))
    steps_per_epoch = args.num_samples // (len(names) * args.batch_size)
    preempt_step = round(args.preempt_at * steps_per_epoch)
    back_step = round(args.back_at * steps_per_epoch)
    events: dict[str, float] = {}
    if mode == "torchft":
        return _run_replicas(args, out, names, fastest, preempt_step, back_step)
    nnodes = f"{len(names) - 1}:{len(names)}"
    command = ["-m", "lightning_dynamix.bench.elastic_worker", str(out)]
    with contextlib.ExitStack() as stack:
        hosts = None if args.links is None else stack.enter_context(Hosts([*args.links, None]))  # the store's host
        cluster = stack.enter_context(LocalElasticCluster(command, out, nnodes=nnodes, run_id=run_id, hosts=hosts))
        cluster.add_nodes(names)
        if mode is not None:
            _wait_for_step(out, cluster, preempt_step)
            events["notice"] = time.time()
            cluster.preempt(fastest, signal.SIGKILL if args.signal == "kill" else signal.SIGTERM)
            _wait_for_step(out, cluster, back_step)
            events["back"] = time.time()
            cluster.add_node(fastest)
        codes = cluster.wait(names, timeout=900)
        if mode is not None and codes[fastest] != 0 and "RendezvousClosedError" in cluster.log(fastest):
            codes[fastest] = 0  # the job had ended before the node came back: reported as such
            events["back_too_late"] = 1.0
        if any(code != 0 for code in codes.values()):
            logs = "\n".join(f"--- {name}\n{cluster.log(name)[-2000:]}" for name in names)
            raise RuntimeError(f"{run_id}: agents exited with {codes}\n{logs}")
    return summarise(_timeline(out), events, args.target)


def _run_replicas(
    args: argparse.Namespace, out: Path, names: list[str], fastest: str, preempt_step: int, back_step: int
) -> dict[str, Any]:
    """The torchft scenario: a lighthouse here, one replica process per node (see the module docstring)."""
    from lightning_dynamix.distributed.fault_tolerance import Lighthouse

    events: dict[str, float] = {}
    processes: dict[str, subprocess.Popen] = {}
    with Lighthouse(min_replicas=1, heartbeat_timeout=args.heartbeat_timeout) as lighthouse:
        env = job_environment(TORCHFT_LIGHTHOUSE=lighthouse.address)

        def start(name: str, attempt: int) -> None:
            with (out / f"{name}.{attempt}.log").open("w") as log:
                processes[name] = subprocess.Popen(
                    [sys.executable, "-m", "lightning_dynamix.bench.elastic_worker", str(out), name],
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )

        try:
            for name in names:
                start(name, 1)
            _wait_for_steps(out, processes, preempt_step)
            events["notice"] = time.time()
            processes[fastest].send_signal(signal.SIGKILL if args.signal == "kill" else signal.SIGTERM)
            processes[fastest].wait(timeout=60)
            _wait_for_steps(out, processes, back_step)
            events["back"] = time.time()
            start(fastest, 2)
            codes = {name: processes[name].wait(timeout=900) for name in names}
        finally:
            for process in processes.values():
                if process.poll() is None:
                    process.kill()
    if any(code != 0 for code in codes.values()):
        logs = "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-2000:]}" for p in sorted(out.glob("*.log")))
        raise RuntimeError(f"torchft replicas exited with {codes}\n{logs}")
    return summarise_replicas(_timeline(out), events, args.target, len(names))


def _wait_for_steps(out: Path, processes: dict[str, subprocess.Popen], step: int, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(e["event"] == "step" and e["step"] >= step for e in _timeline(out)):
            return
        if all(process.poll() is not None for process in processes.values()):
            break
        time.sleep(0.05)
    raise RuntimeError(f"the replicas did not reach step {step}; logs in {out}")


def summarise_replicas(
    timeline: list[dict[str, Any]], events: dict[str, float], target: float, nodes: int
) -> dict[str, Any]:
    """The torchft scenario's figures, as :func:`summarise` gives torch elastic's: nothing is restored from a
    file, so no committed step is lost; ``steps_trained_again`` is the most steps a replica saw fail (not
    committed, trained again), and the pauses are read from the committed steps' times."""
    steps = sorted((e for e in timeline if e["event"] == "step"), key=lambda e: e["t"])
    first = {}  # each committed step's first report
    for e in steps:
        first.setdefault(e["step"], e)
    committed = sorted(first.values(), key=lambda e: e["t"])
    t0 = committed[0]["t"]
    result: dict[str, Any] = {
        "launches": [[nodes, 0]],
        "steps": committed[-1]["step"],
        "steps_lost": 0,
        "steps_trained_again": max((e.get("failed", 0) for e in steps), default=0),
        "seconds_to_end": committed[-1]["t"] - t0,
    }
    if "notice" in events:
        notice, back = events["notice"], events["back"]
        before = [e for e in committed if e["t"] <= notice]
        reached = before[-1]["step"] if before else 0
        after = [e for e in committed if e["t"] > notice]
        # the first step committed without the node: the survivors training again
        alone = next((e for e in after if e["world"] < nodes), None)
        result["notice_to_training"] = None if alone is None else alone["t"] - notice
        caught_up = next((e for e in after if e["step"] > reached), None)
        result["notice_to_step_reached"] = None if caught_up is None else caught_up["t"] - notice
        on_all = next((e for e in committed if e["t"] > back and e["world"] == nodes), None)
        result["back_to_training_on_all"] = None if on_all is None else on_all["t"] - back
        # what the others saw: the longest wait between two committed steps, up to the first one without the
        # node and up to the first one with it again, beside the median wait
        times = [e["t"] for e in committed]
        gaps = [b - a for a, b in itertools.pairwise(times)]
        result["median_step_seconds"] = statistics.median(gaps) if gaps else None

        def longest_wait(since: float, until: dict[str, Any] | None) -> float | None:
            if until is None:
                return None
            return max((b - a for a, b in itertools.pairwise(times) if b > since and b <= until["t"]), default=None)

        result["pause_on_leave"] = longest_wait(notice, alone)
        result["pause_on_join"] = longest_wait(back, on_all)
        result["back_after_the_end"] = on_all is None
        result["launches"] = [[nodes, 0], [nodes - 1, reached], [nodes, None if on_all is None else on_all["step"]]]
    validations = [e for e in timeline if e["event"] == "val"]
    reached_target = next((e for e in validations if e["accuracy"] >= target), None)
    result["time_to_target"] = None if reached_target is None else reached_target["t"] - t0
    result["final_accuracy"] = validations[-1]["accuracy"] if validations else None
    return result


def summarise(timeline: list[dict[str, Any]], events: dict[str, float], target: float) -> dict[str, Any]:
    """Work lost, recovery times and time to accuracy from a job's timeline (see the module's docstring)."""
    starts = [i for i, e in enumerate(timeline) if e["event"] == "start"]
    launches = [timeline[i:j] for i, j in zip(starts, [*starts[1:], len(timeline)], strict=True)]
    steps = [e for e in timeline if e["event"] == "step"]
    t0 = steps[0]["t"]
    lost = 0
    for launch, following in itertools.pairwise(launches):
        trained = [e["step"] for e in launch if e["event"] == "step"]
        lost += max(0, max(trained, default=following[0]["step"]) - following[0]["step"])
    result: dict[str, Any] = {
        "launches": [[launch[0]["world"], launch[0]["step"]] for launch in launches],
        "steps": steps[-1]["step"],
        "steps_lost": lost,
        "seconds_to_end": steps[-1]["t"] - t0,
    }

    def first_step_of_a_launch_after(moment: float, world: int | None = None) -> float | None:
        for launch in launches:
            if launch[0]["t"] > moment and world in (None, launch[0]["world"]):
                return next((e["t"] for e in launch if e["event"] == "step"), None)
        return None

    if "notice" in events:
        notice, back = events["notice"], events["back"]
        # the step the group had reached when it stopped (a launch may train a step or two after the notice)
        stopped = next(launch for launch in reversed(launches) if launch[0]["t"] <= notice)
        reached = max(e["step"] for e in stopped if e["event"] == "step")
        training = first_step_of_a_launch_after(notice)
        on_all = first_step_of_a_launch_after(back, world=launches[0][0]["world"])
        result["notice_to_training"] = None if training is None else training - notice
        caught_up = next(e["t"] for e in steps if e["t"] > stopped[-1]["t"] and e["step"] > reached)
        result["notice_to_step_reached"] = caught_up - notice
        result["back_to_training_on_all"] = None if on_all is None else on_all - back
        result["back_after_the_end"] = "back_too_late" in events
    validations = [e for e in timeline if e["event"] == "val"]
    reached_target = next((e for e in validations if e["accuracy"] >= target), None)
    result["time_to_target"] = None if reached_target is None else reached_target["t"] - t0
    result["final_accuracy"] = validations[-1]["accuracy"] if validations else None
    return result


def run(args: argparse.Namespace) -> None:
    _check(args)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="dynamix-bench-elastic-"))

    def measure(key: str, index: int) -> dict[str, Any]:
        name, mode = SCENARIOS[key]
        run_id = f"bench-elastic-{index}-{key}-{time.time_ns()}"
        result = run_scenario(args, mode, workdir / f"round{index}-{key}", run_id)
        print(f"round {index + 1}/{args.rounds}, {name}: {json.dumps(result)}", flush=True)
        return result

    results = {
        SCENARIOS[key][0]: runs for key, runs in interleaved_rounds(args.scenarios, args.rounds, measure).items()
    }
    summary = {
        "machine": machine_description(),
        "config": arguments_record(args),
        "workdir": str(workdir),
        "runs": results,
    }
    if args.output is not None:
        args.output.write_text(json.dumps(summary, indent=2))
    _print_table(results, args)


def _median(runs: list[dict[str, Any]], key: str) -> float | None:
    return median_or(r.get(key) for r in runs)


def _print_table(results: dict[str, list[dict[str, Any]]], args: argparse.Namespace) -> None:
    def cell(value: float | None, digits: int = 1) -> str:
        return "-" if value is None else f"{value:.{digits}f}"

    speeds = ":".join(f"{s:g}" for s in args.speeds)
    links = "" if args.links is None else f" {describe_links(args.links)},"
    print(
        f"\nspeeds {speeds},{links} {args.epochs} epochs, target accuracy {args.target};"
        f" medians of {args.rounds} round(s)"
    )
    print(
        "| scenario | steps lost | notice -> training (s) | notice -> back at its step (s) |"
        " node back -> training on all (s) | time to target (s) | time to end (s) | final accuracy |"
    )
    print("|---|---|---|---|---|---|---|---|")
    notes = []
    for name, runs in results.items():
        late = sum(bool(r.get("back_after_the_end")) for r in runs)
        if late:
            notes.append(f"{name}: in {late} of {len(runs)} runs the job ended before the node was back")
        reached = sum(r["time_to_target"] is not None for r in runs)
        print(
            f"| {name} | {cell(_median(runs, 'steps_lost'), 0)} | {cell(_median(runs, 'notice_to_training'))} |"
            f" {cell(_median(runs, 'notice_to_step_reached'))} | {cell(_median(runs, 'back_to_training_on_all'))} |"
            f" {cell(_median(runs, 'time_to_target'))} ({reached}/{len(runs)}) |"
            f" {cell(_median(runs, 'seconds_to_end'))} | {cell(_median(runs, 'final_accuracy'), 3)} |"
        )
    for name, runs in results.items():
        if any("pause_on_leave" in r for r in runs):
            leave, join = cell(_median(runs, "pause_on_leave"), 2), cell(_median(runs, "pause_on_join"), 2)
            step = cell(_median(runs, "median_step_seconds"), 3)
            again = cell(_median(runs, "steps_trained_again"), 0)
            print(
                f"{name}: the others' longest wait between two committed steps: {leave} s at the leave,"
                f" {join} s at the join; a step took {step} s; steps trained again: {again} (medians)"
            )
    for note in notes:
        print(note)
