"""Load that changes during a run, for real: co-tenants that arrive and leave, CPU quotas and link rates changed
at given steps.

``--schedule`` entries are ``STEP:RANK:CHANGE``. A number is the emulator's factor (``--contention
emulate``); the others change the machine the rank runs on from that step on:

* ``busy+N`` / ``busy-N``: N busy processes (a spin loop each) start beside the rank on its core, or N
  of those started so stop: a co-tenant that arrives and leaves. Needs ``--contention busy`` (ranks on
  cores of their own).
* ``quota=F``: the rank's CPU quota becomes F cores (``quota=1``: a whole core). Needs ``--contention
  quota``.
* ``link=R``: the rank's host link runs at R Mbit/s (``link=0``: no limit). Needs ``--links``.

Each rank applies its own entries (:class:`LoadSchedule`) as the step starts; the busy processes it
started stop with the run.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer
from typing_extensions import override

from lightning_dynamix.bench.contention import set_quota, start_busy
from lightning_dynamix.bench.hosts import shape_link

HOSTS_ENV = "DYNAMIX_BENCH_HOSTS"  # in a rank launched on a host: the hosts' namespaces and burst, as JSON


@dataclass(frozen=True)
class LoadChange:
    """From ``step`` on, rank ``rank``'s machine changes: ``kind`` ``busy`` (``value`` processes more, or fewer
    where negative), ``quota`` (``value`` cores) or ``link`` (``value`` Mbit/s, 0: no limit)."""

    step: int
    rank: int
    kind: str
    value: float

    def __str__(self) -> str:
        change = {"busy": f"busy{int(self.value):+d}", "quota": f"quota={self.value:g}", "link": f"link={self.value:g}"}
        return f"{self.step}:{self.rank}:{change[self.kind]}"


def parse_change(step: int, rank: int, text: str) -> LoadChange:
    """``busy+N``, ``busy-N``, ``quota=F`` or ``link=R`` as a :class:`LoadChange`; ``ValueError`` naming it."""
    entry = f"{step}:{rank}:{text}"
    try:
        if text.startswith("busy") and text[4:5] in ("+", "-"):
            count = int(text[4:])
            if count != 0:
                return LoadChange(step, rank, "busy", float(count))
        elif text.startswith("quota="):
            cores = float(text[6:])
            if 0 < cores <= 1:
                return LoadChange(step, rank, "quota", cores)
        elif text.startswith("link="):
            rate = float(text[5:])
            if rate >= 0:  # NaN is not
                return LoadChange(step, rank, "link", rate)
    except ValueError:
        pass
    raise ValueError(
        f"--schedule entry {entry!r}: the change must be a factor (the emulator's), busy+N or busy-N (N >= 1 busy"
        " processes beside the rank), quota=F (0 < F <= 1 cores) or link=R (Mbit/s >= 0, 0: no limit)"
    )


def check_changes(changes: Sequence[LoadChange], contention: str, world: int, links: bool) -> None:
    """Refuse changes this run cannot make (``ValueError`` naming the entry and what it needs)."""
    needs = {
        "busy": ("--contention busy", contention == "busy"),
        "quota": ("--contention quota", contention == "quota"),
        "link": ("--links (ranks on hosts of their own)", links),
    }
    running: dict[int, int] = {}
    for change in sorted(changes, key=lambda c: c.step):
        entry = str(change)
        if not 0 <= change.rank < world:
            raise ValueError(f"--schedule entry {entry!r}: rank {change.rank} is not one of the {world} ranks")
        what, ok = needs[change.kind]
        if not ok:
            raise ValueError(f"--schedule entry {entry!r}: a {change.kind} change needs {what}")
        if change.kind == "busy":
            running[change.rank] = running.get(change.rank, 0) + int(change.value)
            if running[change.rank] < 0:
                raise ValueError(
                    f"--schedule entry {entry!r} stops more busy processes beside rank {change.rank} than the schedule"
                    " started"
                )


class LoadSchedule(Callback):
    """On one rank, its own :class:`LoadChange` entries, applied as their steps start.

    Args:
        changes: every rank's changes (this rank applies those for ``rank``).
        rank: this process's rank.
    """

    def __init__(self, changes: Sequence[LoadChange], rank: int) -> None:
        self.changes = sorted((c for c in changes if c.rank == rank), key=lambda c: c.step)
        self.rank = rank
        self.busy: list[subprocess.Popen[bytes]] = []
        self.applied: list[LoadChange] = []

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        self.at_step(trainer.global_step)

    def at_step(self, step: int) -> None:
        """Apply the changes due at or before ``step`` not applied yet."""
        while self.changes and self.changes[0].step <= step:
            change = self.changes.pop(0)
            getattr(self, f"_{change.kind}")(change.value)
            self.applied.append(change)

    def _busy(self, value: float) -> None:
        count = int(value)
        # on this rank's cores: a child inherits the affinity --contention busy pinned the rank to
        self.busy += [start_busy() for _ in range(count)]
        for _ in range(-count):
            process = self.busy.pop()
            process.kill()
            process.wait()

    def _quota(self, cores: float) -> None:
        set_quota(self.rank, cores)

    def _link(self, rate: float) -> None:
        hosts = json.loads(os.environ[HOSTS_ENV])
        shape_link(hosts["namespaces"][self.rank], hosts["switch"], self.rank, rate or None, hosts["burst_ms"])

    @override
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self.stop()

    def stop(self) -> None:
        """Stop the busy processes this rank started."""
        for process in self.busy:
            process.kill()
            process.wait()
        self.busy = []
