"""The command-line types the benchmarks share: each parses one argument or fails with what it expected."""

from __future__ import annotations

import argparse


def floats(text: str) -> tuple[float, ...]:
    """``"1,3"`` (speeds per rank) as ``(1.0, 3.0)``."""
    try:
        return tuple(float(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers such as 1,3, got {text!r}") from None


def positive_ints(text: str) -> list[int]:
    """Comma-separated ints >= 1 (world sizes, ranks, widths)."""
    try:
        sizes = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints such as 4,8,16, got {text!r}") from None
    if not sizes or any(n < 1 for n in sizes):
        raise argparse.ArgumentTypeError(f"expected ints >= 1, got {text!r}")
    return sizes


def splits(text: str) -> tuple[tuple[int, ...], ...]:
    """``"128,128;171,85"``: fixed splits of a global batch, each of whole samples >= 1 per rank."""
    parsed = []
    for part in text.split(";"):
        try:
            split = tuple(int(v) for v in part.split(","))
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"each split must be whole samples per rank, got {part!r} in {text!r}"
            ) from None
        if any(v < 1 for v in split):
            raise argparse.ArgumentTypeError(f"each rank needs >= 1 sample, got {part!r} in {text!r}")
        parsed.append(split)
    return tuple(parsed)


def global_batches(text: str) -> tuple[int, ...]:
    """``"256,512,1024"``: distinct global batches, whole samples >= 1."""
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be comma-separated whole numbers of samples, got {text!r}") from None
    if any(v < 1 for v in values) or len(set(values)) != len(values):
        raise argparse.ArgumentTypeError(f"must be distinct global batches >= 1 sample, got {text!r}")
    return values
