"""One rank of a run on hosts (:func:`lightning_dynamix.bench.harness.run` with ``links``), started by the launching
process on its host: ``python -m lightning_dynamix.bench.host_rank CONFIG OUT``; rank 0 writes the result to OUT."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from lightning_dynamix.bench.harness import RunConfig, run
from lightning_dynamix.bench.load import LoadChange


def main() -> None:
    fields = json.loads(sys.argv[1])
    for name in ("speeds", "batch_sizes", "links"):
        if fields.get(name) is not None:
            fields[name] = tuple(fields[name])
    fields["schedule"] = tuple(tuple(entry) for entry in fields["schedule"])
    fields["load_changes"] = tuple(LoadChange(**change) for change in fields["load_changes"])
    result = run(RunConfig(**fields))
    if result is not None:
        Path(sys.argv[2]).write_text(json.dumps(result.as_dict()))


if __name__ == "__main__":
    main()
