"""Lightning's ``sync_batchnorm=True`` for uneven per-rank batches, on any device: :class:`GlobalBatchNormSync`."""

from __future__ import annotations

from lightning.pytorch.plugins.layer_sync import LayerSync
from torch.nn import Module
from typing_extensions import override

from lightning_dynamix.distributed.batch_norm import convert_batch_norm, revert_batch_norm


class GlobalBatchNormSync(LayerSync):
    """A ``LayerSync`` plugin: every BatchNorm layer becomes a
    :class:`~lightning_dynamix.distributed.batch_norm.GlobalBatchNorm`.

    :class:`~lightning_dynamix.strategies.HeterogeneousDDPStrategy` uses it in place of Lightning's
    ``TorchSyncBatchNorm`` when the Trainer has ``sync_batchnorm=True``; it may also be given as a plugin
    (``Trainer(plugins=[GlobalBatchNormSync()])``).
    """

    @override
    def apply(self, model: Module) -> Module:
        return convert_batch_norm(model)

    @override
    def revert(self, model: Module) -> Module:
        return revert_batch_norm(model)
