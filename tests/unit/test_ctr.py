"""The built-in CTR workload: generated data shaped like Criteo's, and the DLRM example that learns it."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from lightning.pytorch import Trainer
from torch.utils.data import DataLoader, Dataset, RandomSampler, SequentialSampler
from torchmetrics.functional.classification import binary_auroc

from lightning_dynamix.data import (
    CRITEO_LIKE_TABLE_SIZES,
    CTRDataModule,
    CTRSpec,
    EmptyBatch,
    HeterogeneousBatchSampler,
    HeterogeneousDataLoader,
    SyntheticCTRDataset,
    collate_ctr,
)

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "ctr" / "dlrm.py"
SMALL_TABLES = (1460, 583, 10000, 5000, 305, 24, 2000, 633, 3, 9000, 1000, 10000, 3194,
                27, 1500, 10000, 10, 1000, 2173, 4, 10000, 18, 15, 2800, 105, 1400)  # fmt: skip


def _load_example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("examples_ctr_dlrm", EXAMPLE)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


dlrm = _load_example()


def test_default_spec_is_criteo_shaped() -> None:
    spec = CTRSpec()
    assert spec.num_dense == 13
    assert spec.num_tables == 26
    assert spec.table_sizes == CRITEO_LIKE_TABLE_SIZES
    assert min(spec.table_sizes) < 100
    assert max(spec.table_sizes) >= 100_000


def test_items_are_dense_features_ids_and_a_label() -> None:
    dataset = SyntheticCTRDataset(1000)
    dense, sparse, label = dataset[17]
    assert len(dataset) == 1000
    assert dense.shape == (13,)
    assert dense.dtype == torch.float32
    assert sparse.shape == (26,)
    assert sparse.dtype == torch.int64
    assert label.shape == ()
    assert label.dtype == torch.float32
    assert set(dataset.labels.unique().tolist()) == {0.0, 1.0}
    # log1p of heavy-tailed counts: the largest count of every feature is several times its median
    counts = torch.expm1(dataset.dense.double())
    assert torch.allclose(counts, counts.round(), atol=1e-2)
    assert counts.min() >= 0
    counts = counts.round()
    assert (counts.max(0).values > 3 * counts.median(0).values.clamp_min(1)).all()


def test_ids_lie_within_each_table() -> None:
    spec = CTRSpec(table_sizes=(1, 3, 50, 7000), num_dense=2)
    sparse = SyntheticCTRDataset(5000, spec).sparse
    assert sparse.min() >= 0
    for table, size in enumerate(spec.table_sizes):
        assert int(sparse[:, table].max()) < size
    assert int(sparse[:, 2].unique().numel()) > 25  # the small table's rows are all in use


def test_same_seed_same_samples_other_seed_other_samples() -> None:
    first, second = SyntheticCTRDataset(3000, CTRSpec(seed=4)), SyntheticCTRDataset(3000, CTRSpec(seed=4))
    other = SyntheticCTRDataset(3000, CTRSpec(seed=5))
    for name in ("dense", "sparse", "labels", "click_probabilities"):
        assert torch.equal(getattr(first, name), getattr(second, name))
        assert not torch.equal(getattr(first, name), getattr(other, name))


def test_a_sample_depends_only_on_its_index() -> None:
    spec = CTRSpec(table_sizes=SMALL_TABLES)
    whole = SyntheticCTRDataset(10000, spec)
    part = SyntheticCTRDataset(3000, spec, start=4000)  # crosses a block boundary (4096)
    for name in ("dense", "sparse", "labels"):
        assert torch.equal(getattr(part, name), getattr(whole, name)[4000:7000])


def test_ids_follow_a_power_law_with_the_hot_rows_scattered() -> None:
    spec = CTRSpec()
    sparse = SyntheticCTRDataset(20000, spec).sparse
    large = spec.table_sizes.index(100_000)
    counts = torch.bincount(sparse[:, large], minlength=100_000).sort(descending=True).values
    draws = sparse.shape[0]
    # Zipf(1.1) over 10^5 rows: the hottest row takes about 13% of draws (uniform: 0.001%)
    assert counts[0] / draws > 0.05
    assert counts[:1000].sum() / draws > 0.6  # the hottest 1% of rows
    hottest = [int(torch.bincount(sparse[:, t]).argmax()) for t in range(spec.num_tables) if spec.table_sizes[t] > 100]
    assert len(set(hottest)) > len(hottest) // 2  # not always row 0: each table has its own hot rows
    # a larger exponent concentrates the draws further
    skewed = SyntheticCTRDataset(20000, CTRSpec(zipf_exponent=1.5)).sparse[:, large]
    assert torch.bincount(skewed).max() > counts[0]


def test_labels_carry_learnable_signal_at_the_requested_positive_rate() -> None:
    dataset = SyntheticCTRDataset(20000, CTRSpec(positive_rate=0.25))
    assert 0.1 < float(dataset.labels.mean()) < 0.5
    assert float(dataset.labels.mean()) == pytest.approx(0.25, abs=0.02)
    teacher_auc = float(binary_auroc(dataset.click_probabilities, dataset.labels.long()))
    assert 0.7 < teacher_auc < 0.95
    noise = SyntheticCTRDataset(20000, CTRSpec(logit_std=0.0))
    assert float(binary_auroc(noise.click_probabilities, noise.labels.long())) == pytest.approx(0.5)


def test_datamodule_splits_are_disjoint_index_ranges_of_one_spec() -> None:
    data = CTRDataModule(num_samples=3000, num_val_samples=1000, table_sizes=SMALL_TABLES, batch_size=64)
    data.setup("fit")
    train, val = data.train_dataloader(), data.val_dataloader()
    assert len(train.dataset) == 3000
    assert len(val.dataset) == 1000
    expected = SyntheticCTRDataset(1000, data.spec, start=3000)
    assert torch.equal(val.dataset.dense, expected.dense)
    assert isinstance(train.sampler, RandomSampler)
    assert train.batch_size == 64
    assert isinstance(val.sampler, SequentialSampler)
    dense, sparse, labels = next(iter(train))
    assert dense.shape == (64, 13)
    assert sparse.shape == (64, 26)
    assert labels.shape == (64,)


def test_a_batch_read_at_once_is_the_batch_read_sample_by_sample() -> None:
    dataset = SyntheticCTRDataset(1000, CTRSpec(table_sizes=SMALL_TABLES))

    class OneByOne(Dataset):  # the same samples without __getitems__: read and collated one by one
        def __len__(self) -> int:
            return len(dataset)

        def __getitem__(self, index: int) -> Any:
            return dataset[index]

    def batches(source: Dataset, **kwargs: Any) -> list[Any]:
        generator = torch.Generator().manual_seed(3)
        return list(DataLoader(source, batch_size=64, shuffle=True, generator=generator, **kwargs))

    expected = batches(OneByOne())
    # the data module's collate function, and a user's loader with torch's default
    for read in (batches(dataset, collate_fn=collate_ctr), batches(dataset)):
        assert len(read) == len(expected) == 16
        for got, want in zip(read, expected, strict=True):
            for g, w in zip(got, want, strict=True):
                assert g.dtype == w.dtype
                assert torch.equal(g, w)
    # the heterogeneous loader over the data module's: a rank's batches, and its empty ones
    data = CTRDataModule(num_samples=96, num_val_samples=1, table_sizes=SMALL_TABLES, batch_size=32)
    for rank, size in enumerate((32, 0)):
        sampler = HeterogeneousBatchSampler(data.train_dataloader().dataset, [32, 0], rank=rank, world_size=2)
        read = list(HeterogeneousDataLoader.like(data.train_dataloader(), sampler))
        assert len(read) == 3
        for batch in read:
            if size:
                assert [t.shape[0] for t in batch] == [32, 32, 32]
            else:
                assert isinstance(batch, EmptyBatch)


def test_dlrm_keeps_one_named_embedding_table_per_feature() -> None:
    model = dlrm.DLRM(num_dense=4, table_sizes=(10, 20, 30), embedding_dim=8)
    embeddings = {name: m for name, m in model.named_modules() if isinstance(m, torch.nn.Embedding)}
    assert list(embeddings) == ["embeddings.0", "embeddings.1", "embeddings.2"]
    assert [table.weight.shape for table in embeddings.values()] == [(10, 8), (20, 8), (30, 8)]
    logits = model(torch.randn(5, 4), torch.tensor([[9, 19, 29]] * 5))
    assert logits.shape == (5,)


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad"])
def test_dlrm_optimizer_is_chosen_by_name(optimizer: str) -> None:
    configured = dlrm.DLRM(table_sizes=(5, 5), optimizer=optimizer, lr=0.123).configure_optimizers()
    assert isinstance(configured, torch.optim.SGD if optimizer == "sgd" else torch.optim.Adagrad)
    assert configured.param_groups[0]["lr"] == 0.123


@pytest.mark.e2e
def test_dlrm_learns_clicks_well_above_chance() -> None:
    # one epoch of 256 steps; the teacher's own AUC on these samples is about 0.87, the model reaches about 0.77
    data = CTRDataModule(num_samples=65536, num_val_samples=8192, table_sizes=SMALL_TABLES, batch_size=256, seed=0)
    model = dlrm.DLRM(table_sizes=SMALL_TABLES, seed=0)
    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(model, data)
    assert trainer.global_step == 256
    assert float(trainer.callback_metrics["val_auc"]) > 0.7


@pytest.mark.e2e
def test_the_example_runs_from_its_yaml_config(tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    command = [sys.executable, str(EXAMPLE), "fit", "--config", str(EXAMPLE.with_suffix(".yaml"))]
    command += ["--trainer.max_steps", "20", "--trainer.default_root_dir", str(tmp_path)]
    proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"num_dense": 0}, "`num_dense` must be an int >= 1, got 0"),
        ({"table_sizes": ()}, "`table_sizes` must be a non-empty sequence"),
        ({"table_sizes": 26}, "`table_sizes` must be a non-empty sequence"),
        ({"table_sizes": (10, 0, 5)}, r"`table_sizes\[1\]` must be an int >= 1, got 0"),
        ({"table_sizes": (10, 2.5)}, r"`table_sizes\[1\]`"),
        ({"zipf_exponent": 0.0}, "`zipf_exponent` must be a finite number > 0.0, got 0.0"),
        ({"zipf_exponent": -1}, "`zipf_exponent`"),
        ({"teacher_dim": 0}, "`teacher_dim` must be an int >= 1"),
        ({"positive_rate": 1.0}, r"`positive_rate` must be a number in \(0.0, 1.0\), got 1.0"),
        ({"logit_std": -0.5}, "`logit_std` must be a finite number >= 0.0"),
        ({"seed": -1}, "`seed` must be an int >= 0"),
    ],
)
def test_spec_rejects_bad_arguments(arguments: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        CTRSpec(**arguments)


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"num_samples": 0}, "`num_samples` must be an int >= 1, got 0"),
        ({"num_samples": 10, "start": -1}, "`start` must be an int >= 0, got -1"),
        ({"num_samples": 10, "spec": {"num_dense": 13}}, "`spec` must be a CTRSpec or None"),
    ],
)
def test_dataset_rejects_bad_arguments(arguments: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SyntheticCTRDataset(**arguments)


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"num_val_samples": 0}, "`num_val_samples`"),
        ({"batch_size": 0}, "`batch_size` must be an int >= 1, got 0"),
        ({"num_workers": -1}, "`num_workers`"),
        ({"table_sizes": [5, -3]}, r"`table_sizes\[1\]`"),
        ({"zipf_exponent": float("nan")}, "`zipf_exponent`"),
    ],
)
def test_datamodule_rejects_bad_arguments(arguments: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        CTRDataModule(**arguments)


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"num_dense": 0}, "`num_dense` must be an int >= 1"),
        ({"table_sizes": []}, "`table_sizes` must be a non-empty sequence"),
        ({"table_sizes": [4, 0]}, r"`table_sizes\[1\]` must be an int >= 1, got 0"),
        ({"embedding_dim": 0}, "`embedding_dim` must be an int >= 1"),
        ({"bottom_mlp": [64, 0]}, r"`bottom_mlp\[1\]` must be an int >= 1"),
        ({"top_mlp": 64}, "`top_mlp` must be a sequence of hidden-layer widths"),
        ({"optimizer": "adam"}, "`optimizer` must be 'sgd' or 'adagrad', got 'adam'"),
        ({"lr": 0.0}, "`lr` must be a finite number > 0.0"),
        ({"seed": -2}, "`seed`"),
    ],
)
def test_dlrm_rejects_bad_arguments(arguments: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        dlrm.DLRM(**arguments)
