"""Writes the small LitData dataset the streaming tests read: ``python tests/unit/write_litdata.py OUT SAMPLES CHUNK``.

Run in a process of its own: ``litdata.optimize`` sets the process's multiprocessing start method to spawn, after
which every DataLoader worker of the process starts a new Python (seconds each).
"""

import sys

import litdata
import numpy as np


def sample(index: int) -> dict:
    """Sample ``index``: its own number, and four features equal to it (what a reader checks it got)."""
    return {"index": index, "x": np.full(4, index, dtype=np.float32)}


if __name__ == "__main__":
    out, samples, chunk = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    litdata.optimize(fn=sample, inputs=list(range(samples)), output_dir=out, chunk_size=chunk, num_workers=1)
