"""The built-in classification workload: data, splits, and the training behaviour benchmarks rely on."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from lightning.pytorch import Trainer
from torch.utils.data import RandomSampler, SequentialSampler

from lightning_dynamix.data import (
    DEFAULT_TARGET_ACCURACY,
    ClassificationDataModule,
    ClassificationTask,
    GaussianMixtureClassificationDataset,
)

SMALL = {"num_samples": 4096, "num_val_samples": 2048}


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """Train on one thread, as each rank of the benchmarks does (and the machines have few cores)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def fit(batch_size: int, lr: float, epochs: int, **task_args: Any) -> float:
    """Trains the default task on the small split for ``epochs`` epochs; returns the final validation accuracy."""
    data = ClassificationDataModule(batch_size=batch_size, **SMALL)
    task = ClassificationTask(lr=lr, **task_args)
    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=epochs,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(task, data)
    return float(trainer.callback_metrics["val_acc"])


def test_dataset_is_deterministic_for_a_seed() -> None:
    first = GaussianMixtureClassificationDataset(num_samples=512, seed=3)
    second = GaussianMixtureClassificationDataset(num_samples=512, seed=3)
    assert torch.equal(first.features, second.features)
    assert torch.equal(first.labels, second.labels)


def test_dataset_differs_between_seeds() -> None:
    first = GaussianMixtureClassificationDataset(num_samples=512, seed=0)
    second = GaussianMixtureClassificationDataset(num_samples=512, seed=1)
    assert not torch.allclose(first.features, second.features)
    assert not torch.equal(first.labels, second.labels)


def test_dataset_items_are_feature_vectors_and_class_indices() -> None:
    dataset = GaussianMixtureClassificationDataset(num_samples=100, num_features=12, num_classes=5, dtype=torch.float64)
    features, label = dataset[7]
    assert len(dataset) == 100
    assert features.shape == (12,)
    assert features.dtype == torch.float64
    assert label.dtype == torch.int64
    assert 0 <= int(label) < 5


def test_labels_are_balanced() -> None:
    dataset = GaussianMixtureClassificationDataset(num_samples=20000, num_classes=10)
    counts = torch.bincount(dataset.labels, minlength=10)
    assert counts.min() > 0.85 * 2000
    assert counts.max() < 1.15 * 2000


def test_bayes_accuracy_is_below_one_and_grows_with_separation() -> None:
    default = GaussianMixtureClassificationDataset(num_samples=8192)
    easier = GaussianMixtureClassificationDataset(num_samples=8192, separation=4.0)
    harder = GaussianMixtureClassificationDataset(num_samples=8192, separation=1.5)
    assert 0.95 < default.bayes_accuracy < 1.0
    assert harder.bayes_accuracy < default.bayes_accuracy < easier.bayes_accuracy


def test_feature_scales_span_the_requested_ratio() -> None:
    dataset = GaussianMixtureClassificationDataset(num_samples=8192, feature_scale_ratio=100.0)
    std = dataset.features.std(dim=0)
    assert 30.0 < float(std.max() / std.min()) < 300.0
    same = GaussianMixtureClassificationDataset(num_samples=8192, feature_scale_ratio=1.0)
    std = same.features.std(dim=0)
    assert float(std.max() / std.min()) < 3.0


def test_datamodule_splits_are_disjoint_and_sized() -> None:
    data = ClassificationDataModule(num_samples=1000, num_val_samples=300)
    data.setup("fit")
    train = torch.stack([features for features, _ in data.train_dataloader().dataset])
    val = torch.stack([features for features, _ in data.val_dataloader().dataset])
    assert train.shape == (1000, data.num_features)
    assert val.shape == (300, data.num_features)
    assert torch.unique(torch.cat([train, val]), dim=0).shape[0] == 1300


def test_dataloaders_shuffle_training_only() -> None:
    data = ClassificationDataModule(num_samples=1000, num_val_samples=300, batch_size=48, val_batch_size=100)
    data.setup("fit")
    train, val = data.train_dataloader(), data.val_dataloader()
    assert isinstance(train.sampler, RandomSampler)
    assert train.batch_size == 48
    assert isinstance(val.sampler, SequentialSampler)
    assert val.batch_size == 100


def test_validation_bayes_accuracy_is_a_ceiling_well_above_the_target() -> None:
    data = ClassificationDataModule()
    assert DEFAULT_TARGET_ACCURACY + 0.05 < data.val_bayes_accuracy < 1.0


def test_task_seed_fixes_initial_weights_without_touching_the_global_generator() -> None:
    state = torch.random.get_rng_state()
    first, second = ClassificationTask(seed=5), ClassificationTask(seed=5)
    assert torch.equal(torch.random.get_rng_state(), state)
    for a, b in zip(first.parameters(), second.parameters(), strict=True):
        assert torch.equal(a, b)
    other = ClassificationTask(seed=6)
    assert not torch.equal(next(first.parameters()), next(other.parameters()))


def test_task_network_shape() -> None:
    task = ClassificationTask(num_features=12, num_classes=5, hidden=16, depth=3)
    assert task(torch.randn(7, 12)).shape == (7, 5)
    assert sum(isinstance(layer, torch.nn.Linear) for layer in task.network) == 4
    assert task.hparams.hidden == 16


def test_the_transformer_reads_groups_of_features_as_tokens_and_learns_the_task() -> None:
    task = ClassificationTask(num_features=12, num_classes=5, hidden=16, depth=1, architecture="transformer", seed=0)
    assert task(torch.randn(7, 12)).shape == (7, 5)
    assert task.network.position.shape == (3, 16)  # 12 features in tokens of 4
    assert isinstance(task.network.encoder.layers[0], torch.nn.TransformerEncoderLayer)
    chance = 1 / 10
    accuracy = fit(batch_size=64, lr=0.003, epochs=6, architecture="transformer", hidden=32, optimizer="adam")
    assert accuracy > chance + 0.3


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_configure_optimizers_uses_the_learning_rate(optimizer: str) -> None:
    task = ClassificationTask(lr=0.123, optimizer=optimizer, weight_decay=0.01)
    configured = task.configure_optimizers()
    assert configured.param_groups[0]["lr"] == 0.123
    assert configured.param_groups[0]["weight_decay"] == 0.01
    assert isinstance(configured, torch.optim.SGD if optimizer == "sgd" else torch.optim.Adam)


def test_training_lifts_validation_accuracy_far_above_chance() -> None:
    chance = 1 / 10
    assert fit(batch_size=64, lr=0.1, epochs=3) > chance + 0.4


def test_logged_validation_accuracy_is_the_fraction_classified_correctly() -> None:
    data = ClassificationDataModule(**SMALL)
    task = ClassificationTask()
    trainer = Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, enable_model_summary=False)
    (logged,) = trainer.validate(task, data, verbose=False)
    features, labels = zip(*data.val_dataloader().dataset, strict=True)
    with torch.no_grad():
        logits = task(torch.stack(features))
    labels_tensor = torch.stack(labels)
    assert logged["val_acc"] == pytest.approx(float((logits.argmax(dim=1) == labels_tensor).float().mean()))
    expected_loss = float(torch.nn.functional.cross_entropy(logits, labels_tensor))
    assert logged["val_loss"] == pytest.approx(expected_loss, rel=1e-5)


def test_fit_after_validate_works() -> None:
    # trainer.validate leaves inference-mode metric states behind, which the task must recover from
    data = ClassificationDataModule(num_samples=256, num_val_samples=128, batch_size=64)
    task = ClassificationTask(hidden=16)
    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.validate(task, data, verbose=False)
    trainer.fit(task, data)
    assert trainer.global_step == 4
    assert 0.0 <= float(trainer.callback_metrics["val_acc"]) <= 1.0


def test_small_batches_learn_more_from_the_same_samples_than_large_batches_at_the_same_lr() -> None:
    # two epochs each: 256 steps of 32 samples against 4 steps of 2048
    small = fit(batch_size=32, lr=0.05, epochs=2)
    large = fit(batch_size=2048, lr=0.05, epochs=2)
    assert small > large + 0.25


def test_learning_rate_changes_how_fast_accuracy_climbs() -> None:
    fast = fit(batch_size=64, lr=0.1, epochs=2)
    slow = fit(batch_size=64, lr=0.005, epochs=2)
    assert fast > slow + 0.15


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"num_samples": 0}, "`num_samples` must be an int >= 1, got 0"),
        ({"num_features": 4, "informative_features": 8}, "`num_features` must be at least `informative_features`"),
        ({"num_classes": 1}, "`num_classes` must be an int >= 2, got 1"),
        ({"clusters_per_class": 0}, "`clusters_per_class`"),
        ({"separation": 0.0}, "`separation` must be a finite number > 0.0"),
        ({"feature_scale_ratio": 0.5}, "`feature_scale_ratio` must be a finite number >= 1.0"),
        ({"seed": -1}, "`seed` must be an int >= 0"),
        ({"dtype": torch.int64}, "`dtype` must be a floating torch dtype"),
    ],
)
def test_dataset_rejects_bad_arguments(arguments: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        GaussianMixtureClassificationDataset(**arguments)


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"num_samples": 0}, "`num_samples`"),
        ({"num_val_samples": 0}, "`num_val_samples`"),
        ({"batch_size": 0}, "`batch_size` must be an int >= 1, got 0"),
        ({"val_batch_size": 2.5}, "`val_batch_size`"),
        ({"num_workers": -1}, "`num_workers` must be an int >= 0"),
        ({"separation": float("nan")}, "`separation`"),
        ({"num_classes": True}, "`num_classes`"),
    ],
)
def test_datamodule_rejects_bad_arguments(arguments: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ClassificationDataModule(**arguments)


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"hidden": 0}, "`hidden` must be an int >= 1, got 0"),
        ({"depth": -1}, "`depth` must be an int >= 0"),
        ({"lr": 0.0}, "`lr` must be a finite number > 0.0, got 0.0"),
        ({"momentum": 1.0}, r"`momentum` must be a number in \[0, 1\), got 1.0"),
        ({"optimizer": "rmsprop"}, "`optimizer` must be 'sgd' or 'adam', got 'rmsprop'"),
        ({"weight_decay": -0.1}, "`weight_decay` must be a finite number >= 0.0"),
        ({"seed": -3}, "`seed`"),
        ({"architecture": "cnn"}, "`architecture` must be one of \\['mlp', 'transformer', 'resnet'\\], got 'cnn'"),
        ({"architecture": "transformer", "depth": 0}, "`depth` must be an int >= 1"),
        ({"architecture": "transformer", "num_features": 30}, r"`num_features` \(30\) must be a multiple of"),
        ({"architecture": "transformer", "hidden": 30}, r"`hidden` \(30\) must be a multiple of 4"),
    ],
)
def test_task_rejects_bad_arguments(arguments: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ClassificationTask(**arguments)


def test_the_one_mlp_builder_makes_every_model_s_layers_and_refuses_bad_widths():
    from torch import nn

    from lightning_dynamix._layers import mlp

    layers = mlp([4, 8, 3])
    assert [type(m) for m in layers] == [nn.Linear, nn.ReLU, nn.Linear]
    assert [type(m) for m in mlp([4, 8], activation=nn.Tanh, final_activation=True)] == [nn.Linear, nn.Tanh]
    with pytest.raises(ValueError, match=r"`widths` must be two or more ints >= 1 .* got \[4\]"):
        mlp([4])
    with pytest.raises(ValueError, match="got \\[4, 0\\]"):
        mlp([4, 0])


def test_the_synthetic_images_are_the_seed_s_and_a_resnet_with_batch_norm_classifies_them():
    from lightning_dynamix.data.images import ImageClassificationDataModule, ResNet, SyntheticImageDataset
    from lightning_dynamix.data.workloads import ClassificationTask

    first, again = SyntheticImageDataset(40, seed=3), SyntheticImageDataset(40, seed=3)
    assert torch.equal(first.images, again.images)
    assert torch.equal(first.labels, again.labels)
    assert not torch.equal(first.images, SyntheticImageDataset(40, seed=4).images)
    image, label = first[0]
    assert image.shape == (3, 16, 16)
    assert image.dtype == torch.float32
    assert 0 <= int(label) < 10
    data = ImageClassificationDataModule(num_samples=30, num_val_samples=10, batch_size=4, size=8)
    train, val = data.train_dataloader(), data.val_dataloader()
    assert len(train.dataset) == 30
    assert len(val.dataset) == 10
    assert next(iter(train))[0].shape == (4, 3, 8, 8)
    task = ClassificationTask(architecture="resnet", hidden=4)
    assert isinstance(task.network, ResNet)
    assert sum(isinstance(m, torch.nn.BatchNorm2d) for m in task.network.modules()) == 9
    assert task(next(iter(train))[0]).shape == (4, 10)
    with pytest.raises(ValueError, match=r"`max_shift` must be below `size` \(8\), got 8"):
        SyntheticImageDataset(4, size=8, max_shift=8)
    with pytest.raises(ValueError, match=r"`architecture` must be one of \['mlp', 'transformer', 'resnet'\]"):
        ClassificationTask(architecture="vgg")
