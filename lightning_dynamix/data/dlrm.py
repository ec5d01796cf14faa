"""DLRM, the deep learning recommendation model: the CTR example's LightningModule and ``dynamix bench offload``'s.

``examples/ctr/dlrm.py`` trains it with the Lightning CLI, on one process or with
:class:`~lightning_dynamix.strategies.LayerOffloadStrategy`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from torch import nn
from torchmetrics import MeanMetric
from torchmetrics.classification import BinaryAUROC
from typing_extensions import override

from lightning_dynamix._checks import require_int, require_number
from lightning_dynamix._layers import mlp
from lightning_dynamix.data.ctr import CRITEO_LIKE_TABLE_SIZES, CTRSample

OptimizerName = Literal["sgd", "adagrad"]


class DotInteraction(nn.Module):
    """DLRM's feature interaction: the dot product of every pair of vectors, after the first vector.

    Takes ``vectors`` ``(batch, n, dim)`` (the bottom MLP's output first, then one row per table) and
    returns ``(batch, dim + n * (n - 1) / 2)``: the first vector, then the ``n * (n - 1) / 2``
    pairwise dot products. A module of its own, so that profiling times it as a layer.
    """

    def __init__(self, num_vectors: int) -> None:
        super().__init__()
        pairs = torch.tril_indices(num_vectors, num_vectors, offset=-1)
        # each pair's place in the flattened (n, n) products: index_select and its backward (index_add) are
        # faster than indexing with the two rows (docs/internals.md)
        self.register_buffer("pairs", pairs[0] * num_vectors + pairs[1], persistent=False)

    @override
    def forward(self, vectors: torch.Tensor) -> torch.Tensor:
        dots = torch.bmm(vectors, vectors.transpose(1, 2)).flatten(1).index_select(1, self.pairs)
        return torch.cat([vectors[:, 0], dots], dim=1)


class DLRM(LightningModule):
    """A DLRM click model: bottom MLP, one embedding table per categorical feature, pairwise dot products, top MLP.

    The bottom MLP maps the dense features to an ``embedding_dim`` vector; each categorical id looks up
    an ``embedding_dim`` row of its own table in :attr:`embeddings` (table ``t`` is the submodule named
    ``embeddings.t``); the dot products of every pair among these ``1 + len(table_sizes)`` vectors,
    with the bottom MLP's output, feed the top MLP, which gives one click logit. Trained with binary
    cross-entropy on the logits; logs ``train_loss`` every step and ``val_loss`` and ``val_auc`` (ROC AUC
    over all validation samples) every validation epoch.

    Args:
        num_dense: dense features per sample.
        table_sizes: rows of each embedding table, one table per categorical feature.
        embedding_dim: length of every embedding row and of the bottom MLP's output.
        bottom_mlp: widths of the bottom MLP's hidden layers.
        top_mlp: widths of the top MLP's hidden layers.
        optimizer: ``"sgd"`` or ``"adagrad"`` (the usual choice for embedding tables).
        lr: learning rate.
        seed: seed of the initial weights; ``None`` draws them from the global generator.
        meta_embeddings: build the tables on the meta device, taking no memory, for tables too large
            for a trainer: :class:`~lightning_dynamix.strategies.LayerOffloadStrategy`'s servers then
            initialise their rows ``N(0, 1)`` themselves.
    """

    def __init__(
        self,
        num_dense: int = 13,
        table_sizes: Sequence[int] = CRITEO_LIKE_TABLE_SIZES,
        embedding_dim: int = 16,
        bottom_mlp: Sequence[int] = (64,),
        top_mlp: Sequence[int] = (64, 32),
        optimizer: OptimizerName = "adagrad",
        lr: float = 0.02,
        seed: int | None = 0,
        meta_embeddings: bool = False,
    ) -> None:
        super().__init__()
        require_int("num_dense", num_dense, 1)
        if isinstance(table_sizes, str) or not isinstance(table_sizes, Sequence) or len(table_sizes) == 0:
            raise ValueError(f"`table_sizes` must be a non-empty sequence of ints >= 1, got {table_sizes!r}")
        for index, size in enumerate(table_sizes):
            require_int(f"table_sizes[{index}]", size, 1)
        require_int("embedding_dim", embedding_dim, 1)
        for name, widths in (("bottom_mlp", bottom_mlp), ("top_mlp", top_mlp)):
            if isinstance(widths, str) or not isinstance(widths, Sequence):
                raise ValueError(f"`{name}` must be a sequence of hidden-layer widths (ints >= 1), got {widths!r}")
            for index, width in enumerate(widths):
                require_int(f"{name}[{index}]", width, 1)
        if optimizer not in ("sgd", "adagrad"):
            raise ValueError(f"`optimizer` must be 'sgd' or 'adagrad', got {optimizer!r}")
        require_number("lr", lr, 0.0, low_open=True)
        if seed is not None:
            require_int("seed", seed, 0)
        self.save_hyperparameters()
        num_vectors = 1 + len(table_sizes)
        with torch.random.fork_rng(devices=[], enabled=seed is not None):
            if seed is not None:
                torch.manual_seed(seed)
            self.bottom_mlp = mlp([num_dense, *bottom_mlp, embedding_dim], final_activation=True)
            device = torch.device("meta") if meta_embeddings else None
            self.embeddings = nn.ModuleList(nn.Embedding(size, embedding_dim, device=device) for size in table_sizes)
            for table in self.embeddings if not meta_embeddings else ():
                # DLRM's initialisation: small rows for large tables
                bound = table.num_embeddings**-0.5
                nn.init.uniform_(table.weight, -bound, bound)
            num_pairs = num_vectors * (num_vectors - 1) // 2
            self.top_mlp = mlp([embedding_dim + num_pairs, *top_mlp, 1])
        self.interaction = DotInteraction(num_vectors)
        self.val_auc = BinaryAUROC()
        self.val_loss = MeanMetric()

    @override
    def forward(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        """Click logits ``(batch,)`` for dense features ``(batch, num_dense)`` and ids ``(batch, num_tables)``."""
        # the lookups first: a chain of tables, then dense layers, which a placement can cut in two
        rows = [table(sparse[:, index]) for index, table in enumerate(self.embeddings)]
        bottom = self.bottom_mlp(dense)
        return self.top_mlp(self.interaction(torch.stack([bottom, *rows], dim=1))).squeeze(1)

    def embedding_ids(self, batch: CTRSample) -> dict[str, torch.Tensor]:
        """The ids each table's forward receives: LayerOffloadStrategy looks them all up in one request per server."""
        _, sparse, _ = batch
        return {f"embeddings.{index}": sparse[:, index] for index in range(len(self.embeddings))}

    @override
    def training_step(self, batch: CTRSample, batch_idx: int) -> torch.Tensor:
        dense, sparse, labels = batch
        loss = F.binary_cross_entropy_with_logits(self(dense, sparse), labels)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    @override
    def on_validation_epoch_start(self) -> None:
        # metric states left by a `trainer.validate()` are inference tensors that a later fit could not update
        self.val_auc.reset()
        self.val_loss.reset()

    @override
    def validation_step(self, batch: CTRSample, batch_idx: int) -> None:
        dense, sparse, labels = batch
        logits = self(dense, sparse)
        self.val_loss.update(F.binary_cross_entropy_with_logits(logits, labels), weight=labels.shape[0])
        self.val_auc.update(logits, labels.long())
        self.log("val_loss", self.val_loss, on_step=False, on_epoch=True, sync_dist=True)
        self.log("val_auc", self.val_auc, on_step=False, on_epoch=True, sync_dist=True, prog_bar=True)

    @override
    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.hparams.optimizer == "adagrad":
            return torch.optim.Adagrad(self.parameters(), lr=self.hparams.lr)
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)
