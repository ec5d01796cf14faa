"""What one sample costs to read from a LitData dataset, by the order it is read in.

    .venv/bin/python scripts/litdata_read_cost.py [--samples 16384] [--reads 4000] [--rounds 3]

Writes the benches' training split (``python -m lightning_dynamix.bench.streamed``, 256 samples a chunk) into a
temporary directory, then times ``dataset[i]`` in index order, in the order of the package's chunk layout (chunks
in turn, each chunk's samples shuffled), and in one shuffled order over the whole dataset, and LitData's own
iteration with ``shuffle=False`` and ``shuffle=True``; each the median of ``--rounds`` interleaved rounds, in
microseconds a sample, with the lowest and highest round.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import litdata
import torch

from lightning_dynamix.data import HeterogeneousBatchSampler, StreamingView


def per_sample(read, reads: int) -> float:
    started = time.perf_counter()
    count = read(reads)
    return (time.perf_counter() - started) / count * 1e6


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=16384)
    parser.add_argument("--reads", type=int, default=4000)
    parser.add_argument("--rounds", type=int, default=3)
    return parser


def main() -> None:
    args = build_parser().parse_args()
    with tempfile.TemporaryDirectory() as folder:
        out = str(Path(folder) / "train")
        command = [sys.executable, "-m", "lightning_dynamix.bench.streamed", out, str(args.samples), "0", "256"]
        subprocess.run(command, check=True, capture_output=True)
        view = StreamingView(litdata.StreamingDataset(out))
        layout = [i for batch in HeterogeneousBatchSampler(view, [256, 256], rank=0, world_size=2) for i in batch]
        shuffled = torch.randperm(args.samples, generator=torch.Generator().manual_seed(0)).tolist()

        def indexed(order):
            def read(n):
                dataset = litdata.StreamingDataset(out)
                for i in order[:n]:
                    dataset[i]
                return min(n, len(order))

            return read

        def iterated(shuffle):
            def read(n):
                for k, _ in enumerate(litdata.StreamingDataset(out, shuffle=shuffle, seed=1), 1):
                    if k == n:
                        return k
                return k

            return read

        ways = {
            "dataset[i], index order": indexed(list(range(args.samples))),
            "dataset[i], the chunk layout's order": indexed(layout),
            "dataset[i], one shuffled order": indexed(shuffled),
            "iteration, shuffle=False": iterated(False),
            "iteration, shuffle=True": iterated(True),
        }
        times: dict[str, list[float]] = {name: [] for name in ways}
        for round_ in range(args.rounds):
            names = list(ways)
            for name in names[round_ % len(names) :] + names[: round_ % len(names)]:
                times[name].append(per_sample(ways[name], args.reads))
        for name, values in times.items():
            print(f"{name:>38}: {statistics.median(values):6.0f} us a sample ({min(values):.0f}-{max(values):.0f})")


if __name__ == "__main__":
    main()
