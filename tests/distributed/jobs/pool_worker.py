"""One rank of a pool of processes that stays up between tests: it runs tasks in a process group it keeps.

Usage: python pool_worker.py TIMEOUT_SECONDS, with ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``
and ``MASTER_PORT`` set (:class:`tests.distributed.pool.RankPool` starts every rank). The worker
joins a gloo process group of that timeout, then reads one task per line of standard input, JSON
``{"id": ..., "job": ..., "function": ..., "kwargs": {...}}``: it calls ``function(**kwargs)`` of
``jobs/<job>.py`` (Lightning's ``Trainer.fit`` finds the process group there and keeps it),
writes the returned value with ``torch.save`` to ``<out>/<id>-rank<r>.pt`` and answers on a line of
its own, after everything else the task printed: ``@@done <id>`` or ``@@failed <id>`` with the
traceback before it. An empty line or the end of standard input ends the worker at once.
"""

import importlib
import json
import os
import sys
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

MARKER = "@@"


def main() -> None:
    timeout = timedelta(seconds=float(sys.argv[1]))
    dist.init_process_group("gloo", timeout=timeout)
    rank = dist.get_rank()
    for line in sys.stdin:
        if not line.strip():
            break
        task = json.loads(line)
        try:
            job = importlib.import_module(task["job"])
            result = getattr(job, task["function"])(**task["kwargs"])
            torch.save(result, Path(task["out"]) / f"{task['id']}-rank{rank}.pt")
        except BaseException:
            traceback.print_exc()
            sys.stderr.flush()
            print(f"{MARKER}failed {task['id']}", flush=True)
            # a failed collective leaves the process group unusable: the pool is started again
            os._exit(1)
        print(f"{MARKER}done {task['id']}", flush=True)
    # the pool is done with every rank at once: nothing to finish, and an exit that waited for the process
    # group's threads would only make the test wait
    os._exit(0)


if __name__ == "__main__":
    main()
