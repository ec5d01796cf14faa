"""Short runs whose per-rank sizes follow a given sequence, ranks sitting out (0) and coming back.

The tasks of ``test_sit_out_sequences.py``, run on every rank of a :class:`~tests.distributed.pool.RankPool`:
:func:`lightning` trains :class:`common.Net` with ``Trainer.fit`` and ``HeterogeneousDDPStrategy``,
:func:`accelerate` the same network in a plain loop with ``DynamixAccelerate``. Each returns the rank's
batches (epoch, step, sample indices), its final parameters and how many groups of training ranks
its process holds.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
import torchmetrics
from common import IndexedDataset, Net, Recorder, VirtualCompute, make_network, make_optimizer, quiet_trainer
from lightning.pytorch import Callback
from torch.utils.data import DataLoader

from lightning_dynamix import HeterogeneousDDPStrategy
from lightning_dynamix.distributed import training_ranks_groups


class LoggingNet(Net):
    """:class:`common.Net` that also logs epoch-level values whose reduction over the ranks is known exactly.

    From ``training_step`` (ranks that sit a step out do not run it): a mean of 1, the samples (a
    sum, and a torchmetrics ``SumMetric``), the largest and smallest sample index and the mean index
    (also logged per step); from ``on_train_batch_end`` (every rank) a mean of 1. Over an epoch of
    ``n`` samples they reduce to ``1``, ``n``, ``n``, ``n - 1``, ``0``, ``(n - 1) / 2`` and ``1``.
    """

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.samples = torchmetrics.SumMetric()

    def training_step(self, batch, batch_idx):
        index = batch[0].double()
        epoch = dict(on_step=False, on_epoch=True, sync_dist=True, batch_size=len(index))
        self.log("trained", 1.0, **epoch)  # a rank that trains logs it before every_rank, one that sat out never
        self.log("index_max", index.max(), reduce_fx="max", **epoch)
        self.log("index_min", index.min(), reduce_fx="min", **epoch)
        self.log("index_mean", index.mean(), **{**epoch, "on_step": True})
        self.log("samples", float(len(index)), reduce_fx="sum", **epoch)
        self.samples.update(len(index))
        self.log("samples_metric", self.samples, on_step=False, on_epoch=True)
        return super().training_step(batch, batch_idx)

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.log("every_rank", 1.0, on_step=False, on_epoch=True, sync_dist=True, batch_size=1)


class EpochMetrics(Callback):
    """The epoch-level values every rank ends each training epoch with."""

    def __init__(self) -> None:
        self.epochs: list[dict[str, float]] = []

    def on_train_epoch_end(self, trainer, pl_module):
        metrics = trainer.callback_metrics
        names = ("trained", "every_rank", "index_max", "index_min", "index_mean_epoch", "samples", "samples_metric")
        self.epochs.append({name: float(metrics[name]) for name in names})


class StepResizer(Callback):
    """Calls ``strategy.set_batch_sizes(sizes)`` after the training batch ``at`` (counted over the whole fit)."""

    def __init__(self, plan: list[tuple[int, list[int]]]) -> None:
        self.plan = dict((at, sizes) for at, sizes in plan)
        self.batches = 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        sizes = self.plan.get(self.batches)
        self.batches += 1
        if sizes is not None:
            trainer.strategy.set_batch_sizes(sizes)


def lightning(
    first: list[int],
    plan: list[tuple[int, list[int]]],
    optimizer: str,
    accumulate: int,
    find_unused_parameters: bool,
    num_samples: int,
    epochs: int,
    timeout: float,
    seed: int,
) -> dict:
    """``Trainer.fit`` from sizes ``first``; ``plan``: (training batch, sizes) decided after that batch."""
    recorder, epoch_metrics = Recorder(), EpochMetrics()
    strategy = HeterogeneousDDPStrategy(
        batch_sizes=first,
        min_batch_size=0,
        seed=seed,
        timeout=timedelta(seconds=timeout),
        find_unused_parameters=find_unused_parameters,
    )
    trainer = quiet_trainer(
        devices=len(first),
        strategy=strategy,
        accumulate_grad_batches=accumulate,
        callbacks=[recorder, StepResizer(plan), epoch_metrics],
        max_epochs=epochs,
        limit_val_batches=1,
    )
    model = LoggingNet(optimizer=optimizer, num_samples=num_samples)
    trainer.fit(model)
    return {
        "steps": recorder.steps,
        "epoch_metrics": epoch_metrics.epochs,
        "params": {k: v.detach().clone() for k, v in model.net.state_dict().items()},
        "groups_held": len(training_ranks_groups()),
        "groups_created": training_ranks_groups().created,
        "group_timeouts": sorted(
            {
                group._get_backend(torch.device("cpu")).options._timeout.total_seconds()
                for group in training_ranks_groups()._groups.values()
                if group != dist.GroupMember.NON_GROUP_MEMBER
            }
        ),
    }


def accelerate(
    first: list[int],
    plan: list[tuple[int, list[int]]],
    optimizer: str,
    accumulate: int,
    num_samples: int,
    epochs: int,
    seed: int,
) -> dict:
    """The same under ``DynamixAccelerate``: a rank that sits a step out back-propagates ``zero_loss()``."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    from lightning_dynamix.integrations.accelerate import DynamixAccelerate

    # a new Accelerator per task in a process that keeps its process group
    AcceleratorState._reset_state()
    GradientState._reset_state()
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=accumulate)
    dynamix = DynamixAccelerate(accelerator, batch_sizes=first, min_batch_size=0, seed=seed)
    network = make_network(0)
    model, opt, loader = dynamix.prepare(
        network,
        make_optimizer(optimizer, network.parameters()),
        DataLoader(IndexedDataset(num_samples), batch_size=4, shuffle=True),
    )
    decisions = dict((at, sizes) for at, sizes in plan)
    steps, batches = [], 0
    for epoch in range(epochs):
        for step, batch in enumerate(loader):
            with accelerator.accumulate(model):
                if dynamix.sits_out:
                    steps.append((epoch, step, []))
                    loss = dynamix.zero_loss()
                else:
                    index, x, y = batch
                    steps.append((epoch, step, index.tolist()))
                    loss = F.cross_entropy(model(x), y)
                dynamix.backward(loss)
                opt.step()
                opt.zero_grad()
            dynamix.step(loss)
            if batches in decisions:
                dynamix.set_batch_sizes(decisions[batches])
            batches += 1
    dist.barrier()  # every rank finished with the model before the next task builds another
    return {"steps": steps, "params": {k: v.detach().clone() for k, v in network.state_dict().items()}}


def controller_moves_the_sitting_rank(
    num_samples: int, epochs: int, schedule: list[list[float]], timeout: float
) -> dict:
    """``DynamixCallback("pid", min_batch_size=0)`` on 3 ranks; each rank in turn computes ``factor`` times slower
    (:class:`VirtualCompute`: on a virtual clock, so the controller's decisions never depend on this machine)."""
    from lightning_dynamix.callbacks import DynamixCallback

    recorder = Recorder()
    strategy = HeterogeneousDDPStrategy(batch_sizes=[8, 8, 8], min_batch_size=0, timeout=timedelta(seconds=timeout))
    dynamix = DynamixCallback("pid", interval=2, warmup_steps=2, min_batch_size=0, log_per_rank=False)
    compute = VirtualCompute(seconds_per_sample=1e-3, schedule=schedule)
    trainer = quiet_trainer(
        devices=3, strategy=strategy, callbacks=[compute, recorder, dynamix], max_epochs=epochs, limit_val_batches=0
    )
    model = Net(optimizer="sgd", num_samples=num_samples)
    trainer.fit(model)
    return {
        "steps": recorder.steps,
        "params": {k: v.detach().clone() for k, v in model.net.state_dict().items()},
        "decisions": [list(record.decision.batch_sizes) for record in dynamix.history],
    }


def groups_bounded(sets: list[list[int]], capacity: int) -> dict:
    """Cycles through ``sets`` of training ranks with a :class:`TrainingRanksGroups` of ``capacity``: the sum of
    every member's rank over its group, and how many groups the process held after each set."""
    from lightning_dynamix.distributed import TrainingRanksGroups

    groups = TrainingRanksGroups(capacity=capacity)
    sums, held = [], []
    for ranks in sets:
        sizes = [1 if r in ranks else 0 for r in range(dist.get_world_size())]
        group = groups.prepare(sizes, timedelta(seconds=20))
        if group is not None:
            value = torch.tensor([float(dist.get_rank())])
            dist.all_reduce(value, group=groups.group(sizes, timedelta(seconds=20)))
            sums.append(float(value))
        else:
            sums.append(None)
        held.append(len(groups))
    return {"sums": sums, "held": held, "created": groups.created}
