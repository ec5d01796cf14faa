"""Pieces shared by the multi-process job scripts and the tests that check their results.

A job script runs under Lightning's own launcher (``python job.py`` with ``Trainer(devices=N)``):
rank 0 starts the other ranks by running the same command. Every rank writes what it saw to
files; the test compares them with one process training on the concatenated global batches.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from lightning.pytorch import Callback, LightningModule, Trainer
from torch import nn
from torch.utils.data import DataLoader, Dataset

from lightning_dynamix import EmptyBatch

NUM_FEATURES, NUM_CLASSES = 4, 3


class IndexedDataset(Dataset):
    """Random float64 classification data that also returns each sample's index."""

    def __init__(self, num_samples: int, seed: int = 0) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.x = torch.randn(num_samples, NUM_FEATURES, generator=generator, dtype=torch.float64)
        self.y = torch.randint(NUM_CLASSES, (num_samples,), generator=generator)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, index: int):
        return torch.tensor(index), self.x[index], self.y[index]


def make_network(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(NUM_FEATURES, 8), nn.Tanh(), nn.Linear(8, NUM_CLASSES)).double()


def batch_norm_network(seed: int) -> nn.Module:
    """4 features as a 1x2x2 image: a convolution and BatchNorm2d, then a linear layer and BatchNorm1d."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Unflatten(1, (1, 2, 2)),
        nn.Conv2d(1, 3, kernel_size=1),
        nn.BatchNorm2d(3),
        nn.Tanh(),
        nn.Flatten(),
        nn.Linear(12, 6),
        nn.BatchNorm1d(6, momentum=None),  # a cumulative average: num_batches_tracked must count alike
        nn.Tanh(),
        nn.Linear(6, 3),
    ).double()


def make_optimizer(name: str, params):
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    if name == "sgd-small":  # for losses summed over samples
        return torch.optim.SGD(params, lr=0.005, momentum=0.9)
    if name == "adam":
        return torch.optim.Adam(params, lr=0.01)
    raise ValueError(name)


class Net(LightningModule):
    """``reduction``: how the training loss combines a batch; ``manual``: manual optimisation."""

    def __init__(
        self,
        optimizer: str = "sgd",
        num_samples: int = 150,
        num_workers: int = 0,
        seed: int = 0,
        reduction: str = "mean",
        manual: bool = False,
    ):
        super().__init__()
        self.net = make_network(seed)
        self.optimizer_name = optimizer
        self.num_samples = num_samples
        self.num_workers = num_workers
        self.reduction = reduction
        self.automatic_optimization = not manual

    def training_step(self, batch, batch_idx):
        _, x, y = batch
        logits = self.net(x)
        self.log("probe_loss", F.cross_entropy(logits, y), sync_dist=True, on_step=True, on_epoch=False)
        loss = F.cross_entropy(logits, y, reduction=self.reduction)
        if not self.automatic_optimization:
            opt = self.optimizers()
            opt.zero_grad()
            self.manual_backward(loss)
            opt.step()
        return loss

    def validation_step(self, batch, batch_idx):
        _, x, y = batch
        self.log("val_loss", F.cross_entropy(self.net(x), y), sync_dist=True)

    def configure_optimizers(self):
        return make_optimizer(self.optimizer_name, self.parameters())

    def train_dataloader(self):
        return DataLoader(
            IndexedDataset(self.num_samples),
            batch_size=4,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
        )

    def val_dataloader(self):
        return DataLoader(IndexedDataset(40, seed=1), batch_size=8)


class Recorder(Callback):
    """Records, per training batch, the epoch, batch index, sample indices and the synced probe.

    A step the rank sits out (an :class:`EmptyBatch`) has no indices and no probe of its own (``None``).
    ``weights`` holds the sum of this rank's parameters after each batch, ``validated`` at the first
    batch of each validation.
    """

    def __init__(self) -> None:
        self.steps: list[tuple[int, int, list[int]]] = []
        self.probes: list[float] = []
        self.weights: list[float] = []
        self.validated: list[float] = []

    @staticmethod
    def _weight_sum(module) -> float:
        return sum(float(p.detach().double().sum()) for p in module.parameters())

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
        if batch_idx == 0 and not trainer.sanity_checking:
            self.validated.append(self._weight_sum(pl_module))

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        indices = [] if isinstance(batch, EmptyBatch) else batch[0].tolist()
        self.steps.append((trainer.current_epoch, batch_idx, indices))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        sat_out = isinstance(batch, EmptyBatch)
        self.probes.append(None if sat_out else float(trainer.callback_metrics["probe_loss"]))
        self.weights.append(self._weight_sum(pl_module))


class Resizer(Callback):
    """Calls ``strategy.set_batch_sizes`` after given (epoch, batch_idx) batches, on every rank.

    A batch index of -1 means the last batch of the epoch.
    """

    def __init__(self, plan: dict[tuple[int, int], list[int]]) -> None:
        self.plan = plan

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        sizes = self.plan.get((trainer.current_epoch, batch_idx))
        if batch_idx == trainer.num_training_batches - 1:
            sizes = sizes or self.plan.get((trainer.current_epoch, -1))
        if sizes is not None:
            trainer.strategy.set_batch_sizes(sizes)


# (epoch, batch_idx) -> global batch decided after that batch (-1: the epoch's last batch); (0, 3) is
# decided before the mid-epoch checkpoint at step 5 and, with workers prefetching, may apply after it
REGROUP_PLAN = {(0, 3): 15, (0, 7): 11, (0, -1): 13, (1, 2): 16}


def uneven(total: int, ranks: int) -> list[int]:
    """``total`` in proportion to 1, 2, 3, ... (largest remainders): a split no resume would guess."""
    weights = list(range(1, ranks + 1))
    sizes = [max(1, total * w // sum(weights)) for w in weights]
    sizes[-1] += total - sum(sizes)
    return sizes


def quiet_trainer(**kwargs) -> Trainer:
    defaults = dict(
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        precision="64-true",
    )
    defaults.update(kwargs)
    return Trainer(**defaults)


def reference_training(steps_by_rank, num_samples, optimizer, accumulate, seed=0, reduction="mean"):
    """One process trains on the concatenated global batches; returns final params and per-step losses.

    ``steps_by_rank[r]`` is rank r's list of (epoch, batch_idx, indices).
    """
    world_size = len(steps_by_rank)
    global_steps = []
    for k in range(len(steps_by_rank[0])):
        epoch, batch_idx, _ = steps_by_rank[0][k]
        assert all(steps_by_rank[r][k][:2] == (epoch, batch_idx) for r in range(world_size))
        global_steps.append((epoch, batch_idx, [i for r in range(world_size) for i in steps_by_rank[r][k][2]]))
    return train_one_process(global_steps, num_samples, optimizer, accumulate, seed, reduction)


def train_one_process(global_steps, num_samples, optimizer, accumulate=1, seed=0, reduction="mean"):
    """One process trains on ``global_steps``, a list of (epoch, batch_idx, indices); returns params and losses.

    A window of ``accumulate`` batches (cut short at an epoch's end, as Lightning does) is one
    optimizer step on the loss (mean or sum) over every sample of the window.
    """
    dataset = IndexedDataset(num_samples)
    network = make_network(seed)
    opt = make_optimizer(optimizer, network.parameters())
    epoch_lengths: dict[int, int] = {}
    for epoch, _, _ in global_steps:
        epoch_lengths[epoch] = epoch_lengths.get(epoch, 0) + 1
    probes, window = [], []
    for epoch, batch_idx, indices in global_steps:
        idx = torch.tensor(indices)
        with torch.no_grad():
            probes.append(float(F.cross_entropy(network(dataset.x[idx]), dataset.y[idx])))
        window.extend(indices)
        if (batch_idx + 1) % accumulate == 0 or batch_idx + 1 == epoch_lengths[epoch]:
            idx = torch.tensor(window)
            opt.zero_grad()
            F.cross_entropy(network(dataset.x[idx]), dataset.y[idx], reduction=reduction).backward()
            opt.step()
            window = []
    return {k: v.detach() for k, v in network.state_dict().items()}, probes


class VirtualCompute(Callback):
    """Every rank's step clock reads a virtual time that only its compute moves: ``seconds_per_sample`` times its
    samples times the rank's factor of the moment (``schedule``: ``(step, rank, factor)`` from that optimizer step
    on), so that what the controller measures, and so decides, is the same on every run whatever the machine's load.
    A wait for another rank costs no virtual time: a rank's step is its own compute.
    """

    def __init__(self, seconds_per_sample: float, schedule: list[list[float]]) -> None:
        self.seconds_per_sample = seconds_per_sample
        self.schedule = [(int(step), int(rank), float(factor)) for step, rank, factor in schedule]
        self.now = 0.0
        self._strategy = None

    def setup(self, trainer, pl_module, stage):
        from lightning_dynamix.metrics import HostClock

        # the first source given is kept: this callback must come before any other that enables the clock
        self._strategy = trainer.strategy
        trainer.strategy.enable_step_clock(time_source=HostClock(lambda: self.now))

    def factor(self, rank: int, step: int) -> float:
        return next((f for s, r, f in reversed(self.schedule) if r == rank and s <= step), 1.0)

    def on_before_backward(self, trainer, pl_module, loss):
        assert self._strategy is not None
        samples = self._strategy.current_batch_sizes[trainer.global_rank]
        self.now += samples * self.seconds_per_sample * self.factor(trainer.global_rank, trainer.global_step)


def replica_state(network, optimizer):
    """The ``state_dict`` and ``load_state_dict`` a fault-tolerant replica (ft_*_job.py) gives a joiner: its
    network's and optimizer's."""

    def state_dict():
        return {"model": network.state_dict(), "optimizer": optimizer.state_dict()}

    def load_state_dict(state):
        network.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])

    return state_dict, load_state_dict


def wait_to_join(join_file) -> None:
    """Wait until ``join_file`` (if any) exists: a replica that joins later (ft_*_job.py), its imports done, for
    the test's word; a running replica told to hold (:func:`write_plan`), for the joining one's replica."""
    import time

    while join_file is not None and not join_file.exists():
        time.sleep(0.01)


def replica_made(out, replica_id: str) -> None:
    """Called by a fault-tolerant replica (ft_*_job.py) once its replica is made, before its first step: writes
    ``<out>/<replica_id>.ready``, which a replica told to hold (:func:`write_plan`) may be waiting for."""
    (out / f"{replica_id}.ready").touch()


# the steps this replica committed, and how many of them beside another replica (write_plan keeps them)
_committed: list[int] = []
_beside = [0]
_held = [False]


def inside_a_step(out, replica_id: str, step: int, pause: float) -> None:
    """Called inside every step of a fault-tolerant replica (ft_*_job.py), before its gradients are synchronised:
    where the test left ``<out>/<replica_id>.die``, or where ``DIE_AFTER_STEPS_BESIDE=N`` is in the environment
    and the replica has committed N steps beside another, the replica writes the step to ``<out>/killed`` and
    SIGKILLs itself (a machine lost without notice, at a step no test process, however slowed by a loaded
    machine, can miss); otherwise it sleeps ``pause``."""
    import os
    import signal
    import time

    beside = int(os.environ.get("DIE_AFTER_STEPS_BESIDE", 0))
    if (out / f"{replica_id}.die").exists() or 0 < beside <= _beside[0]:
        (out / "killed").write_text(str(step))
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(pause)


def write_plan(log, plan, replica, committed: bool, **extra) -> None:
    """One line of a fault-tolerant replica's log (ft_*_job.py): the step's plan, whether it was committed,
    the steps the replica saw fail so far, the time, and ``extra``.

    With ``HOLD_AFTER_STEPS=N``, ``HOLD_FILE`` and ``KILLED_FILE`` in the environment, once the replica has
    committed N steps and the step ``KILLED_FILE`` names, it waits here (once) until ``HOLD_FILE`` exists: the
    replica that is to join (:func:`replica_made`) then finds the job still running, however late a loaded
    machine lets the test start it."""
    import json
    import os
    import time
    from pathlib import Path

    if committed:
        _committed.append(plan.step)
        _beside[0] += len(plan.batch_sizes) > 1

    line = {
        "step": plan.step,
        "epoch": plan.epoch,
        "cursor": plan.cursor,
        "participant": plan.participant,
        "sizes": list(plan.batch_sizes),
        "indices": plan.indices,
        "committed": committed,
        "failed": replica.failed,
        "time": time.time(),
        **extra,
    }
    log.write(json.dumps(line) + "\n")
    log.flush()
    hold_after = int(os.environ.get("HOLD_AFTER_STEPS", 0))
    if hold_after and not _held[0] and len(_committed) >= hold_after:
        killed = Path(os.environ["KILLED_FILE"])
        step = killed.read_text() if killed.exists() else ""
        if step.isdigit() and int(step) in _committed:  # (a file being written reads empty)
            _held[0] = True
            wait_to_join(Path(os.environ["HOLD_FILE"]))
