"""A LitData dataset, written with the library's own writer and read from a local directory, through the view."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import litdata
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_dynamix.data import HeterogeneousBatchSampler, StreamingView

pytestmark = pytest.mark.distributed  # the dataset is written by a Python of its own, read by DataLoader workers

SAMPLES = 300
CHUNK = 16  # samples per chunk file: 18 full chunks and one of 12


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """The dataset, written by litdata.optimize in a process of its own (see write_litdata.py)."""
    out = tmp_path_factory.mktemp("litdata") / "optimized"
    writer = Path(__file__).with_name("write_litdata.py")
    done = subprocess.run(
        [sys.executable, str(writer), str(out), str(SAMPLES), str(CHUNK)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return out


def test_the_view_reads_the_chunks_litdata_wrote(written):
    dataset = litdata.StreamingDataset(str(written))
    view = StreamingView(dataset)
    chunks = [c["chunk_size"] for c in json.loads((written / "index.json").read_text())["chunks"]]
    assert view.chunk_sizes == tuple(chunks)
    assert sum(chunks) == len(view) == SAMPLES
    assert view[123]["index"] == 123
    with pytest.raises(ValueError, match=r"StreamingDataset\) that can be indexed.*StreamingView"):
        HeterogeneousBatchSampler(dataset, [8, 8], rank=0, world_size=2)


@pytest.mark.parametrize("world_size", [2, 3])
def test_every_sample_once_per_epoch_from_dataloader_workers_at_uneven_changing_sizes(written, world_size):
    sizes = {2: [12, 4], 3: [9, 2, 5]}[world_size]
    seen, files = [], []
    for rank in range(world_size):
        view = StreamingView(litdata.StreamingDataset(str(written)))
        sampler = HeterogeneousBatchSampler(view, sizes, rank=rank, world_size=world_size, seed=3)
        sampler.set_batch_sizes(list(reversed(sizes)), from_step=6)
        loader = DataLoader(view, batch_sampler=sampler, num_workers=2)
        batches = list(loader)
        assert [len(b["index"]) for b in batches] == [sampler.batch_sizes_at(s)[rank] for s in range(len(sampler))]
        mine = torch.cat([b["index"] for b in batches]).tolist()
        assert all(torch.equal(b["x"][:, 0], b["index"].float()) for b in batches)  # what was stored there
        seen += mine
        files.append(len({i // CHUNK for i in mine}))
    assert sorted(seen) == list(range(SAMPLES))
    # each rank read whole chunk files of its own: together hardly more than there are
    assert sum(files) <= SAMPLES // CHUNK + 1 + 2 * world_size
