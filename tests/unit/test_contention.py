"""Real contention on one machine (``dynamix bench ... --contention``): where ranks run, and that it slows them."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lightning_dynamix.bench import contention
from lightning_dynamix.bench.contention import Contention, RankPlace, plan


def test_busy_gives_every_rank_a_core_and_the_slow_rank_busy_processes_beside_it():
    assert plan("busy", [1, 3], cpus=[4, 6]) == [RankPlace(cores=(4,)), RankPlace(cores=(6,), busy=2)]
    assert plan("emulate", [1, 3], cpus=[0]) is None


def test_quota_packs_ranks_onto_cores_whose_quotas_add_up_to_one_core_at_most():
    places = plan("quota", [4, 1, 2], cpus=[0, 1])
    assert places == [
        RankPlace(cores=(1,), quota=0.25),
        RankPlace(cores=(0,)),  # a full core: no quota
        RankPlace(cores=(1,), quota=0.5),
    ]


def test_threads_give_the_fast_rank_more_threads_on_cores_of_its_own():
    assert plan("threads", [1, 2, 4], cpus=range(8)) == [
        RankPlace(cores=(0, 1, 2, 3), threads=4),
        RankPlace(cores=(4, 5), threads=2),
        RankPlace(cores=(6,), threads=1),
    ]


@pytest.mark.parametrize(
    ("mode", "speeds", "message"),
    [
        ("busy", [1, 2, 2], "needs a core per rank (3 ranks), but this process may use 2 core(s) [0, 1]"),
        ("busy", [1, 1.5], "needs whole-number speeds"),
        ("quota", [1, 1, 2], "needs 2.50 cores of CPU time"),
        ("threads", [1, 2], "needs 3 cores (threads [2, 1]"),
        ("threads", [1, 3, 2], "a whole number"),
        ("quota", [1, 0.5], "--speeds must be >= 1"),
        ("sleep", [1, 2], "--contention must be one of emulate, busy, quota, threads, got 'sleep'"),
    ],
)
def test_what_the_machine_cannot_provide_is_refused_naming_the_value_and_what_it_has(mode, speeds, message):
    with pytest.raises(ValueError, match=r"^--") as error:
        plan(mode, speeds, cpus=[0, 1])
    assert message in str(error.value)


def test_quota_without_a_cgroup_v1_cpu_controller_is_refused(tmp_path):
    with pytest.raises(ValueError, match="needs the cgroup v1 cpu controller at"):
        contention.check_cgroup_rights(tmp_path)
    with pytest.raises(ValueError, match="needs the cgroup v1 cpu controller"):
        Contention(plan("quota", [1, 2], cpus=[0, 1]), cgroup_root=tmp_path)


def _affinity(pid: int) -> set[int]:
    return os.sched_getaffinity(pid)


@pytest.mark.distributed
def test_busy_processes_run_pinned_to_the_slow_ranks_core_and_end_with_the_block():
    cpus = sorted(os.sched_getaffinity(0))
    places = [RankPlace(cores=(cpus[-1],), busy=2)]
    with Contention(places) as started:
        assert len(started.busy) == 2
        time.sleep(0.3)
        for proc in started.busy:
            assert proc.poll() is None  # spinning
            assert _affinity(proc.pid) == {cpus[-1]}
        pids = [proc.pid for proc in started.busy]
    assert all(not Path(f"/proc/{pid}").exists() for pid in pids)
    assert os.sched_getaffinity(0) == set(cpus)


_ORPHAN = """
import os, sys
from lightning_dynamix.bench.contention import Contention, RankPlace
started = Contention([RankPlace(cores=(int(sys.argv[1]),), busy=1)]).__enter__()
print(started.busy[0].pid, flush=True)
os._exit(0)  # killed, in effect: no clean-up
"""


@pytest.mark.distributed
def test_a_busy_process_ends_by_itself_when_its_launcher_is_gone_without_cleaning_up():
    core = sorted(os.sched_getaffinity(0))[-1]
    launcher = subprocess.run([sys.executable, "-c", _ORPHAN, str(core)], capture_output=True, text=True, check=True)
    pid = int(launcher.stdout.split()[0])
    deadline = time.monotonic() + 10
    while Path(f"/proc/{pid}").exists() and _state(pid) != "Z" and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not Path(f"/proc/{pid}").exists() or _state(pid) == "Z"


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


_SPIN = """
import os, sys, time
from lightning_dynamix.bench import contention
places = [contention.RankPlace(cores=(int(sys.argv[1]),), quota=float(sys.argv[2]))]
contention.apply(places, 0)
from lightning_dynamix.metrics.system import find_cpu_quota
print(find_cpu_quota().cores)  # what a rank reads of its own quota
start, cpu = time.monotonic(), time.process_time()
while time.monotonic() - start < 1.0:
    pass
print((time.process_time() - cpu) / (time.monotonic() - start))
"""


def _cgroup_rights() -> bool:
    try:
        contention.check_cgroup_rights()
    except ValueError:
        return False
    return True


@pytest.mark.e2e
@pytest.mark.skipif(not _cgroup_rights(), reason="needs the cgroup v1 cpu controller and root")
def test_a_quota_holds_a_rank_to_its_share_of_a_core_and_the_cgroups_are_removed_after():
    core = sorted(os.sched_getaffinity(0))[-1]
    places = [RankPlace(cores=(core,), quota=0.25)]
    with Contention(places) as started:
        group = started.group
        assert group is not None
        assert (group / "rank0" / "cpu.cfs_quota_us").read_text().strip() == "25000"
        spin = subprocess.run(
            [sys.executable, "-c", _SPIN, str(core), "0.25"], capture_output=True, text=True, timeout=60, check=True
        )
        found, share = map(float, spin.stdout.strip().splitlines()[-2:])
    assert found == 0.25  # the rank reads its own quota from its cgroup
    # at most a quarter of a core, not the whole core a spin loop takes; how much of its quarter it gets depends on
    # what else runs on the core (the suite's other worker), so no lower bound but that it ran
    assert 0.0 < share < 0.35
    assert not group.exists()


_THREADS = """
import sys
import torch
from lightning.fabric.utilities.distributed import _set_num_threads_if_needed
from lightning_dynamix.bench import contention
places = None if sys.argv[1] == "emulate" else [contention.RankPlace(cores=(0,), threads=int(sys.argv[1]))]
contention.apply(places, 0)
_set_num_threads_if_needed(num_processes=1)  # what Lightning's launcher does in a job of one rank
print(torch.get_num_threads())
"""


@pytest.mark.distributed
@pytest.mark.parametrize(("mode", "threads"), [("emulate", 1), ("2", 2)])
def test_a_rank_keeps_the_threads_its_place_gives_when_lightning_launches_it(mode, threads):
    # a lone rank would otherwise get every core, and the emulator's factors are per thread
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    out = subprocess.run([sys.executable, "-c", _THREADS, mode], capture_output=True, text=True, env=env, check=True)
    assert int(out.stdout.split()[-1]) == threads
