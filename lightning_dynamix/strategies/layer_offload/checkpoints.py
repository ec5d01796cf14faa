"""The tables in a checkpoint: every server's shards, with their optimiser state, beside the checkpoint file.

The servers write their shards to ``<checkpoint>.embeddings/`` (:func:`save_shards`); the checkpoint
records them under :data:`CHECKPOINT_KEY`, and resuming restores them into any number of servers
(:func:`load_shards`).
"""

from __future__ import annotations

import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import nn

from lightning_dynamix.offload.remote import EmbeddingClient

CHECKPOINT_KEY = "embedding_servers"


def shard_directory(checkpoint: Path) -> Path:
    """Where the servers write their shards of the checkpoint file ``checkpoint``."""
    return checkpoint.with_name(checkpoint.name + ".embeddings")


def save_shards(
    client: EmbeddingClient, checkpoint: Path, num_servers: int, tables: Mapping[str, nn.Module]
) -> dict[str, Any]:
    """Have the servers write ``tables``' shards beside the checkpoint file ``checkpoint`` (after the updates
    in flight); what the checkpoint records of them, under :data:`CHECKPOINT_KEY`."""
    directory = shard_directory(checkpoint)
    if directory.exists():
        shutil.rmtree(directory)
    client.flush()
    files = client.save(directory)
    return {
        "directory": directory.name,
        "files": files,
        "num_servers": num_servers,
        "tables": {name: {"num_rows": m.num_embeddings, "dim": m.embedding_dim} for name, m in tables.items()},
    }


def remove_shards(checkpoint: Path) -> None:
    """Delete the shards written beside the checkpoint file ``checkpoint``, if any."""
    shutil.rmtree(shard_directory(checkpoint), ignore_errors=True)


def check_shards(saved: Mapping[str, Any] | None, checkpoint: Path | None, tables: Mapping[str, nn.Module]) -> None:
    """Check that ``saved``, what a checkpoint recorded under :data:`CHECKPOINT_KEY`, holds every one of ``tables``.

    Raises:
        MisconfigurationException: for a checkpoint without tables, or without one of ``tables``.
    """
    if saved is None:
        raise MisconfigurationException(
            f"the checkpoint {checkpoint} holds no embedding tables (it was not written by"
            " LayerOffloadStrategy); load it into the model before fitting with this strategy instead"
        )
    missing = sorted(set(tables) - set(saved["tables"]))
    if missing:
        raise MisconfigurationException(
            f"the checkpoint {checkpoint} holds the tables {sorted(saved['tables'])}, not {missing}"
        )


def load_shards(client: EmbeddingClient, saved: Mapping[str, Any], checkpoint: Path) -> None:
    """Have the servers restore their rows from the shards ``saved`` lists beside the checkpoint file
    ``checkpoint`` (written by any number of servers)."""
    directory = checkpoint.parent / saved["directory"]
    client.load([directory / name for name in saved["files"]])
