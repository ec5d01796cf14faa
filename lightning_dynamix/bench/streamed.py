"""``dynamix bench balance --streaming``: the classification workload's training split read as a LitData dataset.

Before the runs, the split (the same samples the in-memory workload trains on) is written with ``litdata.optimize``
into a temporary directory, in a Python of its own (``optimize`` switches its process's multiprocessing start method
to spawn); every run's training DataLoader then reads ``litdata.StreamingDataset`` from there, which the strategy
rebuilds over a :class:`~lightning_dynamix.data.StreamingView` (each rank reading whole chunks of its own). The
directory is removed after the runs.

Run as ``python -m lightning_dynamix.bench.streamed OUT NUM_SAMPLES SEED CHUNK`` it writes the split.
"""

from __future__ import annotations

import argparse
import functools
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader
from typing_extensions import override

from lightning_dynamix.data.streaming import StreamingView
from lightning_dynamix.data.workloads import ClassificationDataModule

CHUNK_SIZE = 256  # samples per chunk file: 64 chunks of the default 16,384 training samples


def require_litdata(what: str) -> Any:
    """``litdata``, or a ``SystemExit`` naming what needs it and how to install it."""
    try:
        import litdata
    except ImportError:
        raise SystemExit(
            f"{what} needs litdata: pip install '.[streaming]' && pip install --no-deps litdata"
            " (make setup installs both)"
        ) from None
    return litdata


@contextmanager
def streamed_data(args: argparse.Namespace) -> Iterator[None]:
    """With ``args.streaming``: the training split written as a LitData dataset for the runs (``args.streaming_dir``),
    removed after them; else nothing."""
    args.streaming_dir = None
    if not args.streaming:
        yield
        return
    require_litdata("--streaming")
    with tempfile.TemporaryDirectory(prefix="dynamix-streaming-") as folder:
        out = Path(folder) / "train"
        command = [sys.executable, "-m", __name__, str(out), str(args.num_samples), "0", str(CHUNK_SIZE)]
        done = subprocess.run(command, capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            raise SystemExit(f"--streaming: writing the LitData dataset failed:\n{done.stderr[-3000:]}")
        args.streaming_dir = str(out)
        yield


def _row(features: Any, labels: Any, index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample ``index`` as the in-memory dataset gives it: its features and its label."""
    return torch.from_numpy(features[index].copy()), torch.tensor(int(labels[index]))


def write_training_split(out: str | Path, num_samples: int, seed: int, chunk_size: int = CHUNK_SIZE) -> None:
    """The training split of ``ClassificationDataModule(num_samples, seed=seed)`` as a LitData dataset in ``out``."""
    litdata = require_litdata("writing the streamed training split")
    module = ClassificationDataModule(num_samples=num_samples, seed=seed)
    module.setup("fit")
    dataset = module.dataset
    assert dataset is not None
    # the arrays go to litdata's worker once, with the function; each input is an index
    read = functools.partial(_row, dataset.features[:num_samples].numpy(), dataset.labels[:num_samples].numpy())
    inputs = list(range(num_samples))
    litdata.optimize(fn=read, inputs=inputs, output_dir=str(out), chunk_size=chunk_size, num_workers=1)


class StreamedClassificationDataModule(ClassificationDataModule):
    """:class:`ClassificationDataModule` whose training split is read from the LitData dataset in ``directory``
    (written by :func:`write_training_split` with the same ``num_samples`` and ``seed``); validation as before.
    ``in_order``: each chunk's samples in the chunk's own order (a :class:`StreamingView` that says so)."""

    def __init__(self, directory: str, in_order: bool = False, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.directory = directory
        self.in_order = in_order

    @override
    def train_dataloader(self) -> DataLoader:
        litdata = require_litdata("the streamed training split")
        h = self.hparams
        dataset: Any = litdata.StreamingDataset(self.directory)
        if self.in_order:
            dataset = StreamingView(dataset, shuffle_within_chunks=False)
        return DataLoader(dataset, batch_size=h.batch_size, num_workers=h.num_workers)


if __name__ == "__main__":
    write_training_split(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
