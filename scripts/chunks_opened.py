"""How many chunk files each rank opens in an epoch of a LitData dataset: the package's chunk layout, slices of one
shuffled order (the sampler without chunks), and LitData's own order (each rank an equal share).

    .venv/bin/python scripts/chunks_opened.py [--samples 20000] [--chunk 200]

Writes the dataset with ``litdata.optimize`` into a temporary directory, then counts, without training: a rank
opens a chunk whenever the next sample it reads is in another chunk than the last (so a rank that comes back to
a chunk opens it again, as a cache that keeps one chunk would). Counts, not times: the same on any machine.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import litdata
import numpy as np
from litdata.utilities.env import _DistributedEnv

from lightning_dynamix.data import HeterogeneousBatchSampler, StreamingView

SPLITS = {2: [[32, 32], [48, 16]], 4: [[16, 16, 16, 16], [24, 16, 12, 12]]}


def sample(index: int) -> dict:
    return {"index": index, "x": np.zeros(4, dtype=np.float32)}


def opened(chunks: list[int]) -> int:
    return sum(1 for k, c in enumerate(chunks) if k == 0 or c != chunks[k - 1])


def epoch(sampler: HeterogeneousBatchSampler) -> list[int]:
    return [i for batch in sampler for i in batch]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=20_000)
    parser.add_argument("--chunk", type=int, default=200, help="samples per chunk file")
    return parser


def main() -> None:
    args = build_parser().parse_args()
    with tempfile.TemporaryDirectory() as folder:
        out = str(Path(folder) / "data")
        litdata.optimize(fn=sample, inputs=list(range(args.samples)), output_dir=out, chunk_size=args.chunk,
                         num_workers=1)  # fmt: skip
        view = StreamingView(litdata.StreamingDataset(out))
        starts = np.cumsum((0, *view.chunk_sizes))
        chunk_of = lambda index: int(np.searchsorted(starts, index, side="right") - 1)  # noqa: E731
        print(f"{args.samples} samples in {len(view.chunk_sizes)} chunks; chunks opened per rank in one epoch")
        print(f"{'ranks':>5}  {'sizes':>16}  {'chunk layout':>22}  {'one shuffled order':>24}  {'LitData own':>22}")
        for world, splits in SPLITS.items():
            own = []
            for rank in range(world):  # LitData's own order: each rank an equal share of the chunks
                dataset = litdata.StreamingDataset(out, shuffle=True, seed=0)
                dataset.distributed_env = _DistributedEnv(world, rank, 1)
                own.append(opened([chunk_of(int(item["index"])) for item in dataset]))
            for sizes in splits:
                counts = []
                for source in (view, args.samples):  # over the view: the chunk layout; a number: one shuffled order
                    ranks = [HeterogeneousBatchSampler(source, sizes, rank=r, world_size=world) for r in range(world)]
                    counts.append([opened([chunk_of(i) for i in epoch(s)]) for s in ranks])
                layout, plain = counts
                row = [f"{sum(c)} ({', '.join(map(str, c))})" for c in (layout, plain, own)]
                print(f"{world:>5}  {','.join(map(str, sizes)):>16}  {row[0]:>22}  {row[1]:>24}  {row[2]:>22}")


if __name__ == "__main__":
    main()
