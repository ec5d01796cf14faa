"""Every private part of Lightning, torch, torchmetrics and stable-baselines3 the package relies on, in one place.

A few things the package must do have no public API: tell Lightning's fit loop that an epoch's
length changed, pad Lightning's logged results, reset torch RPC's per-process counters between fits,
read whether DDP has rebuilt its gradient buckets, and so on. Each is reached through a function
here, which checks that the private part exists and otherwise fails with a message naming it, the
installed version and the versions the package was tested with (:data:`TESTED`, the bounds in
``pyproject.toml``). Nothing else in the package touches another library's private attributes (a test reads
every module's source for it: ``tests/unit/test_private_parts.py``).
"""

from __future__ import annotations

import importlib.metadata
from typing import Any

import torch

TESTED = {"lightning": "2.6", "torch": "2.13", "torchmetrics": "1.9", "stable-baselines3": "2.9"}
"""The versions of each library (major.minor) the package's private uses were tested with."""


def _installed(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:  # pragma: no cover - the package imports it
        return "not installed"


class UnsupportedVersionError(RuntimeError):
    """A library no longer has a private part the package relies on (a version newer than those tested)."""


def _missing(package: str, what: str, why: str) -> UnsupportedVersionError:
    return UnsupportedVersionError(
        f"lightning-dynamix needs {what} to {why}, and {package} {_installed(package)} does not have it; it was"
        f" tested with {package} {TESTED[package]}. Install a {package} version within the bounds of"
        " lightning-dynamix's requirements."
    )


def _attribute(obj: Any, name: str, package: str, why: str) -> Any:
    if not hasattr(obj, name):
        raise _missing(package, f"`{type(obj).__name__}.{name}`", why)
    return getattr(obj, name)


# --------------------------------------------------------------------------------------------- Lightning


def parse_num_batches(stage: Any, length: int | float, limit: int | float) -> int | float:
    """Lightning's own count of an epoch's batches for a DataLoader of ``length`` under ``limit_*_batches``."""
    try:
        from lightning.pytorch.trainer.connectors.data_connector import _parse_num_batches
    except ImportError as error:
        raise _missing("lightning", "`_parse_num_batches`", "count an epoch's batches after a resize") from error
    return _parse_num_batches(stage, length, limit)


def set_epoch_length(trainer: Any, loader: Any, num_batches: int | float) -> bool:
    """Tell ``trainer``'s fit loop that the epoch of training DataLoader ``loader`` now has ``num_batches`` batches.

    Returns False (and changes nothing) where the fit loop is not iterating ``loader``.
    """
    why = "tell Lightning's fit loop that an epoch's length changed"
    fit_loop = trainer.fit_loop
    combined = _attribute(fit_loop, "_combined_loader", "lightning", why)
    if combined is None or not any(dl is loader for dl in combined.flattened):
        return False
    combined.limits = [num_batches]
    fit_loop.max_batches = num_batches
    fetcher = _attribute(fit_loop, "_data_fetcher", "lightning", why)
    if fetcher is not None and fetcher.length is not None:
        fetcher.length = int(num_batches)
        fetcher.done = fetcher.fetched >= fetcher.length
    # a validation interval given as a fraction of the epoch follows its length (not one given in time)
    if getattr(trainer, "_val_check_time_interval", None) is None and isinstance(trainer.val_check_interval, float):
        trainer.val_check_batch = max(1, int(num_batches * trainer.val_check_interval))
    return True


def fit_progress(trainer: Any) -> dict[str, int]:
    """Where ``trainer``'s fit loop is, between two training batches: its epoch, the batches it finished in the
    epoch, and its optimizer steps (``global_step``)."""
    why = "read where a fit loop is, for a replica that joins a running job"
    fit_loop = trainer.fit_loop
    epoch_loop = _attribute(fit_loop, "epoch_loop", "lightning", why)
    batches = _attribute(epoch_loop, "batch_progress", "lightning", why)
    return {
        "epoch": int(trainer.current_epoch),
        "batches_in_epoch": int(batches.current.completed),
        "global_step": int(trainer.global_step),
    }


def set_fit_progress(trainer: Any, epoch: int, batches_in_epoch: int, global_step: int) -> None:
    """Put ``trainer``'s fit loop, between two training batches of automatic optimisation, where another
    replica's is (:func:`fit_progress`): as if it had trained every epoch, batch and optimizer step before."""
    why = "move a joining replica's fit loop to where the job is"
    fit_loop = trainer.fit_loop
    epochs = _attribute(fit_loop, "epoch_progress", "lightning", why)
    for tracker in (epochs.current, epochs.total):  # the epoch `epoch` is under way
        tracker.ready, tracker.started, tracker.processed, tracker.completed = epoch + 1, epoch + 1, epoch, epoch
    epoch_loop = _attribute(fit_loop, "epoch_loop", "lightning", why)
    batches = _attribute(epoch_loop, "batch_progress", "lightning", why)
    for tracker, count in ((batches.current, batches_in_epoch), (batches.total, global_step)):
        tracker.ready = tracker.started = tracker.processed = tracker.completed = count
    optimization = _attribute(epoch_loop, "automatic_optimization", "lightning", why)
    optimizer = _attribute(optimization, "optim_progress", "lightning", why).optimizer
    for progress in (optimizer.step, optimizer.zero_grad):
        progress.total.ready = progress.total.completed = global_step
        if hasattr(progress.total, "started"):
            progress.total.started = global_step
    _attribute(epoch_loop, "_batches_that_stepped", "lightning", why)
    epoch_loop._batches_that_stepped = global_step


def layer_sync(strategy: Any) -> Any:
    """The ``LayerSync`` plugin Lightning gave ``strategy`` (``sync_batchnorm=True``: ``TorchSyncBatchNorm``)."""
    return _attribute(strategy, "_layer_sync", "lightning", "synchronise BatchNorm over uneven batches")


def set_layer_sync(strategy: Any, plugin: Any) -> None:
    """Make ``plugin`` the ``LayerSync`` that ``strategy`` applies to the model at set-up."""
    _attribute(strategy, "_layer_sync", "lightning", "synchronise BatchNorm over uneven batches")
    strategy._layer_sync = plugin


def training_dataloaders(trainer: Any) -> list[Any] | None:
    """The training DataLoaders ``trainer``'s fit loop iterates; ``None`` before it has them."""
    combined = _attribute(trainer.fit_loop, "_combined_loader", "lightning", "count the training DataLoaders")
    return None if combined is None else list(combined.flattened)


def logged_results(trainer: Any) -> Any:
    """``trainer``'s collection of the values logged in the running stage (Lightning's ``_ResultCollection``)."""
    return _attribute(trainer, "_results", "lightning", "reduce epoch-level metrics of ranks that sat out")


def fsdp_param_groups(module: Any) -> list[Any]:
    """The parameter groups of an FSDP2 module (one per mesh), whose collectives it runs."""
    state = _attribute(module, "_get_fsdp_state", "torch", "time FSDP's collectives")()
    return list(_attribute(state, "_fsdp_param_groups", "torch", "time FSDP's collectives"))


def fsdp_comms(group: Any) -> tuple[Any, Any]:
    """An FSDP2 parameter group's all-gather and reduce-scatter (what ``set_custom_all_gather`` replaces)."""
    why = "time FSDP's collectives"
    return _attribute(group, "_all_gather_comm", "torch", why), _attribute(group, "_reduce_scatter_comm", "torch", why)


def set_fsdp_comms(group: Any, all_gather: Any, reduce_scatter: Any) -> None:
    """Give an FSDP2 parameter group these comms (``set_custom_all_gather``'s, for one group of a module)."""
    fsdp_comms(group)  # both exist
    group._all_gather_comm, group._reduce_scatter_comm = all_gather, reduce_scatter


def result_metric_types() -> tuple[type, type, type]:
    """Lightning's ``_Metadata``, ``_ResultMetric`` and ``_Sync``: what a logged value is made of."""
    try:
        from lightning.pytorch.trainer.connectors.logger_connector.result import _Metadata, _ResultMetric, _Sync
    except ImportError as error:
        raise _missing(
            "lightning", "`_ResultMetric`, `_Metadata` and `_Sync`", "reduce epoch-level metrics of ranks that sat out"
        ) from error
    return _Metadata, _ResultMetric, _Sync


# ------------------------------------------------------------------------------------------------- torch


def _torch_private(module: str, name: str, why: str) -> Any:
    """torch's private ``module.name``, or the error that names it and the version the package was tested with."""
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as error:
        raise _missing("torch", f"`{module}.{name}`", why) from error


BatchNormBase: type = _torch_private("torch.nn.modules.batchnorm", "_BatchNorm", "find and replace BatchNorm layers")
"""torch's base class of every BatchNorm layer (1d, 2d, 3d, lazy, ``SyncBatchNorm``)."""

IterablePlaceholderSampler: type = _torch_private(
    "torch.utils.data.dataloader", "_InfiniteConstantSampler", "rebuild a DataLoader over a stream"
)
"""The sampler torch gives a DataLoader over an iterable-style dataset: it yields nothing but ``None``."""


def ddp_has_rebuilt_buckets(model: torch.nn.parallel.DistributedDataParallel) -> bool:
    """Whether DDP rebuilt its gradient buckets (a collective it makes once, in its second forward)."""
    return bool(_attribute(model, "_has_rebuilt_buckets", "torch", "know when a rank may leave the all-reduce"))


def ddp_uses_python_reducer(model: torch.nn.parallel.DistributedDataParallel) -> bool:
    """Whether DDP reduces in Python (compiled autograd), whose collectives every rank must join."""
    return bool(getattr(model, "_use_python_reducer", False))  # absent in versions without that reducer


def reset_rpc_counters() -> None:
    """Reset torch RPC's per-process count of ``init_rpc`` calls and of its all-gathers.

    RPC names its rendezvous keys and all-gathers by those counts; a process that meets new peers at
    a new store (a trainer's second fit, with servers started afresh) must count from zero again.
    """
    from torch.distributed import rpc
    from torch.distributed.rpc import api as rpc_api

    why = "start RPC again in a process that used it before"
    lock = _attribute(rpc, "_init_counter_lock", "torch", why)
    _attribute(rpc, "_init_counter", "torch", why)
    with lock:
        rpc._init_counter = 0
    with _attribute(rpc_api, "_all_gather_dict_lock", "torch", why):
        _attribute(rpc_api, "_all_gather_sequence_id", "torch", why).clear()
        _attribute(rpc_api, "_all_gather_sequence_id_to_states", "torch", why).clear()


def cuda_sleep(cycles: int) -> None:
    """Queue a kernel that spins for ``cycles`` of the device's clock on the current CUDA stream (returns at once)."""
    _attribute(torch.cuda, "_sleep", "torch", "slow a GPU rank down on its own stream")(cycles)


def non_finite_check(tensors: list[torch.Tensor], found: torch.Tensor) -> None:
    """Set ``found`` (a 0-d float tensor) above 0 where any of ``tensors`` holds an inf or a NaN.

    The GradScaler's own fused check (unscaling by 1 leaves the tensors as they are): one pass over
    all of them, without a wait per tensor on a GPU.
    """
    check = _attribute(torch, "_amp_foreach_non_finite_check_and_unscale_", "torch", "check gradients for inf/NaN")
    check(tensors, found, torch.ones((), device=found.device))


# -------------------------------------------------------------------------------- torchmetrics, SB3


def metric_state_defaults(metric: Any) -> dict[str, Any]:
    """A torchmetrics ``Metric``'s default values of its states (what ``reset()`` restores), by name."""
    return _attribute(metric, "_defaults", "torchmetrics", "keep a metric state's dtype on reset")


def set_progress_remaining(model: Any, value: float) -> None:
    """Set a stable-baselines3 model's remaining training progress, which its schedules read."""
    _attribute(model, "_current_progress_remaining", "stable-baselines3", "update a policy outside learn()")
    model._current_progress_remaining = value
