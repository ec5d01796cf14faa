"""Per-step fault tolerance (torchft) for a Hugging Face Accelerate loop: machines fail, leave and join while the
others keep training.

How it works, in full: ``docs/internals.md``, section ``lightning_dynamix/integrations/fault_tolerant_accelerate.py``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from accelerate.utils import send_to_device
from torch.utils.data import Dataset, default_collate

from lightning_dynamix._checks import require_int
from lightning_dynamix.control import BatchController
from lightning_dynamix.data.loader import EmptyBatch
from lightning_dynamix.decisions import DecisionMaker, IntervalRecord, ReplicaBalancer, build_controller
from lightning_dynamix.distributed.fault_tolerance import (
    FaultTolerantReplica,
    ReplicaSettings,
    StepBatches,
    StepPlan,
)
from lightning_dynamix.metrics.clocks import time_source_for


class FaultTolerantAccelerate:
    """One replica of a fault-tolerant Accelerate job (module docstring).

    Args:
        accelerator: an ``Accelerator`` of one process.
        global_batch_size: samples per step over all the step's participants, >= 1.
        lighthouse: the lighthouse's address, ``http://HOST:PORT``; ``None`` reads ``TORCHFT_LIGHTHOUSE``.
        replica_id: this machine's name; ``None`` reads ``REPLICA_GROUP_ID``, else the host name.
        host: the address the other replicas reach this one at.
        batch_size: the size this replica asks for (a weight of the global batch); ``None``: an even share.
            With a ``controller``, what it asks for until the first decision.
        min_replicas: commit a step only with at least this many participants.
        timeout: seconds before a collective, commit or recovery is given up (the step is then trained again).
        quorum_timeout: seconds to wait for a quorum.
        seed: the epochs' order's seed (the same on every replica).
        shuffle: a new order every epoch, or the dataset's order.
        controller: ``None`` (the sizes asked for stay ``batch_size``), a controller's name or object.
        interval: committed steps between two decisions of the controller.
        warmup_steps: this process's first steps, not measured.
        controller_kwargs: arguments for a controller given by name.

    Raises:
        ValueError: for a bad argument, naming it, and for what the module docstring lists as refused.
    """

    def __init__(
        self,
        accelerator: Any,
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
        controller: str | BatchController | None = None,
        interval: int = 10,
        warmup_steps: int = 5,
        controller_kwargs: dict[str, Any] | None = None,
    ) -> None:
        self.settings = ReplicaSettings.checked(
            global_batch_size, lighthouse, replica_id, host, batch_size, min_replicas, timeout, quorum_timeout, seed,
            shuffle,
        )  # fmt: skip
        if accelerator.num_processes != 1:
            raise ValueError(
                f"FaultTolerantAccelerate runs one process per replica, but the accelerator has"
                f" num_processes={accelerator.num_processes}: launch one process on each machine"
                " (accelerate launch --num_processes 1, or python)"
            )
        if accelerator.mixed_precision == "fp16":
            raise ValueError(
                "FaultTolerantAccelerate cannot use mixed_precision='fp16': each replica's GradScaler has a scale of"
                " its own, so the replicas' summed gradients would mix scales; use 'bf16' or 'no'"
            )
        if accelerator.gradient_accumulation_steps != 1:
            raise ValueError(
                f"FaultTolerantAccelerate does not accumulate gradients (gradient_accumulation_steps="
                f"{accelerator.gradient_accumulation_steps}): raise `global_batch_size` instead"
            )
        self.accelerator = accelerator
        self.balancer: ReplicaBalancer | None = None
        if controller is not None:
            built, name = build_controller(controller, controller_kwargs, None, None, "none")
            maker = DecisionMaker(built, name, "none", "FaultTolerantAccelerate")
            self.balancer = ReplicaBalancer(maker, interval=interval, warmup_steps=warmup_steps)
        self.replica: FaultTolerantReplica | None = None
        self._models: list[torch.nn.Module] = []
        self._optimizers: list[Any] = []
        self._schedulers: list[Any] = []
        self._registered: list[Any] = []
        self._batches: StepBatches | None = None

    @property
    def history(self) -> list[IntervalRecord]:
        """The controller's decisions (the same on every replica); empty without a controller."""
        return self.balancer.history if self.balancer is not None else []

    @property
    def plan(self) -> StepPlan | None:
        """The plan of the batch handed out last: its step, sizes, this replica's share."""
        return self._batches.plan if self._batches is not None else None

    @property
    def step(self) -> int:
        """The job's committed steps."""
        return self.replica.step if self.replica is not None else 0

    def register(self, obj: Any) -> None:
        """Something with ``state_dict()`` and ``load_state_dict()`` that a joining replica receives too."""
        if not (callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))):
            raise ValueError(f"register() needs an object with state_dict() and load_state_dict(), got {obj!r}")
        self._registered.append(obj)

    def prepare(self, *objects: Any, train_dataset: Dataset, collate_fn: Any = None) -> Any:
        """``accelerator.prepare(*objects)`` (models, optimizers, schedulers; no training DataLoader) and this
        replica's link to the job, training on ``train_dataset`` (map-style). Returns what Accelerate returns."""
        if self.replica is not None:
            raise RuntimeError("FaultTolerantAccelerate.prepare() is called once")
        if any(isinstance(obj, torch.utils.data.DataLoader) for obj in objects):
            raise ValueError(
                "FaultTolerantAccelerate plans every training batch from its step's quorum: give the training"
                " dataset as `train_dataset`, not a DataLoader"
            )
        prepared = self.accelerator.prepare(*objects)
        items = prepared if isinstance(prepared, tuple) else (prepared,)
        for item in items:
            if isinstance(item, torch.nn.Module):
                self._models.append(item)
            elif hasattr(item, "param_groups") or hasattr(getattr(item, "optimizer", None), "param_groups"):
                self._optimizers.append(item)
            elif callable(getattr(item, "state_dict", None)):
                self._schedulers.append(item)
        if not self._models or not self._optimizers:
            raise ValueError("FaultTolerantAccelerate.prepare() needs the model and its optimizer")
        self.replica = self.settings.replica(
            len(train_dataset),  # type: ignore[arg-type]
            self._state_dict,
            self._load_state_dict,
            "nccl" if self.accelerator.device.type == "cuda" else "gloo",
            self.balancer,
            time_source_for(self.accelerator.device),
        )
        self._batches = StepBatches(
            self.replica, train_dataset, collate_fn or default_collate, self.settings.batch_size
        )
        return prepared

    def _state_dict(self) -> dict[str, Any]:
        return {
            "models": [self.accelerator.unwrap_model(model).state_dict() for model in self._models],
            "optimizers": [optimizer.state_dict() for optimizer in self._optimizers],
            "schedulers": [scheduler.state_dict() for scheduler in self._schedulers],
            "registered": [obj.state_dict() for obj in self._registered],
        }

    def _load_state_dict(self, state: dict[str, Any]) -> None:
        groups = (
            ([self.accelerator.unwrap_model(m) for m in self._models], state["models"]),
            (self._optimizers, state["optimizers"]),
            (self._schedulers, state["schedulers"]),
            (self._registered, state["registered"]),
        )
        for objects, saved in groups:
            for obj, value in zip(objects, saved, strict=True):
                obj.load_state_dict(value)

    def batches(self, max_steps: int) -> Iterator[Any]:
        """The training batches until the job has committed ``max_steps`` steps, epoch after epoch, each moved to
        the accelerator's device. A step this replica has no samples at (an epoch's end with more participants
        than samples) is taken here with a zero gradient, and not handed out."""
        require_int("max_steps", max_steps, 1)
        if self.replica is None or self._batches is None:
            raise RuntimeError("FaultTolerantAccelerate.prepare() must come before batches()")
        while self.replica.step < max_steps:
            batch = self._batches.next_batch()
            if self.replica.step >= max_steps:  # a joiner may have received the state of a finished job
                return
            if isinstance(batch, EmptyBatch):
                self._zero_step()
                continue
            yield send_to_device(batch, self.accelerator.device)

    def _zero_step(self) -> None:
        for model in self._models:
            model.zero_grad(set_to_none=True)
        if self.backward(None):
            for optimizer in self._optimizers:
                optimizer.step()
        for optimizer in self._optimizers:
            optimizer.zero_grad()

    def backward(self, loss: torch.Tensor | None) -> bool:
        """Back-propagate ``loss`` (``accelerator.backward``), sum the weighted gradients over the step's
        participants, and return whether the step is committed: step the optimizer only then (``None``: no
        samples here, a zero gradient)."""
        if self.replica is None:
            raise RuntimeError("FaultTolerantAccelerate.prepare() must come before backward()")
        if loss is not None:
            self.accelerator.backward(loss)
        parameters = [p for model in self._models for p in model.parameters()]
        self.replica.sync_gradients(parameters)
        return self.replica.commit()

    def close(self) -> None:
        """Leave the job: the others go on without this replica."""
        if self.replica is not None:
            self.replica.close()
            self.replica = None
