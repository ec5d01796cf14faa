"""A built-in click-through-rate (CTR) workload shaped like Criteo's display-ads data: nothing is downloaded.

Each sample is what a recommendation model reads from one ad impression: ``num_dense`` (13)
numerical features, one categorical id per embedding table (26 tables), and a click label. It is
the workload of the layer-offload strategy, where the embedding tables are what lives on CPU ranks;
the generator reproduces the properties of Criteo that matter there:

How it works, in full: ``docs/internals.md``, section ``lightning_dynamix/data/ctr.py``.
"""

from __future__ import annotations

import functools
import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from lightning.pytorch import LightningDataModule
from torch.utils.data import DataLoader, Dataset, default_collate
from typing_extensions import override

from lightning_dynamix._checks import require_int, require_number
from lightning_dynamix.data.splits import check_splits, split_loader

CTRSample = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
"""One sample, or a batch of them: dense features (float32), categorical ids (int64), click label (float32)."""

CRITEO_LIKE_TABLE_SIZES: tuple[int, ...] = (
    1460, 583, 100000, 50000, 305, 24, 12517, 633, 3, 93145, 5683, 100000, 3194,
    27, 14992, 100000, 10, 5652, 2173, 4, 100000, 18, 15, 28618, 105, 14257,
)  # fmt: skip
"""Rows of the 26 default tables: Criteo's categorical cardinalities in their order, the largest capped
at 10⁵ (633,418 rows in all, so the default spec builds in a fraction of a second)."""

BLOCK_SIZE = 4096
"""Samples generated from one seed: sample ``i`` belongs to block ``i // BLOCK_SIZE``."""

_CALIBRATION_SAMPLES = 16384
"""Samples of a separate stream on which the teacher's logit is scaled and shifted."""


def _stream_seed(seed: int, stream: str, index: int = 0) -> int:
    """A 63-bit seed for one stream (``"teacher"``, ``"calibration"``, ``"samples"``) and block of a spec's seed."""
    digest = hashlib.blake2b(f"{seed}/{stream}/{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


@dataclass(frozen=True)
class CTRSpec:
    """The shape of the synthetic CTR data and the seed it is generated from.

    Two equal specs give the same teacher and the same samples. A list given as ``table_sizes``
    is stored as a tuple, so a spec can be hashed.

    Args:
        num_dense: numerical features per sample, at least 1.
        table_sizes: rows of each embedding table, one table per categorical feature (each at least 1).
        zipf_exponent: exponent ``s`` > 0 of the power law over each table's rows (the ``k``-th most
            frequent row is drawn with probability proportional to ``k ** -s``); larger is more skewed.
        teacher_dim: length of the teacher's per-row vectors, whose pairwise dot products make clicks depend
            on combinations of features.
        positive_rate: average click probability, in (0, 1) (Criteo's is about 0.26).
        logit_std: standard deviation of the teacher's logit, at least 0; larger makes labels more predictable
            (0: clicks are independent of the features).
        seed: seed of the teacher and of the samples.
    """

    num_dense: int = 13
    table_sizes: tuple[int, ...] = CRITEO_LIKE_TABLE_SIZES
    zipf_exponent: float = 1.1
    teacher_dim: int = 8
    positive_rate: float = 0.25
    logit_std: float = 2.0
    seed: int = 0

    def __post_init__(self) -> None:
        require_int("num_dense", self.num_dense, 1)
        sizes = self.table_sizes
        if isinstance(sizes, str | bytes) or not isinstance(sizes, Sequence) or len(sizes) == 0:
            raise ValueError(
                f"`table_sizes` must be a non-empty sequence of ints >= 1 (rows of each table), got {sizes!r}"
            )
        for index, size in enumerate(sizes):
            require_int(f"table_sizes[{index}]", size, 1)
        object.__setattr__(self, "table_sizes", tuple(sizes))
        require_number("zipf_exponent", self.zipf_exponent, 0.0, low_open=True)
        require_int("teacher_dim", self.teacher_dim, 1)
        require_number("positive_rate", self.positive_rate, 0.0, 1.0, low_open=True)
        require_number("logit_std", self.logit_std, 0.0)
        require_int("seed", self.seed, 0)

    @property
    def num_tables(self) -> int:
        """Categorical features per sample: one id per table."""
        return len(self.table_sizes)


class _ClickGenerator:
    """The samplers and the hidden teacher of one :class:`CTRSpec` (see the module docstring)."""

    def __init__(self, spec: CTRSpec) -> None:
        self.spec = spec
        rng = torch.Generator().manual_seed(_stream_seed(spec.seed, "teacher"))
        f64 = torch.float64
        num_dense, dim = spec.num_dense, spec.teacher_dim
        self.dense_mu = 3.0 * torch.rand(num_dense, generator=rng, dtype=f64)
        self.dense_sigma = 0.5 + torch.rand(num_dense, generator=rng, dtype=f64)
        sizes = torch.tensor(spec.table_sizes)
        self.table_offsets = torch.cat([torch.zeros(1, dtype=torch.int64), sizes.cumsum(0)[:-1]])
        # Zipf cumulative distribution over popularity ranks, and which row holds each rank
        self.rank_cdfs = []
        for size in spec.table_sizes:
            weights = torch.arange(1, size + 1, dtype=f64).pow(-spec.zipf_exponent)
            self.rank_cdfs.append(weights.cumsum(0) / weights.sum())
        self.rank_to_row = [torch.randperm(size, generator=rng) for size in spec.table_sizes]
        total_rows = int(sizes.sum())
        self.dense_weights = torch.randn(num_dense, generator=rng, dtype=f64) / math.sqrt(num_dense)
        self.dense_projection = torch.randn(num_dense, dim, generator=rng, dtype=f64) / math.sqrt(num_dense)
        # every table's rows in one tensor: row r of table t is entry table_offsets[t] + r
        self.row_bias = torch.randn(total_rows, generator=rng, dtype=f64)
        self.row_vectors = torch.randn(total_rows, dim, generator=rng, dtype=f64) / math.sqrt(dim)

        calibration = torch.Generator().manual_seed(_stream_seed(spec.seed, "calibration"))
        dense, sparse = self._draw_features(_CALIBRATION_SAMPLES, calibration)
        self.dense_mean, self.dense_std = dense.mean(0), dense.std(0).clamp_min(1e-6)
        components = self._components(dense, sparse)
        self.component_std = components.std(0).clamp_min(1e-6)
        raw = (components / self.component_std).sum(1)
        self.logit_scale = spec.logit_std / float(raw.std().clamp_min(1e-6))
        self.logit_shift = _shift_for_mean_probability(self.logit_scale * raw, spec.positive_rate)

    def _draw_features(self, count: int, rng: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """``count`` dense feature vectors (float64, log1p of counts) and categorical id vectors (int64)."""
        z = torch.randn(count, self.spec.num_dense, generator=rng, dtype=torch.float64)
        dense = torch.log1p(torch.floor(torch.exp(self.dense_mu + self.dense_sigma * z)))
        uniform = torch.rand(self.spec.num_tables, count, generator=rng, dtype=torch.float64)
        columns = []
        for table, (cdf, rows) in enumerate(zip(self.rank_cdfs, self.rank_to_row, strict=True)):
            # the cdf's last entry can round below 1: clamp to the last rank
            rank = torch.searchsorted(cdf, uniform[table], right=True).clamp_max(cdf.numel() - 1)
            columns.append(rows[rank])
        return dense, torch.stack(columns, dim=1)

    def _components(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        """``(count, 3)``: the teacher's dense-linear, row-bias and pairwise-interaction terms, unscaled."""
        standard = (dense - self.dense_mean) / self.dense_std
        linear = standard @ self.dense_weights
        rows = sparse + self.table_offsets
        bias = self.row_bias[rows].sum(1)
        vectors = torch.cat([(standard @ self.dense_projection).unsqueeze(1), self.row_vectors[rows]], dim=1)
        # sum over pairs i < j of <v_i, v_j> = (|sum v|² - sum |v|²) / 2
        interaction = (vectors.sum(1).square().sum(1) - vectors.square().sum((1, 2))) / 2
        return torch.stack([linear, bias, interaction], dim=1)

    def logits(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        """The teacher's click logits (float64) for dense features and categorical ids as drawn."""
        raw = (self._components(dense, sparse) / self.component_std).sum(1)
        return self.logit_scale * raw + self.logit_shift

    def block(self, index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Samples ``index * BLOCK_SIZE`` up to the next block: dense, ids, click probabilities, labels."""
        rng = torch.Generator().manual_seed(_stream_seed(self.spec.seed, "samples", index))
        dense, sparse = self._draw_features(BLOCK_SIZE, rng)
        probabilities = torch.sigmoid(self.logits(dense, sparse))
        labels = torch.rand(BLOCK_SIZE, generator=rng, dtype=torch.float64) < probabilities
        return dense.float(), sparse, probabilities.float(), labels.float()


def _shift_for_mean_probability(logits: torch.Tensor, target: float) -> float:
    """The shift ``b`` with ``mean(sigmoid(logits + b)) == target``, by bisection (the mean grows with ``b``)."""
    low, high = -50.0, 50.0
    for _ in range(100):
        middle = (low + high) / 2
        if float(torch.sigmoid(logits + middle).mean()) < target:
            low = middle
        else:
            high = middle
    return (low + high) / 2


@functools.lru_cache(maxsize=2)
def _click_generator(spec: CTRSpec) -> _ClickGenerator:
    # the training and validation datasets of one spec share the teacher's tables
    return _ClickGenerator(spec)


class SyntheticCTRDataset(Dataset[CTRSample]):
    """Samples ``start`` to ``start + num_samples - 1`` of the synthetic CTR data of ``spec``.

    An item is ``(dense, sparse, label)``: ``dense`` float32 ``(num_dense,)``, ``sparse`` int64
    ``(num_tables,)`` with ``sparse[t]`` in ``[0, table_sizes[t])``, ``label`` a float32 scalar,
    1.0 for a click. The samples are generated at construction (about
    ``4 * num_dense + 8 * num_tables + 8`` bytes each) and depend only on ``spec`` and their index.

    Attributes:
        spec: the spec the samples were drawn from.
        dense: ``(num_samples, num_dense)`` float32 dense features.
        sparse: ``(num_samples, num_tables)`` int64 categorical ids.
        labels: ``(num_samples,)`` float32 click labels (0.0 or 1.0).
        click_probabilities: ``(num_samples,)`` float32: the teacher's click probability of each sample,
            which the label was drawn from; as scores, the best any model can do.

    Args:
        num_samples: number of samples, at least 1.
        spec: shape and seed of the data; default: ``CTRSpec()`` (Criteo-like).
        start: index of the first sample, at least 0.
    """

    def __init__(self, num_samples: int, spec: CTRSpec | None = None, start: int = 0) -> None:
        require_int("num_samples", num_samples, 1)
        spec = CTRSpec() if spec is None else spec
        if not isinstance(spec, CTRSpec):
            raise ValueError(f"`spec` must be a CTRSpec or None, got {spec!r}")
        require_int("start", start, 0)
        generator = _click_generator(spec)
        first, last = start // BLOCK_SIZE, (start + num_samples - 1) // BLOCK_SIZE
        blocks = [generator.block(index) for index in range(first, last + 1)]
        begin = start - first * BLOCK_SIZE
        dense, sparse, probabilities, labels = (
            torch.cat(parts)[begin : begin + num_samples] for parts in zip(*blocks, strict=True)
        )
        self.spec = spec
        # clone: a slice of the concatenation would keep the whole of it alive
        self.dense, self.sparse = dense.clone(), sparse.clone()
        self.click_probabilities, self.labels = probabilities.clone(), labels.clone()

    def __len__(self) -> int:
        return self.labels.shape[0]

    def __getitem__(self, index: int) -> CTRSample:
        return self.dense[index], self.sparse[index], self.labels[index]

    def __getitems__(self, indices: list[int]) -> CTRSamples:
        """The samples at ``indices``, read at once (a DataLoader's batch; see :class:`CTRSamples`)."""
        rows = torch.as_tensor(indices, dtype=torch.long)
        return CTRSamples(self.dense[rows], self.sparse[rows], self.labels[rows])


class CTRSamples(Sequence[CTRSample]):
    """Samples of a :class:`SyntheticCTRDataset` read at once: a sequence of ``(dense, sparse, label)``
    samples, as a DataLoader's collate function expects, that :func:`collate_ctr` takes as one batch
    without splitting and stacking them again.

    Attributes:
        dense, sparse, labels: the samples' tensors, one row per sample.
    """

    def __init__(self, dense: torch.Tensor, sparse: torch.Tensor, labels: torch.Tensor) -> None:
        self.dense, self.sparse, self.labels = dense, sparse, labels

    def __len__(self) -> int:
        return self.labels.shape[0]

    def __getitem__(self, index: int) -> CTRSample:  # type: ignore[override]  # no slices
        if not -len(self) <= index < len(self):
            raise IndexError(f"sample {index} of {len(self)}")
        return self.dense[index], self.sparse[index], self.labels[index]


def collate_ctr(samples: Sequence[Any]) -> Any:
    """The batch of :class:`CTRSamples` as they are; any other samples through torch's ``default_collate``."""
    if isinstance(samples, CTRSamples):
        return samples.dense, samples.sparse, samples.labels
    return default_collate(samples)


class CTRDataModule(LightningDataModule):
    """Training and validation splits of the synthetic CTR data of one :class:`CTRSpec`.

    The training split is samples ``0`` to ``num_samples - 1``, the validation split the
    ``num_val_samples`` after them: disjoint, from the same teacher. Every process generates the same
    samples, so nothing needs to be shared between ranks. The training DataLoader shuffles with a plain
    sampler (seeded by ``seed``); the validation DataLoader does not shuffle.

    Args:
        num_samples: training samples.
        num_val_samples: validation samples.
        num_dense: numerical features per sample.
        table_sizes: rows of each embedding table, one per categorical feature.
        zipf_exponent: exponent of the power law over each table's rows (larger is more skewed).
        teacher_dim: length of the hidden teacher's per-row vectors.
        positive_rate: average click probability, in (0, 1).
        logit_std: standard deviation of the teacher's logit (larger: more predictable clicks).
        batch_size: samples per training batch (per rank).
        val_batch_size: samples per validation batch.
        num_workers: DataLoader worker processes.
        seed: seed of the teacher, the samples and the training shuffle.

    Attributes:
        spec: the :class:`CTRSpec` built from the arguments.
    """

    def __init__(
        self,
        num_samples: int = 65536,
        num_val_samples: int = 16384,
        num_dense: int = 13,
        table_sizes: Sequence[int] = CRITEO_LIKE_TABLE_SIZES,
        zipf_exponent: float = 1.1,
        teacher_dim: int = 8,
        positive_rate: float = 0.25,
        logit_std: float = 2.0,
        batch_size: int = 256,
        val_batch_size: int = 4096,
        num_workers: int = 0,
        seed: int = 0,
    ) -> None:
        super().__init__()
        check_splits(num_samples, num_val_samples, batch_size, val_batch_size, num_workers)
        self.spec = CTRSpec(
            num_dense=num_dense,
            table_sizes=table_sizes,  # type: ignore[arg-type]  # made a tuple by CTRSpec
            zipf_exponent=zipf_exponent,
            teacher_dim=teacher_dim,
            positive_rate=positive_rate,
            logit_std=logit_std,
            seed=seed,
        )
        self.save_hyperparameters()
        self.train_dataset: SyntheticCTRDataset | None = None
        self.val_dataset: SyntheticCTRDataset | None = None

    @override
    def setup(self, stage: str) -> None:
        h = self.hparams
        if self.train_dataset is None:
            self.train_dataset = SyntheticCTRDataset(h.num_samples, self.spec)
        if self.val_dataset is None:
            self.val_dataset = SyntheticCTRDataset(h.num_val_samples, self.spec, start=h.num_samples)

    @override
    def train_dataloader(self) -> DataLoader[CTRSample]:
        h = self.hparams
        if self.train_dataset is None:
            self.setup("fit")
        assert self.train_dataset is not None  # setup() always sets it
        return split_loader(self.train_dataset, h.batch_size, h.num_workers, h.seed, collate_ctr)

    @override
    def val_dataloader(self) -> DataLoader[CTRSample]:
        h = self.hparams
        if self.val_dataset is None:
            self.setup("validate")
        assert self.val_dataset is not None  # setup() always sets it
        return split_loader(self.val_dataset, h.val_batch_size, h.num_workers, None, collate_ctr)
