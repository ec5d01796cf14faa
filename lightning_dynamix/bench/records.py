"""What every benchmark writes beside its figures: the machine it ran on and the arguments it ran with."""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
from pathlib import Path
from typing import Any


def machine_description() -> dict[str, Any]:
    """This machine as a benchmark's JSON records it: CPUs, processor, and the versions that matter."""
    import lightning
    import torch

    from lightning_dynamix import __version__

    return {
        "cpus": os.cpu_count(),
        "processor": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "lightning": lightning.__version__,
        "lightning_dynamix": __version__,
    }


def arguments_record(args: argparse.Namespace) -> dict[str, Any]:
    """A benchmark's command-line arguments as JSON values (paths as strings, the handler left out)."""

    def value(v: Any) -> Any:
        if isinstance(v, Path):
            return str(v)
        if dataclasses.is_dataclass(v) and not isinstance(v, type):
            return dataclasses.asdict(v)
        if isinstance(v, list | tuple):
            return [value(item) for item in v]
        return v

    return {k: value(v) for k, v in vars(args).items() if k != "func"}
