"""A fork while a process group is initialized lets other threads finish their Python work first.

A gloo thread that frees a finished collective creates a Python thread state before it takes the
GIL; a child forked at that moment hung before its first line (a DataLoader worker started just
after a collective). The fork now waits with the interpreter released, where a group exists.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

_FORK = """
import os, sys, tempfile, threading, time
import torch.distributed as dist
from lightning_dynamix.distributed import collectives

sys.setswitchinterval(30.0)  # only a voluntary release of the interpreter lets the woken thread run
collectives.FORK_GRACE_SECONDS = 2.0  # room for the woken thread on a loaded machine
collectives.let_backend_threads_finish()
if sys.argv[1] == "group":
    dist.init_process_group("gloo", store=dist.FileStore(tempfile.mktemp(), 1), rank=0, world_size=1)
go, ran = threading.Event(), []
waiter = threading.Thread(target=lambda: (go.wait(), ran.append(1)))
waiter.start()
time.sleep(0.2)  # the waiter is blocked in go.wait(), the interpreter released
go.set()  # wakes it; it now waits for the interpreter, which this thread holds until it forks
pid = os.fork()
if pid == 0:
    os._exit(len(ran))  # what the child inherited: whether the woken thread ran before the fork
print(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
waiter.join()
"""


@pytest.mark.distributed
@pytest.mark.parametrize(("group", "ran_before_fork"), [("group", 1), ("none", 0)])
def test_a_fork_while_a_process_group_is_initialized_lets_woken_threads_run_first(group, ran_before_fork):
    forked = subprocess.run([sys.executable, "-c", _FORK, group], capture_output=True, text=True, timeout=120)
    assert forked.returncode == 0, forked.stderr
    assert int(forked.stdout.strip().splitlines()[-1]) == ran_before_fork
