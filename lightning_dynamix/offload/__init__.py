"""Layer offload: embedding tables sharded row-wise over CPU embedding servers.

This package holds the pieces the layer-offload strategy is built from: how a table's rows are
split over servers (:class:`RowSharding`), how a batch's ids become one request per server
(:func:`route`), and the optimisers a server applies to the rows a batch touched
(:func:`make_sparse_optimizer`), and what one server holds of a table
(:class:`TableShard`, re-sharded for a checkpoint by :func:`reshard_states`).
"""

from lightning_dynamix.offload.shard import TableShard, reshard_states
from lightning_dynamix.offload.sharding import Route, RowSharding, route
from lightning_dynamix.offload.sparse_optim import (
    SPARSE_OPTIMIZERS,
    RowAdagrad,
    RowSGD,
    SparseRowOptimizer,
    make_sparse_optimizer,
)

__all__ = [
    "SPARSE_OPTIMIZERS",
    "Route",
    "RowAdagrad",
    "RowSGD",
    "RowSharding",
    "SparseRowOptimizer",
    "TableShard",
    "make_sparse_optimizer",
    "reshard_states",
    "route",
]
