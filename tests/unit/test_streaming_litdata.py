"""A LitData dataset, written with the library's own writer and read from a local directory, through the view."""

from __future__ import annotations

import json

import litdata
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_dynamix.data import HeterogeneousBatchSampler, StreamingView
from tests.conftest import LITDATA_CHUNK, LITDATA_SAMPLES
from tests.distributed.conftest import import_job

pytestmark = pytest.mark.distributed  # the dataset is written by a Python of its own, read by DataLoader workers


def test_the_view_reads_the_chunks_litdata_wrote(litdata_dir):
    dataset = litdata.StreamingDataset(str(litdata_dir))
    view = StreamingView(dataset)
    chunks = [c["chunk_size"] for c in json.loads((litdata_dir / "index.json").read_text())["chunks"]]
    assert view.chunk_sizes == tuple(chunks)
    assert sum(chunks) == len(view) == LITDATA_SAMPLES
    assert int(view[123][0]) == 123
    with pytest.raises(ValueError, match=r"StreamingDataset\) that can be indexed.*StreamingView"):
        HeterogeneousBatchSampler(dataset, [8, 8], rank=0, world_size=2)


@pytest.mark.parametrize("world_size", [2, 3])
def test_every_sample_once_per_epoch_from_dataloader_workers_at_uneven_changing_sizes(litdata_dir, world_size):
    stored = import_job("common").IndexedDataset(LITDATA_SAMPLES)
    sizes = {2: [12, 4], 3: [9, 2, 5]}[world_size]
    seen, files = [], []
    for rank in range(world_size):
        view = StreamingView(litdata.StreamingDataset(str(litdata_dir)))
        sampler = HeterogeneousBatchSampler(view, sizes, rank=rank, world_size=world_size, seed=3)
        sampler.set_batch_sizes(list(reversed(sizes)), from_step=4)
        batches = list(DataLoader(view, batch_sampler=sampler, num_workers=2))
        assert [len(b[0]) for b in batches] == [sampler.batch_sizes_at(s)[rank] for s in range(len(sampler))]
        mine = torch.cat([b[0] for b in batches]).tolist()
        assert all(torch.equal(b[1], stored.x[b[0]]) for b in batches)  # what was stored there
        seen += mine
        files.append(len({i // LITDATA_CHUNK for i in mine}))
    assert sorted(seen) == list(range(LITDATA_SAMPLES))
    # each rank read whole chunk files of its own: together hardly more than there are
    assert sum(files) <= LITDATA_SAMPLES // LITDATA_CHUNK + 1 + 2 * world_size
