"""One rank of a pool of processes that stays up between tests: it runs tasks in a process group it keeps.

Usage: python pool_worker.py TIMEOUT_SECONDS, with ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``
and ``MASTER_PORT`` set (:class:`tests.distributed.pool.RankPool` starts every rank). The worker
joins a gloo process group of that timeout, then reads one task per line of standard input, JSON
``{"id": ..., "job": ..., "function": ..., "kwargs": {...}}``: it calls ``function(**kwargs)`` of
``jobs/<job>.py`` (Lightning's ``Trainer.fit`` finds the process group there and keeps it), or
``{"id": ..., "script": ..., "argv": [...], "cwd": ...}``: it runs a job script (:func:`run_script`);
writes the returned value with ``torch.save`` to ``<out>/<id>-rank<r>.pt`` and answers on a line of
its own, after everything else the task printed: ``@@done <id>`` or ``@@failed <id>`` with the
traceback before it. Every task finds the process as the pool started it (:func:`restored`), whatever the tasks
before it changed. A task that ends the process group (Accelerate's ``end_training`` does) finds it formed
anew at the next task, on the port the task names. An empty line or the end of standard input ends the worker
at once.
"""

import contextlib
import importlib
import json
import os
import runpy
import sys
import traceback
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

MARKER = "@@"
JOBS = Path(__file__).resolve().parent


def run_script(script: str, argv: list[str], cwd: str) -> None:
    """Run ``jobs/<script>`` as ``python script argv...`` would (``__main__``, ``sys.argv``), in ``cwd``.

    A job script started by Lightning's launcher, or one for Accelerate's, finds the pool's process group already
    formed and the launcher's variables set (as under ``torchrun``): every rank runs it at once, each with its own
    rank.
    """
    sys.argv = [str(JOBS / script), *argv]
    os.chdir(cwd)
    try:
        runpy.run_path(str(JOBS / script), run_name="__main__")
    except SystemExit as exit_:
        if exit_.code not in (0, None):
            raise


@contextlib.contextmanager
def restored() -> Iterator[None]:
    """Give the process back as it was after a task, a script or a function: the environment, the directory,
    ``sys.argv``, the default dtype and torch's threads, and Accelerate's process-wide state reset. A task finds the
    process as the pool started it, whatever ran before it on the same ranks (Lightning's teardown deletes
    ``WORLD_SIZE``, which the next process group formed here reads)."""
    dtype, threads, environ, directory, argv = (
        torch.get_default_dtype(),
        torch.get_num_threads(),
        dict(os.environ),
        os.getcwd(),
        sys.argv,
    )
    try:
        yield
    finally:
        sys.argv = argv
        os.chdir(directory)
        os.environ.clear()
        os.environ.update(environ)
        torch.set_default_dtype(dtype)
        torch.set_num_threads(threads)
        if "accelerate" in sys.modules:  # Accelerate's process-wide state: the next script's Accelerator starts anew
            from accelerate.state import AcceleratorState, GradientState

            AcceleratorState._reset_state(reset_partial_state=True)
            GradientState._reset_state()


def main() -> None:
    timeout = timedelta(seconds=float(sys.argv[1]))
    dist.init_process_group("gloo", timeout=timeout)
    rank = dist.get_rank()
    for line in sys.stdin:
        if not line.strip():
            break
        task = json.loads(line)
        try:
            if not dist.is_initialized():  # the last task ended it (Accelerate's end_training does), on every
                # rank: the test sends a task once all have answered. A new store on a new port: the old one may
                # outlive its group where something still holds it, and a rank that met there would never return
                os.environ["MASTER_PORT"] = task["master_port"]
                dist.init_process_group("gloo", timeout=timeout)
            with restored():
                if "script" in task:
                    result = run_script(task["script"], task["argv"], task["cwd"])
                else:
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
