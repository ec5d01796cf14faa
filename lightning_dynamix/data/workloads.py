"""A built-in classification workload for time-to-accuracy measurements: nothing is downloaded.

How it works, in full: ``docs/internals.md``, section ``lightning_dynamix/data/workloads.py``.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningDataModule, LightningModule
from torch import nn
from torch.utils.data import DataLoader, Dataset, Subset
from torchmetrics import MeanMetric
from torchmetrics.classification import MulticlassAccuracy
from typing_extensions import override

from lightning_dynamix._checks import require_int, require_number
from lightning_dynamix._layers import mlp
from lightning_dynamix.data.images import ResNet
from lightning_dynamix.data.splits import check_splits, split_loader

Batch = tuple[torch.Tensor, torch.Tensor]
OptimizerName = Literal["sgd", "adam"]
ArchitectureName = Literal["mlp", "transformer", "resnet"]
ARCHITECTURES: tuple[str, ...] = ("mlp", "transformer", "resnet")

DEFAULT_TARGET_ACCURACY = 0.85
"""Validation accuracy that the default workload reaches after several epochs with a decent configuration."""

_SAMPLE_STREAM = 0x5EED_DA7A
"""Offset between the seed of the mixture (centres, rotation) and the seed of the samples drawn from it."""


def _check_mixture(
    num_features: object,
    num_classes: object,
    clusters_per_class: object,
    informative_features: object,
    separation: object,
    feature_scale_ratio: object,
) -> None:
    require_int("num_features", num_features, 1)
    require_int("num_classes", num_classes, 2)
    require_int("clusters_per_class", clusters_per_class, 1)
    require_int("informative_features", informative_features, 1)
    if num_features < informative_features:  # type: ignore[operator]
        raise ValueError(
            f"`num_features` must be at least `informative_features` ({informative_features}), got {num_features}"
        )
    require_number("separation", separation, 0.0, low_open=True)
    require_number("feature_scale_ratio", feature_scale_ratio, 1.0)


class GaussianMixtureClassificationDataset(Dataset[Batch]):
    """Samples of a Gaussian mixture with ``clusters_per_class`` clusters per class.

    Each class owns ``clusters_per_class`` cluster centres drawn from ``N(0, separation² I)`` in an
    ``informative_features``-dimensional space; a sample picks one of all the clusters uniformly
    (so classes are balanced in expectation), adds unit Gaussian noise, is padded with
    ``num_features - informative_features`` pure-noise coordinates, and is rotated by a random
    orthogonal matrix, so no single feature is informative on its own; finally feature ``j`` is
    multiplied by ``feature_scale_ratio ** (-j / (num_features - 1))``, so the standard deviations
    of the features are log-spaced from 1 down to ``1 / feature_scale_ratio``, which slows plain SGD
    down without changing what can be learnt. Labels are never noisy: errors come only from clusters
    of different classes overlapping, which ``separation`` controls (larger is easier). The same
    arguments always give the same samples.

    Attributes:
        features: ``(num_samples, num_features)`` feature matrix.
        labels: ``(num_samples,)`` class indices (int64).
        bayes_predictions: ``(num_samples,)`` the class the Bayes-optimal classifier (which knows
            the mixture) predicts for each sample.
        bayes_accuracy: fraction of samples that the Bayes-optimal classifier gets right, in [0, 1]:
            the accuracy ceiling of any model on these samples.

    Args:
        num_samples: number of samples.
        num_features: length of each feature vector; at least ``informative_features``.
        num_classes: number of classes, at least 2.
        clusters_per_class: Gaussian clusters per class; more is harder (less linear).
        informative_features: dimension of the subspace that holds the clusters.
        separation: standard deviation of the cluster centres, in units of the within-cluster standard
            deviation; larger separates the classes better and raises :attr:`bayes_accuracy`.
        feature_scale_ratio: ratio of the largest to the smallest feature standard deviation, at least 1
            (1: all features alike); larger makes SGD slower.
        seed: seed of the mixture and of the samples.
        dtype: floating dtype of the features.
    """

    def __init__(
        self,
        num_samples: int = 24576,
        num_features: int = 32,
        num_classes: int = 10,
        clusters_per_class: int = 8,
        informative_features: int = 8,
        separation: float = 2.5,
        feature_scale_ratio: float = 100.0,
        seed: int = 0,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        require_int("num_samples", num_samples, 1)
        _check_mixture(
            num_features, num_classes, clusters_per_class, informative_features, separation, feature_scale_ratio
        )
        require_int("seed", seed, 0)
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise ValueError(f"`dtype` must be a floating torch dtype such as torch.float32, got {dtype!r}")

        mixture = torch.Generator().manual_seed(seed)
        num_clusters = num_classes * clusters_per_class
        centres = separation * torch.randn(num_clusters, informative_features, generator=mixture, dtype=torch.float64)
        rotation, _ = torch.linalg.qr(torch.randn(num_features, num_features, generator=mixture, dtype=torch.float64))

        samples = torch.Generator().manual_seed(seed + _SAMPLE_STREAM)
        cluster = torch.randint(num_clusters, (num_samples,), generator=samples)
        latent = torch.randn(num_samples, num_features, generator=samples, dtype=torch.float64)
        latent[:, :informative_features] += centres[cluster]
        # cluster c belongs to class c % num_classes
        labels = cluster % num_classes

        squared_distances = torch.cdist(latent[:, :informative_features], centres).square()
        class_log_likelihood = torch.logsumexp(
            (-0.5 * squared_distances).view(num_samples, clusters_per_class, num_classes), dim=1
        )
        self.bayes_predictions = class_log_likelihood.argmax(dim=1)
        self.bayes_accuracy = float((self.bayes_predictions == labels).double().mean())
        # log-spaced scales from 1 down to 1 / feature_scale_ratio
        scales = feature_scale_ratio ** -torch.linspace(0.0, 1.0, num_features, dtype=torch.float64)
        self.features = (latent @ rotation.T * scales).to(dtype)
        self.labels = labels
        self.num_features = num_features
        self.num_classes = num_classes

    def __len__(self) -> int:
        return self.features.shape[0]

    def __getitem__(self, index: int) -> Batch:
        return self.features[index], self.labels[index]


class ClassificationDataModule(LightningDataModule):
    """Training and validation splits of one :class:`GaussianMixtureClassificationDataset`.

    One set of ``num_samples + num_val_samples`` samples is generated from ``seed`` at
    :meth:`setup` (the whole set is kept in :attr:`dataset`); the first
    ``num_samples`` train and the rest validate, so the splits are disjoint and come from the same
    mixture. Every process generates the same set, so nothing needs to be shared between ranks.
    The training DataLoader shuffles with a plain sampler, which ``HeterogeneousDDPStrategy``
    replaces with a per-rank batch sampler; the validation DataLoader does not shuffle.

    Args:
        num_samples: training samples.
        num_val_samples: validation samples.
        num_features: length of each feature vector.
        num_classes: number of classes.
        clusters_per_class: Gaussian clusters per class.
        informative_features: dimension of the subspace that holds the clusters.
        separation: spread of the cluster centres in within-cluster standard deviations (larger is easier).
        feature_scale_ratio: ratio of the largest to the smallest feature standard deviation (1: all alike).
        batch_size: samples per training batch (per rank; the strategy may override it).
        val_batch_size: samples per validation batch; default: 1024.
        num_workers: DataLoader worker processes.
        seed: seed of the mixture, the samples and the training shuffle.
    """

    def __init__(
        self,
        num_samples: int = 16384,
        num_val_samples: int = 8192,
        num_features: int = 32,
        num_classes: int = 10,
        clusters_per_class: int = 8,
        informative_features: int = 8,
        separation: float = 2.5,
        feature_scale_ratio: float = 100.0,
        batch_size: int = 64,
        val_batch_size: int = 1024,
        num_workers: int = 0,
        seed: int = 0,
    ) -> None:
        super().__init__()
        check_splits(num_samples, num_val_samples, batch_size, val_batch_size, num_workers)
        _check_mixture(
            num_features, num_classes, clusters_per_class, informative_features, separation, feature_scale_ratio
        )
        require_int("seed", seed, 0)
        self.save_hyperparameters()
        self.num_features = num_features
        self.num_classes = num_classes
        self.dataset: GaussianMixtureClassificationDataset | None = None

    @override
    def setup(self, stage: str) -> None:
        if self.dataset is not None:
            return
        h = self.hparams
        self.dataset = GaussianMixtureClassificationDataset(
            num_samples=h.num_samples + h.num_val_samples,
            num_features=h.num_features,
            num_classes=h.num_classes,
            clusters_per_class=h.clusters_per_class,
            informative_features=h.informative_features,
            separation=h.separation,
            feature_scale_ratio=h.feature_scale_ratio,
            seed=h.seed,
        )

    def _generated(self) -> GaussianMixtureClassificationDataset:
        if self.dataset is None:
            self.setup("fit")
        assert self.dataset is not None  # setup() always sets it
        return self.dataset

    @property
    def val_bayes_accuracy(self) -> float:
        """The Bayes-optimal classifier's accuracy on the validation split, in [0, 1]: no model can do better."""
        dataset = self._generated()
        start = self.hparams.num_samples
        return float((dataset.bayes_predictions[start:] == dataset.labels[start:]).double().mean())

    @override
    def train_dataloader(self) -> DataLoader[Batch]:
        h = self.hparams
        return split_loader(Subset(self._generated(), range(h.num_samples)), h.batch_size, h.num_workers, h.seed)

    @override
    def val_dataloader(self) -> DataLoader[Batch]:
        h = self.hparams
        validation = Subset(self._generated(), range(h.num_samples, h.num_samples + h.num_val_samples))
        return split_loader(validation, h.val_batch_size, h.num_workers, seed=None)


class FeatureTransformer(nn.Module):
    """A transformer encoder classifier over the features taken as tokens of ``token_features`` each.

    The features are split into ``num_features / token_features`` tokens, each embedded linearly to
    ``d_model`` with a learned position, encoded by ``depth`` pre-norm encoder layers (GELU,
    ``4 x d_model`` feed-forward, ``heads`` heads), mean-pooled and classified linearly: another
    model family than the MLP (attention, layer norm, more compute per parameter).
    """

    def __init__(
        self, num_features: int, num_classes: int, d_model: int, depth: int, token_features: int = 4, heads: int = 4
    ) -> None:
        super().__init__()
        if num_features % token_features:
            raise ValueError(
                f"`num_features` ({num_features}) must be a multiple of the token size {token_features}"
                " for architecture='transformer'"
            )
        if d_model % heads:
            raise ValueError(f"`hidden` ({d_model}) must be a multiple of {heads} (attention heads) for a transformer")
        self.token_features = token_features
        self.embed = nn.Linear(token_features, d_model)
        self.position = nn.Parameter(torch.randn(num_features // token_features, d_model) * 0.02)
        layer = nn.TransformerEncoderLayer(
            d_model, heads, 4 * d_model, dropout=0.0, activation="gelu", batch_first=True, norm_first=True
        )
        self.encoder = nn.TransformerEncoder(layer, depth, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = self.embed(x.view(x.shape[0], -1, self.token_features)) + self.position
        return self.head(self.norm(self.encoder(tokens)).mean(dim=1))


class ClassificationTask(LightningModule):
    """A multi-layer perceptron classifier with cross-entropy loss and validation accuracy.

    Logs ``train_loss`` at every training step, and ``val_loss`` and ``val_acc`` (micro-averaged
    accuracy, the fraction of validation samples classified correctly) once per validation epoch.
    The validation metrics are torchmetrics objects, so under DDP they are reduced over all
    ranks' samples exactly.

    Args:
        num_features: input features per sample.
        num_classes: classes.
        hidden: width of each hidden layer (the transformer's model width).
        depth: number of hidden layers (0 is a linear classifier); the transformer's encoder layers.
        lr: learning rate; the default suits SGD at a global batch of 128 samples (scale it in proportion
            to the global batch: 0.1 at 256, 0.2 at 512).
        momentum: SGD momentum (ignored by Adam).
        optimizer: ``"sgd"`` or ``"adam"``.
        weight_decay: L2 penalty coefficient.
        seed: seed of the initial weights; ``None`` draws them from the global generator.
        sync_train_loss: average the logged training loss over ranks at every step
            (one extra all-reduce per step).
        architecture: ``"mlp"``, or ``"transformer"`` for a :class:`FeatureTransformer` (another
            model family, for measuring how policies and controllers transfer), or ``"resnet"`` for a
            :class:`~lightning_dynamix.data.images.ResNet` with BatchNorm over images of
            :class:`~lightning_dynamix.data.images.ImageClassificationDataModule` (``hidden`` is its first
            stage's width; ``num_features`` and ``depth`` do not apply).
    """

    def __init__(
        self,
        num_features: int = 32,
        num_classes: int = 10,
        hidden: int = 768,
        depth: int = 2,
        lr: float = 0.05,
        momentum: float = 0.9,
        optimizer: OptimizerName = "sgd",
        weight_decay: float = 0.0,
        seed: int | None = 0,
        sync_train_loss: bool = False,
        architecture: ArchitectureName = "mlp",
    ) -> None:
        super().__init__()
        require_int("num_features", num_features, 1)
        require_int("num_classes", num_classes, 2)
        require_int("hidden", hidden, 1)
        require_int("depth", depth, 0)
        require_number("lr", lr, 0.0, low_open=True)
        require_number("momentum", momentum, 0, 1)
        if optimizer not in ("sgd", "adam"):
            raise ValueError(f"`optimizer` must be 'sgd' or 'adam', got {optimizer!r}")
        require_number("weight_decay", weight_decay, 0.0)
        if seed is not None:
            require_int("seed", seed, 0)
        if architecture not in ARCHITECTURES:
            raise ValueError(f"`architecture` must be one of {list(ARCHITECTURES)}, got {architecture!r}")
        if architecture == "transformer":
            require_int("depth", depth, 1)
        self.save_hyperparameters()

        def build() -> nn.Module:
            if architecture == "transformer":
                return FeatureTransformer(num_features, num_classes, hidden, depth)
            if architecture == "resnet":
                return ResNet(num_classes, width=hidden)
            return mlp([num_features, *[hidden] * depth, num_classes])

        if seed is None:
            self.network = build()
        else:
            # PyTorch's default initialisation, from a seeded generator the caller's random state never sees
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                self.network = build()
        self.val_accuracy = MulticlassAccuracy(num_classes=num_classes, average="micro")
        self.val_loss = MeanMetric()

    @override
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Class logits, ``(batch, num_classes)``."""
        return self.network(x)

    @override
    def training_step(self, batch: Batch, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss, sync_dist=self.hparams.sync_train_loss, prog_bar=True)
        return loss

    @override
    def on_validation_epoch_start(self) -> None:
        # A `trainer.validate()` runs under inference mode, so the metric states it leaves behind are inference
        # tensors that a later `trainer.fit()` (whose validation runs under no_grad) could not update in place;
        # resetting here recreates them as ordinary tensors whenever that matters.
        self.val_loss.reset()
        self.val_accuracy.reset()

    @override
    def validation_step(self, batch: Batch, batch_idx: int) -> None:
        x, y = batch
        logits = self(x)
        self.val_loss.update(F.cross_entropy(logits, y), weight=y.shape[0])
        self.val_accuracy.update(logits, y)
        self.log("val_loss", self.val_loss, on_step=False, on_epoch=True, sync_dist=True)
        self.log("val_acc", self.val_accuracy, on_step=False, on_epoch=True, sync_dist=True, prog_bar=True)

    @override
    def configure_optimizers(self) -> torch.optim.Optimizer:
        h = self.hparams
        if h.optimizer == "adam":
            return torch.optim.Adam(self.parameters(), lr=h.lr, weight_decay=h.weight_decay)
        return torch.optim.SGD(self.parameters(), lr=h.lr, momentum=h.momentum, weight_decay=h.weight_decay)
