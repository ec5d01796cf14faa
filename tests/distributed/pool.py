"""A pool of rank processes that outlives one test: many short distributed runs share one process group.

Starting a job's ranks (Python, torch and Lightning imported, a process group formed) costs seconds;
a property test runs hundreds of short fits. :class:`RankPool` starts ``world_size`` processes of
``jobs/pool_worker.py`` once; :meth:`RankPool.run` hands every rank the same task (a function of a
job module, with its arguments) and returns each rank's result. A task that fails or outlives its
deadline (a hang: the process group's timeout is short) fails the test with every rank's output,
and the pool starts its ranks afresh for the next task.
"""

from __future__ import annotations

import json
import os
import selectors
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_dynamix.distributed import free_port, job_environment
from tests import forkserver
from tests.distributed.conftest import JOBS, PRELOAD

MARKER = "@@"


class RankPool:
    """``world_size`` rank processes on this machine, in one gloo group of ``timeout`` seconds, fed tasks.

    Args:
        world_size: the number of ranks.
        out: a folder for the tasks' results.
        timeout: the process group's timeout (seconds): how long a collective waits for the others.
        deadline: how long a task may take (seconds) before the pool counts it as hung.
    """

    def __init__(self, world_size: int, out: Path, timeout: float = 60.0, deadline: float = 180.0) -> None:
        self.world_size = world_size
        self.out = out
        self.timeout = timeout
        self.deadline = deadline
        self.tasks = 0
        self._procs: list[subprocess.Popen[bytes]] = []
        self._logs: list[list[str]] = []

    def _start(self) -> None:
        env = job_environment()
        env.update(
            PYTHONPATH=os.pathsep.join([str(JOBS), env.get("PYTHONPATH", "")]),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(free_port()),
            WORLD_SIZE=str(self.world_size),
            LOCAL_WORLD_SIZE=str(self.world_size),
            OMP_NUM_THREADS="1",  # many ranks on few cores: one thread each, as Lightning's launcher would give
        )
        self._procs = [
            forkserver.popen(
                [sys.executable, str(JOBS / "pool_worker.py"), str(self.timeout)],
                PRELOAD,
                env=dict(env, RANK=str(r), LOCAL_RANK=str(r)),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                bufsize=0,
            )
            for r in range(self.world_size)
        ]
        self._logs = [[] for _ in self._procs]

    def run(self, job: str, function: str, **kwargs: Any) -> list[Any]:
        """Every rank's return value of ``jobs/<job>.py``'s ``function(**kwargs)``, called on every rank at once."""
        return self._run({"job": job, "function": function, "kwargs": kwargs}, f"{job}.{function}({kwargs})")

    def run_script(self, script: str, *args: object, cwd: Path) -> None:
        """Run the job script ``jobs/<script>`` with ``args`` on every rank at once, in ``cwd``, as its ranks (the
        script writes its own results); fails the test as :meth:`run` does."""
        self._collect(*self.submit_script(script, *args, cwd=cwd))

    def submit_script(self, script: str, *args: object, cwd: Path) -> tuple[int, str]:
        """Start :meth:`run_script`'s task without waiting for it (see :func:`run_scripts`); its id and name."""
        task = {"script": script, "argv": [str(a) for a in args], "cwd": str(cwd)}
        return self._submit(task), f"{script} {' '.join(task['argv'])}"

    def _run(self, task: dict[str, Any], what: str) -> list[Any]:
        return self._collect(self._submit(task), what)

    def _submit(self, task: dict[str, Any]) -> int:
        if not self._procs or any(p.poll() is not None for p in self._procs):
            self.close()
            self._start()
        self.tasks += 1
        # a port for the process group, should the last task have ended it (see jobs/pool_worker.py)
        task = {**task, "id": self.tasks, "out": str(self.out), "master_port": str(free_port())}
        for proc, log in zip(self._procs, self._logs):
            log.clear()
            assert proc.stdin is not None
            proc.stdin.write((json.dumps(task) + "\n").encode())
        return self.tasks

    def _collect(self, task_id: int, what: str) -> list[Any]:
        answers = self._answers(task_id)
        if any(answer != "done" for answer in answers):
            logs = "\n".join(f"--- rank {r}: {answers[r]}\n" + "".join(log[-60:]) for r, log in enumerate(self._logs))
            self.close()
            pytest.fail(f"{what} did not finish on every rank:\n{logs}")
        return [torch.load(self.out / f"{task_id}-rank{r}.pt", weights_only=False) for r in range(self.world_size)]

    def _answers(self, task_id: int) -> list[str]:
        answers: list[str | None] = [None] * self.world_size
        partial = [b""] * self.world_size
        ends = time.monotonic() + self.deadline
        with selectors.DefaultSelector() as selector:
            for r, proc in enumerate(self._procs):
                assert proc.stdout is not None
                selector.register(proc.stdout, selectors.EVENT_READ, r)
            while None in answers:
                left = ends - time.monotonic()
                if left <= 0:
                    return [a or f"no answer within {self.deadline:g} s (a hang?)" for a in answers]
                for key, _ in selector.select(timeout=left):
                    r = key.data
                    chunk = os.read(key.fd, 65536)  # raw reads: no line waits in a buffer the selector cannot see
                    if not chunk:  # the rank exited
                        selector.unregister(key.fileobj)
                        answers[r] = answers[r] or f"exited with {self._procs[r].wait()}"
                        continue
                    *lines, partial[r] = (partial[r] + chunk).split(b"\n")
                    for raw in lines:
                        line = raw.decode(errors="replace")
                        if line.startswith(MARKER) and line.split()[-1] == str(task_id):
                            answers[r] = line[len(MARKER) :].split()[0]
                        else:
                            self._logs[r].append(line + "\n")
                    if answers[r] is not None:
                        selector.unregister(key.fileobj)
        return [a or "" for a in answers]

    def close(self) -> None:
        """Stop every rank (a clean end where they wait for a task, a kill where they do not)."""
        for proc in self._procs:
            if proc.poll() is None and proc.stdin is not None:
                try:
                    proc.stdin.write(b"\n")
                    proc.stdin.close()
                except OSError:
                    pass
        for proc in self._procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()
        self._procs = []


def run_scripts(*jobs: tuple[RankPool, str, tuple[object, ...], Path]) -> None:
    """Run ``(pool, script, args, cwd)`` jobs at once, each on its own pool (jobs whose results do not depend on
    how fast they run: they share the cores); fails the test as :meth:`RankPool.run_script` does."""
    started = [(pool, pool.submit_script(script, *args, cwd=cwd)) for pool, script, args, cwd in jobs]
    for pool, (task_id, what) in started:
        pool._collect(task_id, what)


def rank_pool(world_size: int, timeout: float = 60.0, deadline: float = 180.0) -> RankPool:
    """A :class:`RankPool` whose results go to a new temporary folder (removed by the system's temp cleanup)."""
    return RankPool(world_size, Path(tempfile.mkdtemp(prefix=f"pool-{world_size}-")), timeout, deadline)
