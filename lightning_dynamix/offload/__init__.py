"""Layer offload: embedding tables sharded row-wise over CPU embedding servers.

This package holds the pieces the layer-offload strategy is built from: how a table's rows are
split over servers (:class:`RowSharding`), how a batch's ids become one request per server
(:func:`route`), and the optimisers a server applies to the rows a batch touched
(:func:`make_sparse_optimizer`), and what one server holds of a table
(:class:`TableShard`, re-sharded for a checkpoint by :func:`reshard_states`).

On top of them: an embedding server's state and step protocol (:class:`EmbeddingServer`, run as a
process by ``python -m lightning_dynamix.serve``), and the trainer's side, the remote stand-ins for
``nn.Embedding`` / ``nn.EmbeddingBag`` and their connection to the servers (:class:`EmbeddingClient`),
which :class:`~lightning_dynamix.strategies.LayerOffloadStrategy` puts together.
"""

from lightning_dynamix.offload.embedding_server import EmbeddingServer, TableSpec
from lightning_dynamix.offload.remote import (
    EmbeddingClient,
    EmbeddingServerError,
    RemoteEmbedding,
    RemoteEmbeddingBag,
)
from lightning_dynamix.offload.sharding import Route, RowSharding, route
from lightning_dynamix.offload.sparse_optim import (
    SPARSE_OPTIMIZERS,
    FrozenRows,
    RowAdagrad,
    RowSGD,
    SparseRowOptimizer,
    make_sparse_optimizer,
    sparse_counterpart,
)
from lightning_dynamix.offload.table_shard import TableShard, reshard_states

__all__ = [
    "SPARSE_OPTIMIZERS",
    "EmbeddingClient",
    "EmbeddingServer",
    "EmbeddingServerError",
    "FrozenRows",
    "RemoteEmbedding",
    "RemoteEmbeddingBag",
    "Route",
    "RowAdagrad",
    "RowSGD",
    "RowSharding",
    "SparseRowOptimizer",
    "TableShard",
    "TableSpec",
    "make_sparse_optimizer",
    "reshard_states",
    "route",
    "sparse_counterpart",
]
