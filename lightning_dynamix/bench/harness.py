"""The run harness of ``dynamix demo`` and ``dynamix bench balance|tta``: one heterogeneous training run.

One run trains the built-in classification workload on ``len(speeds)`` processes, one rank per
process, with :class:`~lightning_dynamix.callbacks.HeterogeneityEmulator` making rank ``r``
``speeds[r]`` times slower (or real contention, :mod:`lightning_dynamix.bench.contention`), and a
:class:`~lightning_dynamix.callbacks.DynamixCallback` with the chosen controller (``"static"``
measures the same way and never changes a size). It records the
callback's gathered states, the validation accuracy against training time (validation itself
excluded), and what the run achieved.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

from lightning.pytorch import Callback, LightningDataModule, LightningModule, Trainer
from lightning.pytorch.loggers import CSVLogger
from typing_extensions import override

from lightning_dynamix.bench import contention
from lightning_dynamix.bench.cluster import node_environment
from lightning_dynamix.bench.load import HOSTS_ENV, LoadChange, LoadSchedule
from lightning_dynamix.bench.sharded import ShardedClassificationTask
from lightning_dynamix.callbacks import DynamixCallback, HeterogeneityEmulator
from lightning_dynamix.data.images import ImageClassificationDataModule
from lightning_dynamix.data.items import LabelTokens
from lightning_dynamix.data.workloads import ClassificationDataModule, ClassificationTask
from lightning_dynamix.strategies import HeterogeneousDDPStrategy, HeterogeneousFSDPStrategy


@dataclass(frozen=True)
class RunConfig:
    """One run: the cluster, the controller and the training budget.

    Attributes:
        controller: ``"static"``, ``"pid"`` or ``"goodput"``.
        speeds: slowdown factor per rank (1.0 = the rank's own speed); one process per entry.
        contention: how the ranks are made slow: ``"emulate"`` (the emulator's sleeps), ``"busy"``,
            ``"quota"`` or ``"threads"`` (:mod:`lightning_dynamix.bench.contention`; the launching
            process must hold a :class:`~lightning_dynamix.bench.contention.Contention` around the runs).
        batch_size: every rank's initial batch size (samples).
        batch_sizes: each rank's initial batch size instead (one per rank), e.g. a fixed split to
            measure with ``controller="static"``.
        epochs: training epochs (the budget every controller gets: the same data).
        max_steps: stop after this many optimizer steps instead (-1: no limit).
        interval: optimizer steps between decisions.
        warmup_steps: steps before the first measured interval.
        lr: learning rate at the initial global batch.
        lr_scaling: rule for the learning rate when the global batch changes.
        target_accuracy: validation accuracy whose first crossing is the time to accuracy.
        val_checks_per_epoch: validations per epoch (time to accuracy is resolved this finely).
        seed: seed of the data, the initial weights and the training order.
        schedule: ``(step, rank, factor)`` speed changes during the run.
        max_batch_size: the largest batch size a rank may be given.
        min_batch_size: the smallest batch size a rank may be given (0: a straggler may sit out); ``None``: the
            strategy's default (1, or 2 for a model with BatchNorm).
        keep_global_batch: the controller only moves samples between ranks (``goodput`` and ``ppo``
            keep the initial global batch instead of choosing one); ``pid`` always keeps it.
        hidden: width of the classifier's hidden layers (the transformer's model width).
        architecture: ``"mlp"``, ``"transformer"`` or ``"resnet"``
            (:class:`~lightning_dynamix.data.workloads.ClassificationTask`; the resnet trains on the images of
            :class:`~lightning_dynamix.data.images.ImageClassificationDataModule`), or ``"causal-lm"``
            (:class:`~lightning_dynamix.data.language_task.CausalLanguageTask` on token sequences of 4-39 tokens,
            gradients weighted by tokens: ``count_items=LabelTokens()``).
        sync_batchnorm: the Trainer's ``sync_batchnorm``: BatchNorm over the global batch.
        depth: hidden layers of the MLP, encoder layers of the transformer.
        optimizer: ``"sgd"`` (momentum 0.9) or ``"adam"``.
        num_samples: training samples per epoch.
        log_dir: write the callback's ``dynamix/...`` metrics with a ``CSVLogger`` to
            ``log_dir/<controller>/metrics.csv`` (what ``dynamix report`` reads); ``None``: no logs.
        load_changes: changes of the ranks' machines at given steps (:mod:`lightning_dynamix.bench.load`:
            co-tenants that arrive and leave, CPU quotas, link rates), each applied by its rank.
        pid_max_global_batch: ``pid``'s ``max_global_batch_size``: it may grow the global batch up to this many
            samples while the all-reduce bounds the step; ``None``: it keeps the global batch.
        links: each rank's host link rate in Mbit/s (``None``: no limit): every rank then runs on a host of its
            own (:class:`~lightning_dynamix.bench.hosts.Hosts`, needs root), launched by the calling process;
            ``None``: the ranks share this machine's loopback, launched by Lightning.
        group_by_length: ``causal-lm``: the strategy's ``group_by_length`` (batches of alike lengths); ``None``: not.
        target_loss: time to target is to this validation loss instead of ``target_accuracy``; ``None``: accuracy.
        sharded: train the classification workload sharded with FSDP2 under ``HeterogeneousFSDPStrategy``
            (:mod:`lightning_dynamix.bench.sharded`; ``sync_batchnorm`` then converts its BatchNorm layers before
            ``fully_shard``); ``False``: ``HeterogeneousDDPStrategy``.
        streaming_dir: the classification workload's training split is read from the LitData dataset there
            (:mod:`lightning_dynamix.bench.streamed`, written for seed 0); ``None``: in memory, map-style.
        streaming_in_order: read each chunk's samples in the chunk's own order (``shuffle_within_chunks=False``).
    """

    controller: str = "pid"
    speeds: tuple[float, ...] = (1.0, 3.0)
    contention: str = "emulate"
    batch_size: int = 64
    batch_sizes: tuple[int, ...] | None = None
    epochs: int = 4
    max_steps: int = -1
    interval: int = 5
    warmup_steps: int = 5
    lr: float = 0.05
    lr_scaling: str = "none"
    target_accuracy: float = 0.85
    val_checks_per_epoch: int = 4
    seed: int = 0
    schedule: tuple[tuple[int, int, float], ...] = ()
    max_batch_size: int = 1024
    min_batch_size: int | None = None
    keep_global_batch: bool = False
    hidden: int = 768
    architecture: str = "mlp"
    sync_batchnorm: bool = False
    depth: int = 2
    optimizer: str = "sgd"
    num_samples: int = 16384
    log_dir: str | None = None
    links: tuple[float | None, ...] | None = None
    load_changes: tuple[LoadChange, ...] = ()
    pid_max_global_batch: int | None = None
    group_by_length: int | None = None
    target_loss: float | None = None
    sharded: bool = False
    streaming_dir: str | None = None
    streaming_in_order: bool = False


_HOST_RANK = "DYNAMIX_BENCH_HOST_RANK"  # set in a rank launched on a host: its rank


@dataclass
class RunResult:
    """What one run achieved (times in seconds of training, validation excluded).

    Attributes:
        throughput_to_ideal: median over the measured intervals of achieved samples/s divided by
            the ideal ``sum_r s_r`` measured in the same interval (the exposed all-reduce included:
            :attr:`~lightning_dynamix.metrics.ClusterState.ideal_throughput`).
        work_to_ideal: the same in work (``causal-lm``: token positions per second); NaN where it was not counted.
        network_share: median over the measured intervals of the all-reduce's share of the ideal step
            (:attr:`~lightning_dynamix.metrics.ClusterState.network_share`).
        time_to_target: training seconds until validation accuracy first reached the target
            (``None`` if it never did).
        final_accuracy: validation accuracy at the end.
        intervals: per decision: step, training seconds, sizes, per-rank step and compute times,
            throughput, ideal throughput.
        accuracy: per validation: training seconds, step, accuracy.
    """

    config: dict[str, Any]
    train_seconds: float
    steps: int
    samples: int
    throughput_to_ideal: float
    time_to_target: float | None
    final_accuracy: float
    intervals: list[dict[str, Any]] = field(default_factory=list)
    work_to_ideal: float = math.nan
    accuracy: list[dict[str, float]] = field(default_factory=list)
    network_share: float = math.nan

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class TrainingClock(Callback):
    """Training time without validation, and the validation accuracy at each check."""

    def __init__(self) -> None:
        self.points: list[dict[str, float]] = []
        self.train_seconds = 0.0
        self.samples = 0
        self._start = 0.0
        self._validation_seconds = 0.0
        self._validation_start: float | None = None
        self._validations: list[tuple[float, float]] = []  # (seconds since start at its end, validation so far)

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._start = time.perf_counter()

    @override
    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not trainer.sanity_checking:
            self._validation_start = time.perf_counter()

    @override
    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._validation_start is None:
            return
        now = time.perf_counter()
        self._validation_seconds += now - self._validation_start
        self._validation_start = None
        self._validations.append((now - self._start, self._validation_seconds))
        metrics = trainer.callback_metrics
        point = {"seconds": self.elapsed(now), "step": trainer.global_step, "accuracy": float(metrics["val_acc"])}
        if "val_loss" in metrics:
            point["loss"] = float(metrics["val_loss"])
        self.points.append(point)

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        sizes = getattr(trainer.strategy, "current_batch_sizes", None)
        if sizes:
            self.samples += sum(sizes)

    def training_seconds(self, since_start: float) -> float:
        """Training seconds at ``since_start`` wall seconds after training started (validations before it excluded)."""
        validation = 0.0
        for end, total in self._validations:
            if end <= since_start:
                validation = total
        return since_start - validation

    def elapsed(self, now: float | None = None) -> float:
        """Training seconds so far (validation excluded)."""
        return (time.perf_counter() if now is None else now) - self._start - self._validation_seconds

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.train_seconds = self.elapsed()


def _fixed_global_batch(config: RunConfig) -> dict[str, Any] | None:
    """The goodput or ppo controller's arguments that keep the initial global batch (the others keep it anyway)."""
    if config.controller == "ppo":
        return {"keep_global_batch": True}
    if config.controller != "goodput":
        return None
    total = sum(config.batch_sizes) if config.batch_sizes else config.batch_size * len(config.speeds)
    return {"min_global_batch": total, "max_global_batch": total}


def _controller_kwargs(config: RunConfig) -> dict[str, Any] | None:
    """The controller's arguments the run asks for: a kept global batch, or pid's largest global batch."""
    if config.controller == "pid" and config.pid_max_global_batch is not None:
        return {"max_global_batch_size": config.pid_max_global_batch}
    return _fixed_global_batch(config) if config.keep_global_batch else None


def run(config: RunConfig, on_every_rank: bool = False) -> RunResult | None:
    """Train once; returns the result on global rank 0 and ``None`` on the other ranks.

    With ``on_every_rank`` every rank returns it: the measured intervals are gathered by all ranks,
    so each can take the same next step of a search (the other figures are rank 0's own).
    """
    hosted = _HOST_RANK in os.environ
    language = config.architecture == "causal-lm"
    if config.links is not None and not hosted:
        return _run_on_hosts(config)
    world = len(config.speeds)
    places = contention.plan(config.contention, config.speeds)
    # the emulator: one thread per process, its factors are relative to a rank's own speed, which threads
    # competing for a core would blur; otherwise this rank's cores, threads and cgroup
    rank = int(os.environ[_HOST_RANK] if hosted else os.environ.get("LOCAL_RANK", "0"))
    contention.apply(places, rank)
    slowdown = [HeterogeneityEmulator(list(config.speeds), schedule=list(config.schedule))] if places is None else []
    if config.load_changes:
        slowdown.append(LoadSchedule(config.load_changes, rank))
    dynamix = DynamixCallback(
        config.controller,
        interval=config.interval,
        warmup_steps=config.warmup_steps,
        lr_scaling=config.lr_scaling,
        controller_kwargs=_controller_kwargs(config),
        max_batch_size=config.max_batch_size,
    )
    clock = TrainingClock()
    trainer = Trainer(
        accelerator="cpu",
        devices=1 if hosted else world,  # on hosts: a node each
        num_nodes=world if hosted else 1,
        strategy=(HeterogeneousFSDPStrategy if config.sharded else HeterogeneousDDPStrategy)(
            batch_sizes=list(config.batch_sizes) if config.batch_sizes else [config.batch_size] * world,
            max_batch_size=config.max_batch_size,
            min_batch_size=config.min_batch_size,
            seed=config.seed,
            timeout=timedelta(seconds=120),
            count_items=LabelTokens() if language else None,
            group_by_length=config.group_by_length,
        ),
        max_epochs=config.epochs,
        max_steps=config.max_steps,
        val_check_interval=1.0 / config.val_checks_per_epoch,
        num_sanity_val_steps=0,
        callbacks=[*slowdown, dynamix, clock],
        sync_batchnorm=config.sync_batchnorm and not config.sharded,  # sharded: converted before fully_shard
        logger=False if config.log_dir is None else CSVLogger(config.log_dir, name=config.controller, version=""),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    data, model = _workload(config)
    trainer.fit(model, datamodule=data)
    if not trainer.is_global_zero and not on_every_rank:
        return None
    intervals = []
    for record in dynamix.history:
        state = record.state
        intervals.append(
            {
                "step": record.step,
                "seconds": clock.training_seconds(record.time),
                "batch_sizes": list(state.batch_sizes),
                "next_batch_sizes": list(record.decision.batch_sizes) if record.decision else None,
                "step_time": [w.step_time for w in state.workers],
                "compute_time": [w.compute_time for w in state.workers],
                "data_time": [w.data_time for w in state.workers],
                "sync_wait": [w.sync_wait for w in state.workers],
                "comm_time": [w.comm_time for w in state.workers],
                "cpu_time": [w.cpu_time for w in state.workers],
                "least_sync_wait": [w.least_sync_wait for w in state.workers],
                "throughput": state.throughput,
                "ideal_throughput": state.ideal_throughput,
                "network_share": state.network_share,
                "work": [w.work for w in state.workers],
                "padding": state.padding,
                # work per second (tokens), achieved and ideal: each rank's speed in samples times its work per sample
                "work_throughput": sum(w.work for w in state.workers if w.batch_size > 0) / state.step_time,
                "ideal_work_throughput": sum(
                    s * w.work / w.batch_size for s, w in zip(state.rank_speeds, state.workers) if w.batch_size > 0
                ),
                "gradient_noise_scale": state.gradient_noise_scale,
                "lr": state.lr,
            }
        )
    ratios = [i["throughput"] / i["ideal_throughput"] for i in intervals if i["ideal_throughput"] > 0]
    work_ratios = [
        i["work_throughput"] / i["ideal_work_throughput"] for i in intervals if i["ideal_work_throughput"] > 0
    ]
    shares = [i["network_share"] for i in intervals if math.isfinite(i["network_share"])]
    if config.target_loss is not None:
        target = next((p for p in clock.points if p.get("loss", math.inf) <= config.target_loss), None)
    else:
        target = next((p for p in clock.points if p["accuracy"] >= config.target_accuracy), None)
    return RunResult(
        config=asdict(config),
        train_seconds=clock.train_seconds,
        steps=trainer.global_step,
        samples=clock.samples,
        throughput_to_ideal=statistics.median(ratios) if ratios else math.nan,
        time_to_target=None if target is None else target["seconds"],
        final_accuracy=clock.points[-1]["accuracy"] if clock.points else math.nan,
        intervals=intervals,
        accuracy=clock.points,
        work_to_ideal=statistics.median(work_ratios) if work_ratios else math.nan,
        network_share=statistics.median(shares) if shares else math.nan,
    )


def _workload(config: RunConfig) -> tuple[LightningDataModule, LightningModule]:
    """The run's data and model: the classification workload of its architecture, or the language model."""
    if config.architecture == "causal-lm":
        from lightning_dynamix.data.language_task import CausalLanguageTask, TokenSequenceDataModule

        language_data = TokenSequenceDataModule(
            num_samples=config.num_samples, batch_size=config.batch_size, seed=config.seed
        )
        task = CausalLanguageTask(
            hidden=config.hidden, depth=config.depth, lr=config.lr, optimizer=config.optimizer, seed=config.seed
        )
        return language_data, task
    images = config.architecture == "resnet"
    data_module = ImageClassificationDataModule if images else ClassificationDataModule
    data: LightningDataModule = data_module(
        num_samples=config.num_samples, batch_size=config.batch_size, seed=config.seed
    )
    if config.streaming_dir is not None:
        from lightning_dynamix.bench.streamed import StreamedClassificationDataModule

        if images or config.seed != 0:
            raise ValueError("the streamed training split is the mlp and transformer workloads' of seed 0")
        data = StreamedClassificationDataModule(
            config.streaming_dir,
            in_order=config.streaming_in_order,
            num_samples=config.num_samples,
            batch_size=config.batch_size,
            seed=config.seed,
        )
    model = (ShardedClassificationTask if config.sharded else ClassificationTask)(
        hidden=config.hidden,
        depth=config.depth,
        lr=config.lr,
        optimizer=config.optimizer,  # type: ignore[arg-type]
        architecture=config.architecture,  # type: ignore[arg-type]
        seed=config.seed,
    )
    if isinstance(model, ShardedClassificationTask):
        model.global_batch_norm = config.sync_batchnorm
    return data, model


def _run_on_hosts(config: RunConfig) -> RunResult:
    """:func:`run` with every rank on a host of its own (``config.links``): this process launches the ranks as
    nodes meeting at host 0's address, holds them, and returns rank 0's result."""
    from lightning_dynamix.bench.hosts import Hosts

    world = len(config.speeds)
    assert config.links is not None
    with tempfile.TemporaryDirectory(prefix="dynamix-hosts-") as folder, Hosts(list(config.links)) as hosts:
        out = Path(folder)
        processes = []
        for rank in range(world):
            # the hosts' description: for a schedule's link changes
            env = node_environment(
                rank, world, **hosts.env(rank), **{_HOST_RANK: str(rank), HOSTS_ENV: hosts.description()}
            )
            command = [sys.executable, "-m", "lightning_dynamix.bench.host_rank", json.dumps(asdict(config))]
            command.append(str(out / "result.json"))
            log = open(out / f"rank{rank}.log", "w")  # noqa: SIM115 - closed once the rank ended
            processes.append((hosts.popen(rank, command, env=env, stdout=log, stderr=subprocess.STDOUT), log))
        codes = []
        for process, log in processes:
            codes.append(process.wait())  # a rank that hangs fails its collectives at the strategy's timeout
            log.close()
        if any(codes):
            rank = next(r for r, code in enumerate(codes) if code)
            text = (out / f"rank{rank}.log").read_text()[-4000:]
            raise RuntimeError(f"a run on hosts failed: rank {rank} exited with {codes[rank]}:\n{text}")
        return RunResult(**json.loads((out / "result.json").read_text()))


def samples_per_second(result: RunResult, after_step: int) -> float:
    """The run's achieved samples/s: the median over its measured intervals after ``after_step``."""
    values = [i["throughput"] for i in result.intervals if i["step"] > after_step]
    return statistics.median(values) if values else float("nan")


def is_launcher_rank_zero() -> bool:
    """Whether this process is the one the user started (Lightning's launcher starts the others)."""
    return int(os.environ.get("LOCAL_RANK", "0")) == 0 and int(os.environ.get("NODE_RANK", "0")) == 0
