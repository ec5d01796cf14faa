"""Slow ranks down for real on one machine: shared cores, CPU quotas, fewer threads, not sleeps.

:class:`~lightning_dynamix.callbacks.HeterogeneityEmulator` sleeps inside a rank's step, which a
real slow machine does not: a rank that shares its core with another process also loses time
slices at random, arrives late at every collective and pays its fixed per-step costs slowly too.
The modes here make ranks slow the way real machines are, reading ``--speeds`` as each rank's
intended slowdown (1 = a core of its own):

* ``busy``: every rank is pinned to a core of its own, and rank ``r`` shares it with
  ``speeds[r] - 1`` busy processes (a spin loop each, at the same priority): the scheduler gives it
  about ``1 / speeds[r]`` of the core, in time slices. Speeds must be whole numbers; needs one core
  per rank.
* ``quota``: rank ``r`` runs in a cgroup (v1 ``cpu`` controller) whose CFS quota is
  ``1 / speeds[r]`` of a core per period, like a container's CPU limit; ranks are pinned to cores
  whose quotas add up to at most one, so ranks can share a core (three ranks at 1, 2, 4 fit on two
  cores). Needs write access to ``/sys/fs/cgroup/cpu`` (root).
* ``threads``: rank ``r`` runs ``max(speeds) / speeds[r]`` intra-op threads on as many cores of its
  own: the fast rank is a bigger machine. The slowdown is whatever the model's threading yields
  (less than linear); needs ``sum`` of the threads in cores.
* ``emulate``: the emulator's sleeps (no pinning, one thread per rank).

:func:`plan` checks what the machine can provide and says what it cannot; :class:`Contention`
starts the busy processes and cgroups in the launching process and tears them down, and
:func:`apply` puts the calling rank in its place.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

import torch

MODES = ("emulate", "busy", "quota", "threads")
CGROUP_CPU_ROOT = Path("/sys/fs/cgroup/cpu")  # where the cgroup v1 cpu controller is mounted
_CGROUP_ENV = "DYNAMIX_BENCH_CGROUP"  # the launcher's cgroup directory, read by every rank
# the cores the launcher could use before it pinned itself: every rank plans from the same ones
_CPUS_ENV = "DYNAMIX_BENCH_CPUS"
_PERIOD_US = 100_000
# a spin loop that ends by itself once its parent is gone (even if the launcher is killed)
_BUSY_LOOP = (
    "import os, sys\nparent = int(sys.argv[1])\nn = 0\nwhile True:\n    n += 1\n"
    "    if n % 2_000_000 == 0 and os.getppid() != parent:\n        break\n"
)


@dataclass(frozen=True)
class RankPlace:
    """Where one rank runs: its cores, its threads, its CPU quota and the busy processes beside it."""

    cores: tuple[int, ...]
    threads: int = 1
    quota: float | None = None  # fraction of one core per period; None: no quota
    busy: int = 0  # busy processes pinned to the rank's cores


def _whole(value: float) -> int | None:
    return int(value) if float(value).is_integer() and value >= 1 else None


def plan(mode: str, speeds: Sequence[float], cpus: Sequence[int] | None = None) -> list[RankPlace] | None:
    """Each rank's place for ``mode``, or ``None`` for ``emulate`` (the emulator's sleeps, no pinning).

    ``cpus`` are the cores to use (default: the launcher's, which its ranks inherit, else this process's
    affinity). Raises ``ValueError``
    naming the mode, the speeds and what the machine has when the mode cannot be provided.
    """
    if mode not in MODES:
        raise ValueError(f"--contention must be one of {', '.join(MODES)}, got {mode!r}")
    if mode == "emulate":
        return None
    if cpus is None:
        inherited = os.environ.get(_CPUS_ENV)
        cpus = [int(c) for c in inherited.split(",")] if inherited else sorted(os.sched_getaffinity(0))
    cores = sorted(cpus)
    speeds = [float(s) for s in speeds]
    if any(not s >= 1 for s in speeds):
        raise ValueError(f"--speeds must be >= 1 (a slowdown) with --contention {mode}, got {speeds}")
    world = len(speeds)
    if mode == "busy":
        counts = [_whole(s) for s in speeds]
        if any(c is None for c in counts):
            raise ValueError(
                f"--contention busy needs whole-number speeds (rank r shares its core with speeds[r] - 1 busy"
                f" processes), got {speeds}; use --contention quota for fractions"
            )
        if world > len(cores):
            raise ValueError(
                f"--contention busy needs a core per rank ({world} ranks), but this process may use"
                f" {len(cores)} core(s) {cores}; use --contention quota (ranks can share a core) or fewer ranks"
            )
        return [RankPlace(cores=(cores[r],), busy=c - 1) for r, c in enumerate(counts) if c is not None]
    if mode == "threads":
        top = max(speeds)
        threads = [_whole(top / s) for s in speeds]
        if any(t is None for t in threads):
            raise ValueError(
                f"--contention threads gives rank r max(speeds) / speeds[r] threads, a whole number; speeds"
                f" {speeds} give {[top / s for s in speeds]}"
            )
        needed = sum(t for t in threads if t is not None)
        if needed > len(cores):
            raise ValueError(
                f"--contention threads with speeds {speeds} needs {needed} cores (threads {threads}, each on a core"
                f" of its own), but this process may use {len(cores)} core(s) {cores}"
            )
        places, start = [], 0
        for t in threads:
            assert t is not None
            places.append(RankPlace(cores=tuple(cores[start : start + t]), threads=t))
            start += t
        return places
    # quota: first fit, largest share first, so that shares on one core add up to at most 1
    load = [0.0] * len(cores)
    chosen: dict[int, int] = {}
    for r in sorted(range(world), key=lambda r: speeds[r]):
        share = 1.0 / speeds[r]
        slot = next((i for i in range(len(cores)) if load[i] + share <= 1.0 + 1e-9), None)
        if slot is None:
            raise ValueError(
                f"--contention quota with speeds {speeds} needs {sum(1 / s for s in speeds):.2f} cores of CPU time"
                f" in shares of at most one core each, more than the {len(cores)} core(s) {cores} this process may"
                " use hold; choose larger speeds or fewer ranks"
            )
        load[slot] += share
        chosen[r] = slot
    return [
        RankPlace(cores=(cores[chosen[r]],), quota=None if speeds[r] == 1 else 1.0 / speeds[r]) for r in range(world)
    ]


def check_cgroup_rights(root: Path = CGROUP_CPU_ROOT) -> None:
    """Raise ``ValueError`` saying why CPU quotas cannot be set here (no cgroup v1 cpu controller, no rights)."""
    if not (root / "cpu.cfs_quota_us").exists():
        raise ValueError(
            f"--contention quota needs the cgroup v1 cpu controller at {root} (cpu.cfs_quota_us), which this machine"
            " does not have (cgroup v2 alone is not supported by the bench); use --contention busy or threads"
        )
    if not os.access(root, os.W_OK):
        raise ValueError(
            f"--contention quota needs write access to {root} to create a cgroup per rank (run as root);"
            " use --contention busy or threads"
        )


def _own_cgroup(controller: str) -> str:
    """This process's cgroup path in the v1 hierarchy of ``controller`` (``/`` for the root)."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if controller in controllers.split(","):
            return path
    return "/"


def _pin(cores: Sequence[int]) -> None:
    """Pin every thread of this process to ``cores`` (threads created later inherit it)."""
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(ProcessLookupError, PermissionError):  # a thread that just ended
            os.sched_setaffinity(int(tid), cores)


def apply(places: list[RankPlace] | None, rank: int) -> None:
    """Put the calling process, rank ``rank``, in its place: its cores, threads and cgroup."""
    # the emulator's factors are relative to one thread's speed
    threads = 1 if places is None else places[rank].threads
    torch.set_num_threads(threads)
    # Lightning's launcher gives a process cores // ranks threads unless OMP_NUM_THREADS is set (a lone
    # rank would get every core)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    if places is None:
        return
    place = places[rank]
    if _CGROUP_ENV in os.environ:  # --contention quota: every rank in a group of its own
        group = Path(os.environ[_CGROUP_ENV]) / f"rank{rank}"
        (group / "cgroup.procs").write_text(str(os.getpid()))
    _pin(place.cores)


def start_busy(cores: Sequence[int] | None = None) -> subprocess.Popen[bytes]:
    """A busy process (a spin loop at this process's priority) on ``cores`` (default: this process's), which
    ends by itself once this process is gone."""
    process = subprocess.Popen([sys.executable, "-c", _BUSY_LOOP, str(os.getpid())])
    if cores is not None:
        os.sched_setaffinity(process.pid, cores)
    return process


def _group_file(rank: int, name: str) -> Path:
    """A file of rank ``rank``'s cgroup, the one its launcher's :class:`Contention` made (``--contention quota``)."""
    return Path(os.environ[_CGROUP_ENV]) / f"rank{rank}" / name


def set_quota(rank: int, cores: float | None) -> None:
    """Rank ``rank``'s CPU quota from now on: ``cores`` of a core per period (``None``: no quota)."""
    _group_file(rank, "cpu.cfs_quota_us").write_text(str(-1 if cores is None else round(cores * _PERIOD_US)))


class Contention:
    """In the launching process: the busy processes and cgroups of ``places``, for a ``with`` block.

    The cgroups are created under ``cgroup_root/dynamix-bench-<pid>`` (every rank finds them through
    an environment variable its launcher sets) and removed on exit, with the busy processes killed.
    Raises ``ValueError`` at construction when quotas are asked for and cannot be set here.
    """

    def __init__(self, places: list[RankPlace] | None, cgroup_root: Path = CGROUP_CPU_ROOT) -> None:
        if places is not None and any(p.quota is not None for p in places):
            check_cgroup_rights(cgroup_root)
        self.places = places
        self.cgroup_root = cgroup_root
        self.group: Path | None = None
        self.busy: list[subprocess.Popen[bytes]] = []
        self._affinity = sorted(os.sched_getaffinity(0))
        self._cgroup_home: Path | None = None

    def __enter__(self) -> Contention:
        if self.places is None:
            return self
        os.environ[_CPUS_ENV] = ",".join(map(str, self._affinity))
        try:
            if any(p.quota is not None for p in self.places):
                self._cgroup_home = self.cgroup_root / _own_cgroup("cpu").lstrip("/")
                self.group = self.cgroup_root / f"dynamix-bench-{os.getpid()}"
                self.group.mkdir()
                os.environ[_CGROUP_ENV] = str(self.group)
                # a group for every rank, one at full speed too (no quota): a schedule may give it one later
                for rank, place in enumerate(self.places):
                    rank_group = self.group / f"rank{rank}"
                    rank_group.mkdir()
                    (rank_group / "cpu.cfs_period_us").write_text(str(_PERIOD_US))
                    quota = -1 if place.quota is None else round(place.quota * _PERIOD_US)
                    (rank_group / "cpu.cfs_quota_us").write_text(str(quota))
            for place in self.places:
                self.busy += [start_busy(place.cores) for _ in range(place.busy)]
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        for proc in self.busy:
            proc.kill()
            proc.wait()
        self.busy = []
        _pin(self._affinity)
        os.environ.pop(_CPUS_ENV, None)
        if self.group is None:
            return
        # back to the cgroup this process came from, then remove the ranks' groups once their processes ended
        assert self._cgroup_home is not None
        (self._cgroup_home / "cgroup.procs").write_text(str(os.getpid()))
        os.environ.pop(_CGROUP_ENV, None)
        deadline = time.monotonic() + 30.0
        for path in [*sorted(self.group.glob("rank*")), self.group]:
            while True:
                try:
                    path.rmdir()
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        print(f"dynamix bench: could not remove the cgroup {path} (processes still in it)", flush=True)
                        break
                    time.sleep(0.2)
        self.group = None
