"""The launcher that forks a trainer's embedding servers: they run the serve command as a new Python would (its
arguments, checks and errors, the trainer's output files, working directory and environment of the moment),
report their exit status, obey signals, and end with the trainer, however it ends."""

from __future__ import annotations

import os
import re
import runpy
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lightning_dynamix.offload.server_launcher import launch
from lightning_dynamix.offload.server_process import server_environment

pytestmark = [
    pytest.mark.distributed,  # it starts servers and their launchers
    pytest.mark.skipif(sys.platform != "linux", reason="servers are forked on Linux only"),
]


def _unused_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _args(port: int, timeout: float, server_rank: int = 0) -> list[str]:
    return ["--address", f"127.0.0.1:{port}", "--server-rank", str(server_rank), "--num-servers", "1",
            "--num-trainers", "1", "--timeout", str(timeout)]  # fmt: skip


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def _gone(pid: int, within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


def test_a_forked_server_checks_its_arguments_and_writes_its_errors_where_this_process_writes(capfd):
    server = launch(_args(_unused_port(), 30, server_rank=1), server_environment())
    assert server.wait(timeout=60) == 2
    assert "python -m lightning_dynamix.serve: error: `server_rank` must be in [0, 1), got 1" in capfd.readouterr().err


def test_a_forked_server_whose_trainers_never_come_gives_up_after_its_timeout(capfd):
    port = _unused_port()
    server = launch(_args(port, 1), server_environment())
    with pytest.raises(subprocess.TimeoutExpired):
        server.wait(timeout=0)  # still waiting for its trainers
    assert server.poll() is None
    assert server.wait(timeout=60) == 1
    assert f"did not all meet at 127.0.0.1:{port} within --timeout 1 s" in capfd.readouterr().err


def test_servers_share_one_launcher_of_this_process_and_obey_signals():
    first = launch(_args(_unused_port(), 60), server_environment())
    second = launch(_args(_unused_port(), 60), server_environment())
    launcher = _parent(first.pid)
    assert _parent(second.pid) == launcher != os.getpid()
    assert _parent(launcher) == os.getpid()
    first.terminate()
    second.kill()
    assert first.wait(timeout=60) == -signal.SIGTERM
    assert second.wait(timeout=60) == -signal.SIGKILL
    first.kill()  # an ended server is not signalled again
    assert first.poll() == -signal.SIGTERM

    # an environment that differs in what a process reads at its start (torch's C++ log level) gets a launcher
    # started in it: a server never runs with another environment's logging or threads
    verbose = launch(_args(_unused_port(), 60), {**server_environment(), "TORCH_CPP_LOG_LEVEL": "INFO"})
    assert _parent(verbose.pid) not in (launcher, os.getpid())
    assert _parent(_parent(verbose.pid)) == os.getpid()
    verbose.kill()
    assert verbose.wait(timeout=60) == -signal.SIGKILL

    os.kill(launcher, signal.SIGKILL)  # a launcher that ended is started again for the next server
    third = launch(_args(_unused_port(), 60), server_environment())
    assert _parent(third.pid) not in (launcher, os.getpid())
    third.terminate()
    assert third.wait(timeout=60) == -signal.SIGTERM


# a trainer process that starts a server, then waits; beneath the package's stand-in, as the servers' launcher is
# (no Lightning to import: a second, not four)
_TRAINER = """
import importlib.util, os, sys, types
package = types.ModuleType("lightning_dynamix")
package.__path__ = list(importlib.util.find_spec("lightning_dynamix").submodule_search_locations)
sys.modules["lightning_dynamix"] = package
from lightning_dynamix.offload.server_launcher import launch
server = launch(["--address", "127.0.0.1:" + sys.argv[1], "--server-rank", "0", "--num-servers", "1",
                 "--num-trainers", "1", "--timeout", "1"], dict(os.environ))
print(server.pid, flush=True)
sys.stdin.readline()  # until told to end
"""


@pytest.mark.e2e
@pytest.mark.parametrize("ending", ["exit", "SIGKILL"])
def test_the_launcher_ends_with_its_trainer_however_the_trainer_ends(ending):
    trainer = subprocess.Popen(
        [sys.executable, "-c", _TRAINER, str(_unused_port())],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=server_environment(),
    )
    try:
        server = int(trainer.stdout.readline())
        launcher = _parent(server)
        assert _parent(launcher) == trainer.pid
    finally:
        if ending == "exit":
            trainer.communicate("\n", timeout=60)
        else:
            trainer.kill()
            trainer.wait(timeout=60)
    assert _gone(launcher, 30), f"the launcher (pid {launcher}) outlived its trainer"
    # a server that met its trainers ends within its check of its parent (tests/distributed/test_layer_offload.py);
    # this one, which never met them, within its --timeout
    assert _gone(server, 60), f"the server (pid {server}) outlived its --timeout"


def test_the_start_timing_script_starts_a_server_both_ways(capfd, monkeypatch):
    # docs/benchmarks/layer_offload.md times 5 rounds of it; one round here: both starts run and are reported
    script = runpy.run_path(str(Path(__file__).resolve().parents[2] / "scripts" / "server_start.py"))
    monkeypatch.setattr(sys, "argv", ["server_start.py", "--rounds", "1"])
    script["main"]()
    printed = capfd.readouterr().out
    assert re.fullmatch(r"round 0: a new Python \d+\.\d\d s, forked by the launcher \d+\.\d{3} s\n", printed)
