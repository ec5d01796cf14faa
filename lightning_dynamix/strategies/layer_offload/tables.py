"""Which embedding tables go to the servers, what the servers make of them, and how they leave the model.

The strategies' ``offload`` argument names the tables: ``"auto"`` (every ``nn.Embedding`` and
``nn.EmbeddingBag``), module names, or a :class:`~lightning_dynamix.placement.PlacementPlan` (or its file),
whose CPU stages hold them (:func:`offload_plan`, :func:`validate_offload`). At set-up the named modules
are checked against the LightningModule (:func:`select_tables`), described to the servers
(:func:`table_spec`, with the optimiser :func:`sparse_optimizer_for` chooses) and replaced by remote
stand-ins (:func:`set_submodule`); at the end of ``fit`` they come back (:func:`bring_tables_back`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import nn
from torch.optim import Optimizer

from lightning_dynamix.offload import SparseRowOptimizer, make_sparse_optimizer
from lightning_dynamix.offload.embedding_server import TableSpec
from lightning_dynamix.offload.remote import EMBEDDING_TYPES, EmbeddingClient
from lightning_dynamix.offload.sparse_optim import FrozenRows, sparse_counterpart
from lightning_dynamix.placement import PlacementPlan


def offload_plan(offload: object) -> PlacementPlan | None:
    """The placement plan ``offload`` gives (itself, or the ``.json`` / ``.yaml`` file it names); None otherwise.

    Raises:
        ValueError: for a plan file that does not exist, or a plan that puts no table on a CPU resource type.
    """
    if isinstance(offload, PlacementPlan):
        plan = offload
    elif isinstance(offload, (str, Path)) and str(offload).endswith((".json", ".yaml", ".yml")):
        if not Path(offload).is_file():
            raise ValueError(f"`offload` names the plan file {str(offload)!r}, which does not exist")
        plan = PlacementPlan.load(offload)
    else:
        return None
    if not plan.offloaded_layers():
        placed = dict(zip(plan.layers, plan.assignment))
        raise ValueError(
            f"the placement plan puts no embedding table on a CPU resource type ({placed});"
            " there is nothing for embedding servers to hold"
        )
    return plan


def validate_offload(offload: object) -> str | tuple[str, ...]:
    """``offload`` checked: ``"auto"``, or the distinct, non-empty module names it lists.

    Raises:
        ValueError: for anything else.
    """
    if offload == "auto":
        return "auto"
    if isinstance(offload, str) or not isinstance(offload, Sequence) or not offload:
        raise ValueError(f"`offload` must be 'auto' or a non-empty list of embedding module names, got {offload!r}")
    names = tuple(offload)
    bad = [name for name in names if not isinstance(name, str) or not name]
    if bad or len(set(names)) != len(names):
        raise ValueError(f"`offload` must list distinct module names, got {list(names)!r}")
    return names


def validate_sparse_optimizer(sparse_optimizer: str | SparseRowOptimizer | None, args: Mapping[str, Any]) -> None:
    """Check the servers' optimiser as the strategies take it, before anything starts.

    Raises:
        ValueError: for arguments without a named optimiser, an unknown name, or arguments it does not take.
    """
    if sparse_optimizer is None:
        if args:
            raise ValueError(
                f"`sparse_optimizer_args` {dict(args)} were given without a `sparse_optimizer`;"
                " name one (e.g. 'adagrad') or leave both unset to mirror the LightningModule's optimizer"
            )
    elif not isinstance(sparse_optimizer, SparseRowOptimizer):
        # checked now, with a stand-in learning rate; the real one may come from the module's optimizer
        make_sparse_optimizer(sparse_optimizer, **{"lr": 1.0, **args})
    else:
        make_sparse_optimizer(sparse_optimizer, **args)


def sparse_optimizer_for(
    fn: TrainerFn | None,
    sparse_optimizer: str | SparseRowOptimizer | None,
    args: Mapping[str, Any],
    optimizers: Sequence[Optimizer],
) -> SparseRowOptimizer:
    """The servers' optimiser for a run of ``fn``: frozen rows outside ``fit``; otherwise ``sparse_optimizer``
    (made with ``args``, ``lr`` defaulting to the first of ``optimizers``'), or the counterpart of that optimizer.

    Raises:
        MisconfigurationException: for no optimizer to mirror, or one without a sparse counterpart.
    """
    if fn != TrainerFn.FITTING:
        return FrozenRows()
    dense = optimizers[0] if optimizers else None
    if sparse_optimizer is None:
        if dense is None:
            raise MisconfigurationException(
                "LayerOffloadStrategy mirrors the LightningModule's optimizer for the embedding tables, and"
                " configure_optimizers returned none: set `sparse_optimizer`"
            )
        try:
            return sparse_counterpart(dense)
        except ValueError as error:
            raise MisconfigurationException(f"{error}; set LayerOffloadStrategy(sparse_optimizer=...)") from None
    if isinstance(sparse_optimizer, SparseRowOptimizer):
        return sparse_optimizer
    made = dict(args)
    if "lr" not in made and dense is not None:
        made["lr"] = dense.param_groups[0]["lr"]
    return make_sparse_optimizer(sparse_optimizer, **made)


def select_tables(module: nn.Module, offload: str | tuple[str, ...]) -> dict[str, nn.Module]:
    """The embedding modules of ``module`` that ``offload`` names (every one with ``"auto"``), by name.

    Raises:
        MisconfigurationException: for a name that is no embedding module of ``module``, none at all with
            ``"auto"``, tied weights, or a table with ``max_norm``.
    """
    modules = dict(module.named_modules())
    embeddings = {name: m for name, m in modules.items() if isinstance(m, EMBEDDING_TYPES)}
    if offload == "auto":
        if not embeddings:
            raise MisconfigurationException(
                f"`offload='auto'` found no nn.Embedding or nn.EmbeddingBag in {type(module).__name__}:"
                " there is nothing to offload; use another strategy for this model"
            )
        selected = embeddings
    else:
        for name in offload:
            if name not in modules:
                raise MisconfigurationException(
                    f"`offload` names {name!r}, which is not a module of {type(module).__name__};"
                    f" its embedding modules are {sorted(embeddings)}"
                )
            if name not in embeddings:
                raise MisconfigurationException(
                    f"`offload` names {name!r}, a {type(modules[name]).__name__}; only nn.Embedding and"
                    f" nn.EmbeddingBag can be offloaded: {sorted(embeddings)}"
                )
        selected = {name: embeddings[name] for name in offload}
    shared = _shared_weights(module, selected)
    if shared:
        raise MisconfigurationException(
            f"the weights of {shared} are also used by other modules (tied weights); offloading them would"
            " split one parameter in two: leave them out of `offload`"
        )
    for name, embedding in selected.items():
        if embedding.max_norm is not None:
            raise MisconfigurationException(
                f"embedding {name!r} has max_norm={embedding.max_norm}, which renormalises rows in place in the"
                " forward pass; a remote table cannot: leave it out of `offload`"
            )
    return selected


def table_spec(name: str, embedding: nn.Module, optimizer: SparseRowOptimizer) -> TableSpec:
    """What the servers need to hold ``embedding`` as table ``name``, trained by ``optimizer``."""
    return TableSpec(
        name=name,
        num_rows=embedding.num_embeddings,
        dim=embedding.embedding_dim,
        optimizer=optimizer,
        init_seed=torch.initial_seed() % (2**31) + sum(map(ord, name)),
        padding_idx=embedding.padding_idx,
        dtype=embedding.weight.dtype,
    )


def bring_tables_back(client: EmbeddingClient, tables: Mapping[str, nn.Module], device: torch.device) -> None:
    """Copy every table's trained rows from the servers into its own embedding module, on ``device``."""
    for name, embedding in tables.items():
        table = client.table(name, embedding.num_embeddings)
        embedding.weight = nn.Parameter(table.to(device))


def submodule(root: nn.Module, name: str) -> nn.Module | None:
    """``root``'s submodule ``name``; None where it has none."""
    try:
        return root.get_submodule(name)
    except AttributeError:
        return None


def set_submodule(root: nn.Module, name: str, module: nn.Module) -> None:
    """Put ``module`` in ``root`` as its submodule ``name`` (dotted), in place of what was there."""
    parent_name, _, child = name.rpartition(".")
    setattr(root.get_submodule(parent_name) if parent_name else root, child, module)


def _shared_weights(module: nn.Module, selected: Mapping[str, nn.Module]) -> list[str]:
    owners: dict[int, set[str]] = {}
    for owner, child in module.named_modules(remove_duplicate=False):
        for parameter in child.parameters(recurse=False):
            owners.setdefault(id(parameter), set()).add(owner)
    return sorted(name for name, m in selected.items() if len(owners.get(id(m.weight), ())) > 1)
