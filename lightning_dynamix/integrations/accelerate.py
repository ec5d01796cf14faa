"""Per-rank batch sizes and exact uneven gradients under Hugging Face Accelerate (``accelerate launch``, ``torchrun``).

:class:`DynamixAccelerate` sits beside an ``Accelerator``: its :meth:`~DynamixAccelerate.prepare`
passes everything to ``accelerator.prepare`` except the training DataLoader, which it rebuilds
around a :class:`~lightning_dynamix.data.HeterogeneousBatchSampler` (rank ``r`` trains on ``b_r``
samples per step, every rank runs the same number of steps, every sample is used once per
epoch), and it registers the weighted all-reduce hook on the prepared DDP model (Accelerate has no
option for a custom hook). :meth:`~DynamixAccelerate.backward` replaces ``accelerator.backward``:
it weights this rank's gradient by ``b_r / sum(b)`` (a scalar on the loss's gradient, no extra
pass over the parameters), so the all-reduced gradient is exactly the mean over the global
batch, as one process training on all ``sum(b)`` samples would compute.

```python
accelerator = Accelerator()
dynamix = DynamixAccelerate(accelerator, batch_sizes=[48, 16])
model, optimizer, loader = dynamix.prepare(model, optimizer, DataLoader(dataset, batch_size=32, shuffle=True))
for epoch in range(epochs):
    for x, y in loader:
        loss = F.cross_entropy(model(x), y)
        dynamix.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
```
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, RandomSampler, SequentialSampler

from lightning_dynamix._checks import require_int, require_optional_int
from lightning_dynamix.data import HeterogeneousBatchSampler, HeterogeneousDataLoader, validate_batch_sizes
from lightning_dynamix.data.schedule import BatchSizes
from lightning_dynamix.distributed import WeightedAllReduceState, weighted_allreduce_hook
from lightning_dynamix.distributed.weighting import SyncWindowWeighting, validate_loss_reduction


class PreparedTrainLoader:
    """The training DataLoader :meth:`DynamixAccelerate.prepare` returns: per-rank batches on the accelerator's device.

    Iterating it runs one epoch of the rank's batches; each new iteration starts the next epoch
    (the global order is reshuffled from the seed and the epoch), unless :meth:`set_epoch` chose
    one. ``len()`` is the number of steps of the current epoch, the same on every rank.
    """

    def __init__(self, loader: HeterogeneousDataLoader, device: torch.device) -> None:
        self.loader = loader
        self.device = device
        self._epoch = 0
        self._epoch_set = False

    @property
    def batch_sampler(self) -> HeterogeneousBatchSampler:
        return self.loader.batch_sampler

    @property
    def dataset(self) -> Any:
        return self.loader.dataset

    def set_epoch(self, epoch: int) -> None:
        """Train epoch ``epoch`` on the next iteration (its order and its batch-size schedule)."""
        self._epoch = require_int("epoch", epoch, 0)
        self._epoch_set = True

    def __len__(self) -> int:
        self.batch_sampler.set_epoch(self._epoch)
        return len(self.loader)

    def __iter__(self) -> Iterator[Any]:
        from accelerate.utils import send_to_device

        self.batch_sampler.set_epoch(self._epoch)
        self._epoch_set = False
        for batch in self.loader:
            yield send_to_device(batch, self.device, non_blocking=self.loader.pin_memory)
        if not self._epoch_set:
            self._epoch += 1

    def state_dict(self) -> dict[str, Any]:
        """The sampler's position: the batches trained on so far, the sizes and the epoch."""
        return {"epoch": self._epoch, "sampler": self.loader.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Continue where :meth:`state_dict` was taken."""
        self._epoch = int(state_dict["epoch"])
        self.loader.load_state_dict(state_dict["sampler"])


class DynamixAccelerate:
    """Uneven per-rank batch sizes with exact gradients for a script that trains with an ``Accelerator``.

    Args:
        accelerator: a distributed ``accelerate.Accelerator`` (``accelerate launch`` or ``torchrun``
            with two or more processes).
        batch_sizes: samples per step of every rank, one per process; ``None`` gives every rank the
            training DataLoader's ``batch_size``.
        min_batch_size: smallest size a rank may be given (>= 1).
        max_batch_size: largest size a rank may be given; ``None`` for no limit.
        loss_reduction: ``"mean"`` if the training loss averages over the rank's samples (the
            usual case), ``"sum"`` if it sums them.
        shuffle: draw every epoch's global order at random (from ``seed`` and the epoch).
        seed: seed of the global order; the same on every rank.
        drop_last: skip the samples of an incomplete last global batch instead of spreading them.

    Raises:
        ValueError: naming the argument, the value and what is valid, for bad arguments, an
            Accelerator that is not distributed, or gradient accumulation (not supported yet).
    """

    def __init__(
        self,
        accelerator: Any,
        batch_sizes: Sequence[int] | None = None,
        *,
        min_batch_size: int = 1,
        max_batch_size: int | None = None,
        loss_reduction: str = "mean",
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        from accelerate import Accelerator

        if not isinstance(accelerator, Accelerator):
            raise ValueError(f"`accelerator` must be an accelerate.Accelerator, got {type(accelerator).__name__}")
        launched = int(os.environ.get("WORLD_SIZE", "1"))
        if accelerator.num_processes < 2 and launched > 1:
            raise ValueError(
                f"`accelerator` runs 1 process although the launcher started {launched}: without a GPU, Accelerate"
                " only joins the processes when asked to use the CPU. Create it with"
                " Accelerator(cpu=not torch.cuda.is_available()), or launch with `accelerate launch --cpu`."
            )
        if accelerator.num_processes < 2:
            raise ValueError(
                f"`accelerator` runs {accelerator.num_processes} process; DynamixAccelerate gives ranks different"
                " batch sizes, which needs a distributed job: start the script with"
                " `accelerate launch --multi_gpu --num_processes N script.py` or"
                " `torchrun --nproc_per_node N script.py` (N >= 2), or train without DynamixAccelerate on one process."
            )
        if accelerator.gradient_accumulation_steps != 1:
            raise ValueError(
                f"`accelerator` accumulates gradients over {accelerator.gradient_accumulation_steps} steps;"
                " DynamixAccelerate does not support gradient accumulation yet: use"
                " Accelerator(gradient_accumulation_steps=1) and a larger batch size per rank instead."
            )
        self.accelerator = accelerator
        self.min_batch_size = require_int("min_batch_size", min_batch_size, 1)
        self.max_batch_size = require_optional_int("max_batch_size", max_batch_size, min_batch_size, "min_batch_size")
        self.batch_sizes: BatchSizes | None = None
        if batch_sizes is not None:
            self.batch_sizes = validate_batch_sizes(
                batch_sizes,
                world_size=accelerator.num_processes,
                min_batch_size=self.min_batch_size,
                max_batch_size=self.max_batch_size,
            )
        self.loss_reduction = validate_loss_reduction(loss_reduction)
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"`seed` must be an int, got {seed!r}")
        self.shuffle, self.seed, self.drop_last = bool(shuffle), seed, bool(drop_last)
        self.hook_state = WeightedAllReduceState()
        self.model: DistributedDataParallel | None = None
        self.train_loader: PreparedTrainLoader | None = None
        self._weighting = SyncWindowWeighting(accelerator.process_index, self.loss_reduction)

    # ------------------------------------------------------------------ prepare
    def prepare(self, *objects: Any) -> Any:
        """``accelerator.prepare(*objects)``, except that the first DataLoader becomes the per-rank training loader.

        Other DataLoaders (validation) are prepared by Accelerate as usual. The model is wrapped by
        Accelerate (DDP) and gets the weighted all-reduce hook. Returns the objects in the same
        order, a single object unwrapped, like ``accelerator.prepare``.

        Raises:
            ValueError: for a model already wrapped in DDP (prepare it here instead), a second
                model, an iterable-style or custom-sampler training DataLoader, or a dataset smaller
                than one global batch.
        """
        train_index = next((i for i, o in enumerate(objects) if isinstance(o, DataLoader)), None)
        for obj in objects:
            if isinstance(obj, DistributedDataParallel):
                raise ValueError(
                    "A model already wrapped in DistributedDataParallel was passed to DynamixAccelerate.prepare;"
                    " its all-reduce cannot be weighted any more. Pass the plain model: dynamix.prepare(model, ...)"
                    " instead of accelerator.prepare(model) first."
                )
        loader = self._train_loader(objects[train_index]) if train_index is not None else None
        rest = [o for i, o in enumerate(objects) if i != train_index]
        prepared = list(self.accelerator.prepare(*rest)) if len(rest) > 1 else [self.accelerator.prepare(*rest)]
        prepared = prepared if rest else []
        for obj in prepared:
            if isinstance(obj, DistributedDataParallel):
                if self.model is not None:
                    raise ValueError("DynamixAccelerate.prepare got a second model; it weights one model's gradients")
                obj.register_comm_hook(state=self.hook_state, hook=weighted_allreduce_hook)
                self.model = obj
        if train_index is not None:
            prepared.insert(train_index, loader)
        return prepared[0] if len(prepared) == 1 else tuple(prepared)

    def _train_loader(self, dataloader: DataLoader) -> PreparedTrainLoader:
        if isinstance(dataloader.dataset, IterableDataset):
            raise ValueError(
                f"The training DataLoader's dataset is iterable-style ({type(dataloader.dataset).__name__});"
                " per-rank batch sizes need a map-style dataset (with __len__ and __getitem__)."
            )
        if type(dataloader.batch_sampler) is not BatchSampler or type(dataloader.sampler) not in (
            RandomSampler,
            SequentialSampler,
        ):
            raise ValueError(
                "The training DataLoader has a custom sampler or batch sampler"
                f" ({type(dataloader.sampler).__name__}, {type(dataloader.batch_sampler).__name__}); DynamixAccelerate"
                " draws batches from one global shuffled order and would discard it. Use"
                " DataLoader(dataset, batch_size=..., shuffle=...)."
            )
        sizes: object = self.batch_sizes
        argument = "batch_sizes"
        if sizes is None:
            sizes = [dataloader.batch_size] * self.accelerator.num_processes
            argument = "DataLoader(batch_size) on every rank"
        self.batch_sizes = validate_batch_sizes(
            sizes,
            world_size=self.accelerator.num_processes,
            argument=argument,
            min_batch_size=self.min_batch_size,
            max_batch_size=self.max_batch_size,
        )
        sampler = HeterogeneousBatchSampler(
            dataloader.dataset,  # type: ignore[arg-type]
            self.batch_sizes,
            rank=self.accelerator.process_index,
            world_size=self.accelerator.num_processes,
            shuffle=self.shuffle,
            seed=self.seed,
            drop_last=self.drop_last or dataloader.drop_last,
        )
        loader = HeterogeneousDataLoader.like(dataloader, sampler)
        self.train_loader = PreparedTrainLoader(loader, self.accelerator.device)
        return self.train_loader

    # ------------------------------------------------------------------ training
    def backward(self, loss: Tensor, **kwargs: Any) -> None:
        """``accelerator.backward(loss)`` with this rank's gradient weighted by its share of the global batch."""
        loader = self.train_loader.loader if self.train_loader is not None else None
        if loader is None or self.model is None:
            raise RuntimeError("DynamixAccelerate.backward needs the model and the training DataLoader from prepare()")
        if loader.current_step < 0:
            raise RuntimeError("backward() was called before the training DataLoader handed out a batch")
        sizes = loader.current_batch_sizes
        factor = self._weighting.add_backward(loader.current_step, sizes, 1.0, sum(sizes))
        loss.register_hook(lambda grad: grad * factor)
        self.hook_state.weight = self._weighting.sync_weight()
        self.accelerator.backward(loss, **kwargs)
        self._weighting.reset()

    def set_batch_sizes(self, batch_sizes: Sequence[int]) -> int:
        """Use ``batch_sizes`` from the first step no rank has produced yet; call it on every rank with the same sizes.

        DataLoader workers prefetch, so ranks may have produced different numbers of batches; the
        ranks agree (one all-reduce) on the first step none has produced and switch there.

        Returns:
            The step of the current epoch from which the new sizes apply.
        """
        if self.train_loader is None:
            raise RuntimeError("set_batch_sizes needs the training DataLoader from prepare()")
        sizes = validate_batch_sizes(
            batch_sizes,
            world_size=self.accelerator.num_processes,
            min_batch_size=self.min_batch_size,
            max_batch_size=self.max_batch_size,
        )
        sampler = self.train_loader.batch_sampler
        produced = torch.tensor([sampler.next_step], dtype=torch.int64)
        torch.distributed.all_reduce(produced, op=torch.distributed.ReduceOp.MAX)
        self.batch_sizes = sizes
        return sampler.set_batch_sizes(sizes, from_step=int(produced.item()))
