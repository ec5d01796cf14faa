"""Writes the jobs' IndexedDataset as a LitData dataset: ``python write_litdata.py OUT SAMPLES CHUNK``.

Each sample is ``(index, x, y)``, as ``IndexedDataset`` gives it, so a job reading it trains what one process
trains on ``IndexedDataset(SAMPLES)``. Run in a process of its own (``litdata.optimize`` switches the process's
multiprocessing start method to spawn).
"""

import sys

import litdata
from common import IndexedDataset

if __name__ == "__main__":
    out, samples, chunk = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    dataset = IndexedDataset(samples)
    litdata.optimize(
        fn=dataset.__getitem__, inputs=list(range(samples)), output_dir=out, chunk_size=chunk, num_workers=1
    )
