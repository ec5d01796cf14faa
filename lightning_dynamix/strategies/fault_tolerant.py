"""FaultTolerantStrategy: a Lightning job whose machines fail, leave and join while the others keep training.

Each process is one replica of the job (torchft's replica group of one), from Lightning's side a
single-device run. The replicas meet through torchft's lighthouse before every step
(:mod:`lightning_dynamix.distributed.fault_tolerance`):

* the training DataLoader is replaced by :class:`~lightning_dynamix.distributed.fault_tolerance.StepBatches`:
  each batch is planned when Lightning asks for it, from the step's quorum (Lightning reads a DataLoader
  of known length one batch at a time, so no batch is read before the previous step committed);
* after the backward pass the gradient is weighted by this replica's share of the step's global batch and
  summed over the participants, and the step is committed or not. A step that is not committed (a
  participant died) is trained again, inside the same Lightning batch, on the next quorum's plan: to
  Lightning every batch is one committed optimizer step, so its step counters, learning-rate schedules
  and ``max_steps`` stay those of one job;
* a replica that joins receives the LightningModule's and optimizers' state, the learning-rate schedulers'
  and the fit loop's position from a peer (no checkpoint file), and starts at the job's step;
* with :class:`~lightning_dynamix.callbacks.DynamixCallback` in the Trainer's callbacks, its controller
  decides what each replica asks for (:class:`~lightning_dynamix.decisions.ReplicaBalancer`):
  every replica's time per step travels with the step's sizes, the controller's state with a joiner's, and
  the global batch is split over whoever takes part in each step.

Limits: automatic optimisation with one optimizer, no gradient accumulation; samples are read in the
training process (DataLoader workers are not used for training data); each replica validates and saves
checkpoints on its own.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from lightning.pytorch.strategies import SingleDeviceStrategy, StrategyRegistry
from lightning.pytorch.utilities import rank_zero_warn
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import Tensor
from torch.optim import Optimizer
from torch.utils.data import DataLoader
from typing_extensions import override

from lightning_dynamix import _compat
from lightning_dynamix.data.loader import EmptyBatch
from lightning_dynamix.data.streaming import map_style
from lightning_dynamix.decisions import ReplicaBalancer
from lightning_dynamix.distributed.fault_tolerance import (
    FaultTolerantReplica,
    ReplicaSettings,
    StepBatches,
)
from lightning_dynamix.metrics.clocks import TimeSource, time_source_for

log = logging.getLogger(__name__)

STRATEGY_NAME = "dynamix_fault_tolerant"


class FaultTolerantStrategy(SingleDeviceStrategy):
    """Per-step fault tolerance on torchft for a Lightning job, with a batch size per replica (module docstring).

    Start one process per machine, each with ``Trainer(strategy=FaultTolerantStrategy(...), devices=1)``,
    and one lighthouse for the job (``torchft_lighthouse --min_replicas 1 --bind HOST:29510``, on the job's address).

    Args:
        global_batch_size: samples per step over all the step's participants.
        lighthouse: the lighthouse's address, ``http://HOST:PORT``; ``None`` reads ``TORCHFT_LIGHTHOUSE``.
        replica_id: this machine's name; ``None`` reads ``REPLICA_GROUP_ID``, else the host name.
        host: the address the other replicas reach this one at.
        batch_size: the size this replica asks for (a weight: the requests are scaled to the global batch);
            ``None`` takes the training DataLoader's ``batch_size``.
        min_replicas: commit a step only with at least this many participants.
        timeout: seconds before a collective, commit or recovery is given up (the step is trained again).
        quorum_timeout: seconds to wait for a quorum.
        seed: the epochs' order's seed (the same on every replica).
        shuffle: a new order every epoch, or the dataset's order.
        device: this replica's device; gloo carries CPU gradients, NCCL CUDA ones.
    """

    strategy_name = STRATEGY_NAME

    def __init__(
        self,
        global_batch_size: int,
        lighthouse: str | None = None,
        replica_id: str | None = None,
        host: str = "127.0.0.1",
        batch_size: int | None = None,
        min_replicas: int = 1,
        timeout: float = 10.0,
        quorum_timeout: float = 60.0,
        seed: int = 0,
        shuffle: bool = True,
        device: str | torch.device = "cpu",
        **kwargs: Any,
    ) -> None:
        super().__init__(device=device, **kwargs)
        self.settings = ReplicaSettings.checked(
            global_batch_size, lighthouse, replica_id, host, batch_size, min_replicas, timeout, quorum_timeout, seed,
            shuffle,
        )  # fmt: skip
        self.replica: FaultTolerantReplica | None = None
        self.balancer: ReplicaBalancer | None = None
        """The controller the replica asks its sizes of (set by ``DynamixCallback``); ``None``: ``batch_size``."""
        self.time_source: TimeSource | None = None
        """What times the replica's own work for the balancer; ``None``: the device's (CUDA events on a GPU)."""
        self.committed_plan = None
        """The plan of the step the last training batch committed (:class:`StepPlan`)."""
        self._batches: StepBatches | None = None
        self._step_args: tuple[Any, ...] = ()

    @property
    def lighthouse(self) -> str:
        """The lighthouse's address this replica meets the others at."""
        return self.settings.lighthouse

    @property
    def backend(self) -> str:
        """The collective backend for the gradients: NCCL on a CUDA device, gloo otherwise."""
        return "nccl" if self.root_device.type == "cuda" else "gloo"

    @override
    def setup(self, trainer: Any) -> None:
        super().setup(trainer)
        module = self.lightning_module
        if module is not None and not module.automatic_optimization:
            raise MisconfigurationException("FaultTolerantStrategy supports automatic optimisation only.")
        if trainer.training and len(self.optimizers) != 1:
            raise MisconfigurationException(
                f"FaultTolerantStrategy supports one optimizer, got {len(self.optimizers)}."
            )
        if trainer.accumulate_grad_batches != 1:
            raise MisconfigurationException(
                f"FaultTolerantStrategy does not accumulate gradients (accumulate_grad_batches="
                f"{trainer.accumulate_grad_batches}): raise `global_batch_size` instead."
            )

    # ------------------------------------------------------------------ data
    @override
    def process_dataloader(self, dataloader: object) -> object:
        module = self.lightning_module
        trainer = module.trainer if module is not None else None
        if trainer is None or not trainer.training:
            return dataloader
        if not isinstance(dataloader, DataLoader):
            raise MisconfigurationException(
                "FaultTolerantStrategy needs the training data as a torch DataLoader over a map-style dataset,"
                f" got {type(dataloader).__name__}."
            )
        try:  # a streaming dataset that can be indexed (LitData's, MosaicML's) is read through a map-style view
            dataset = map_style(dataloader.dataset, "FaultTolerantStrategy")
        except ValueError as error:
            raise MisconfigurationException(str(error)) from None
        batch_size = self.settings.batch_size if self.settings.batch_size is not None else dataloader.batch_size
        if dataloader.num_workers > 0:
            rank_zero_warn(
                f"FaultTolerantStrategy reads the training samples in the training process (each step's are known"
                f" only once its quorum is): the DataLoader's num_workers={dataloader.num_workers} is not used"
                " for training data."
            )
        if self.replica is None:
            self.replica = self.settings.replica(
                len(dataset),
                self._state_dict,
                self._load_state_dict,
                self.backend,
                self.balancer,
                self.time_source if self.time_source is not None else time_source_for(self.root_device),
            )
        elif len(dataset) != self.replica.num_samples:
            raise MisconfigurationException(
                f"FaultTolerantStrategy: the training data changed from {self.replica.num_samples} samples"
                f" to {len(dataset)}."
            )
        self._batches = StepBatches(self.replica, dataset, dataloader.collate_fn, batch_size)
        return self._batches

    # ------------------------------------------------------------------ the state a joining replica receives
    def _state_dict(self) -> dict[str, Any]:
        module = self.lightning_module
        assert module is not None
        trainer = module.trainer
        return {
            "module": module.state_dict(),
            "optimizers": [optimizer.state_dict() for optimizer in self.optimizers],
            "lr_schedulers": [config.scheduler.state_dict() for config in trainer.lr_scheduler_configs],
            "fit": _compat.fit_progress(trainer),
        }

    def _load_state_dict(self, state: dict[str, Any]) -> None:
        module = self.lightning_module
        assert module is not None
        trainer = module.trainer
        module.load_state_dict(state["module"])
        for optimizer, saved in zip(self.optimizers, state["optimizers"], strict=True):
            optimizer.load_state_dict(saved)
        for config, saved in zip(trainer.lr_scheduler_configs, state["lr_schedulers"], strict=True):
            config.scheduler.load_state_dict(saved)
        _compat.set_fit_progress(trainer, **state["fit"])
        log.info("FaultTolerantStrategy: joined the job at step %d", state["fit"]["global_step"])

    # ------------------------------------------------------------------ the step
    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        self._step_args = args
        if args and isinstance(args[0], EmptyBatch):  # no samples at this step: a zero gradient, still summed
            return self._zero_loss()
        return super().training_step(*args, **kwargs)

    def _zero_loss(self) -> Tensor:
        module = self.lightning_module
        assert module is not None
        return sum(
            (p.sum() * 0.0 for p in module.parameters() if p.requires_grad), torch.zeros((), device=self.root_device)
        )

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Tensor:
        loss = super().backward(closure_loss, optimizer, *args, **kwargs)
        replica, batches, module = self.replica, self._batches, self.lightning_module
        assert replica is not None
        assert batches is not None
        assert module is not None
        while True:
            replica.sync_gradients(module.parameters())
            plan = batches.plan
            if replica.commit():
                self.committed_plan = plan
                return loss
            # not committed: the step's global batch again, on the next quorum's plan (this batch's new samples)
            module.zero_grad(set_to_none=True)
            batch = self.batch_to_device(batches.next_batch())
            step_args = (batch, *self._step_args[1:])
            with self.precision_plugin.train_step_context():
                output = self.training_step(*step_args)
            retried = output["loss"] if isinstance(output, dict) else output
            super().backward(retried, optimizer, *args, **kwargs)

    @override
    def teardown(self) -> None:
        if self.replica is not None:
            self.replica.close()
            self.replica = None
        super().teardown()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        if STRATEGY_NAME not in strategy_registry:
            strategy_registry.register(
                STRATEGY_NAME,
                cls,
                description="per-step fault tolerance on torchft, with a batch size per replica",
            )


FaultTolerantStrategy.register_strategies(StrategyRegistry)
