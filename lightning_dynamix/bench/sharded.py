"""The benches' workloads sharded with FSDP2, for ``--sharded`` runs under ``HeterogeneousFSDPStrategy``.

Each applies ``fully_shard`` in ``configure_model`` over the strategy's data-parallel mesh: on every linear layer,
transformer encoder layer or residual block, then on the root.
"""

from __future__ import annotations

from torch import nn
from typing_extensions import override

from lightning_dynamix.data.images import ResidualBlock
from lightning_dynamix.data.synthetic import DemoClassifier
from lightning_dynamix.data.workloads import ClassificationTask
from lightning_dynamix.distributed.batch_norm import convert_batch_norm
from lightning_dynamix.distributed.sharded import shard_blocks

BLOCKS: tuple[type[nn.Module], ...] = (nn.Linear, nn.TransformerEncoderLayer, ResidualBlock)


class ShardedClassificationTask(ClassificationTask):
    """:class:`~lightning_dynamix.data.workloads.ClassificationTask` sharded by blocks; with
    :attr:`global_batch_norm` its BatchNorm layers become ``GlobalBatchNorm`` first (what ``sync_batchnorm=True``
    gives a DDP job)."""

    global_batch_norm = False

    @override
    def configure_model(self) -> None:
        if self.global_batch_norm:
            self.network = convert_batch_norm(self.network)
        shard_blocks(self.network, self.device_mesh["data_parallel"], BLOCKS)


class ShardedDemoClassifier(DemoClassifier):
    """:class:`~lightning_dynamix.data.synthetic.DemoClassifier` with ``fully_shard`` on each linear layer."""

    @override
    def configure_model(self) -> None:
        shard_blocks(self.network, self.device_mesh["data_parallel"], BLOCKS)
