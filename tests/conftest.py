"""Fixtures for the whole suite."""

from __future__ import annotations

import os
import subprocess
import sys

# Idle OpenMP threads sleep instead of spinning (every process the suite starts inherits it): ranks that wait in a
# collective, and two pytest-xdist workers on two cores, would otherwise burn the cores the others need
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest
import torch
import torch.distributed as dist

from lightning_dynamix.offload.server_launcher import ServerLauncher
from tests.forkserver import ForkServer, _ForkingPopen

if os.environ.get("PYTEST_XDIST_WORKER"):  # make test's workers share the cores rather than each take them all
    _threads = max(1, (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
    os.environ.setdefault("OMP_NUM_THREADS", str(_threads))  # what Lightning's launcher then leaves as it is
    torch.set_num_threads(_threads)


_PYTHONS_STARTED: list[str] = []  # the Python processes this process started, in order
# jsonargparse's typeshed_client asks a Python for its sys.path in every LightningCLI run: incidental, not the test's
_INCIDENTAL = ("import sys, json; print(json.dumps(sys.path))",)
_execute_child = subprocess.Popen._execute_child


def _recording_pythons(self, args, executable, *rest, **kwargs):
    argv = [args] if isinstance(args, (str, bytes, os.PathLike)) else list(args)
    program = os.path.basename(os.fsdecode(executable or argv[0])) if argv else ""
    incidental = len(argv) == 3 and os.fsdecode(argv[2]) in _INCIDENTAL
    if (program.startswith("python") or os.fsdecode(executable or argv[0]) == sys.executable) and not incidental:
        _PYTHONS_STARTED.append(" ".join(os.fsdecode(a) for a in argv)[:120])
    return _execute_child(self, args, executable, *rest, **kwargs)


subprocess.Popen._execute_child = _recording_pythons


def _recording_forks(function):
    """``function`` (a start of a Python forked from a warm one), recorded like a Python started anew."""

    def start(self, *args, **kwargs):
        _PYTHONS_STARTED.append(f"{function.__qualname__} {args[0] if args else ''}"[:120])
        return function(self, *args, **kwargs)

    return start


# an embedding server forked by this process's server launcher, a command forked by the tests' fork server: once a
# launcher or a fork server runs, later starts are forks and never reach Popen, so whichever test came first would
# be the only one seen
ServerLauncher.start = _recording_forks(ServerLauncher.start)
ForkServer.run = _recording_forks(ForkServer.run)
_ForkingPopen._execute_child = _recording_forks(_ForkingPopen._execute_child)


@pytest.fixture(autouse=True)
def _fast_tests_start_no_python(request):
    """``make test-fast`` leaves out the tests marked ``distributed`` or ``e2e``; a test that starts another Python
    (a job's ranks, a server, a launcher, a fresh interpreter) pays seconds of imports and is one of them. A test
    outside both marks that starts one fails, naming it, so the inner loop stays what its name says."""
    started = len(_PYTHONS_STARTED)
    yield
    marked = any(request.node.get_closest_marker(name) for name in ("distributed", "e2e"))
    if len(_PYTHONS_STARTED) > started and not marked:
        pytest.fail(
            f"{request.node.nodeid} started {_PYTHONS_STARTED[started]!r}: a test that starts a Python process is"
            " marked distributed (or e2e), which make test-fast leaves out",
            pytrace=False,
        )


@pytest.fixture(autouse=True)
def _environment_as_it_was():
    """Every test leaves ``os.environ``, torch's thread count and torch.distributed as it found them.

    A Trainer run in this process sets the launcher's variables (``MASTER_PORT``, ``LOCAL_RANK``, ...)
    and ``OMP_NUM_THREADS``. A job a later test starts would inherit them: with ``OMP_NUM_THREADS=2``
    left behind, Lightning no longer gives each of a job's ranks its share of the cores, and 5 ranks
    of 2 threads each on 2 cores ran the exactness jobs 1.7 times slower (23 s against 13.7 s). A test
    that trains on one thread (``torch.set_num_threads(1)``) would likewise leave every later
    in-process run on one.
    """
    environ, threads = dict(os.environ), torch.get_num_threads()
    grouped = dist.is_available() and dist.is_initialized()
    yield
    if os.environ != environ:
        os.environ.clear()
        os.environ.update(environ)
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    if not grouped and dist.is_available() and dist.is_initialized():
        # a fit in this process made a process group of one rank: a later test that needs none (or its own,
        # under pytest-xdist in whatever order a worker gets the files) must not find it
        dist.destroy_process_group()


# the longest files first: pytest-xdist hands a worker a file at a time in this order, so the many short unit files
# fill the gaps at the end instead of one worker running the docs' commands alone while the other waits
_FIRST = ("tests/docs/", "tests/cli/", "tests/distributed/")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    def rank(item: pytest.Item) -> int:
        path = item.nodeid.split("::", 1)[0]
        return next((i for i, prefix in enumerate(_FIRST) if path.startswith(prefix)), len(_FIRST))

    items.sort(key=rank)  # stable: each file keeps its tests' order


@pytest.fixture
def hosts_available():
    """Skips the test, saying what is missing, where hosts in network namespaces cannot be made (not root, no tc)."""
    from lightning_dynamix.bench.hosts import HostsUnavailable, check_hosts

    try:
        check_hosts()
    except HostsUnavailable as error:
        pytest.skip(str(error))


LITDATA_SAMPLES, LITDATA_CHUNK = 150, 16  # 9 chunk files of 16 samples and one of 6


@pytest.fixture(scope="session")
def litdata_dir(tmp_path_factory):
    """The jobs' ``IndexedDataset(150)`` (samples ``(index, x, y)``) written by ``litdata.optimize`` into a local
    directory, in a Python of its own (it switches its process's multiprocessing start method to spawn)."""
    from tests.distributed.conftest import JOBS

    out = tmp_path_factory.mktemp("streaming") / "litdata"
    done = subprocess.run(
        [sys.executable, "write_litdata.py", str(out), str(LITDATA_SAMPLES), str(LITDATA_CHUNK)],
        cwd=JOBS, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return out
