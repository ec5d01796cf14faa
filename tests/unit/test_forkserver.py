"""The tests' fork server (tests/forkserver.py): a forked command is a process of its own, as a new Python's is."""

from __future__ import annotations

import os
import subprocess

import pytest

from tests.forkserver import ForkServer

# a module a command runs: what its process sees, then a change to the process that must not reach the next one
_PROBE = """
import json, os, sys
print(json.dumps({"argv": sys.argv, "cwd": os.getcwd(), "path0": sys.path[0], "pid": os.getpid(),
                  "probe": os.environ.get("PROBE"), "mark": getattr(json, "left_by_the_last", None),
                  "main": __name__, "imported": "json" in sys.modules}))
json.left_by_the_last = os.getpid()  # on a module the server imported: in this process's copy only
sys.exit(int(sys.argv[1]))
"""


_SET_BY_LIGHTNING = "PYTORCH_NVML_BASED_CUDA_CHECK"


pytestmark = pytest.mark.distributed  # it starts fork servers and the processes they fork


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    probes = tmp_path_factory.mktemp("probes")
    (probes / "probe_module.py").write_text(_PROBE)
    (probes / "sleep_module.py").write_text("import time\ntime.sleep(120)\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(probes), os.environ.get("PYTHONPATH", "")]))
    env.pop(_SET_BY_LIGHTNING, None)  # the server's import of Lightning sets it
    server = ForkServer(("json", "torch"), env)  # torch: its threads, set at its import, are the server's
    yield server, env, probes
    server.close()


def test_a_forked_command_has_its_own_process_directory_arguments_and_exit_status(server, tmp_path):
    import json

    forks, env, _ = server
    results = []
    for code in (0, 3):
        done = forks.run("probe_module", [str(code)], tmp_path, dict(env, PROBE=str(code)), 60)
        assert done.returncode == code, done.output
        results.append((json.loads(done.stdout), done.pid))
    for seen, pid in results:
        assert seen["pid"] == pid not in (os.getpid(), forks.process.pid)
        assert seen["cwd"] == seen["path0"] == str(tmp_path)  # as `python -m` puts the working directory first
        assert seen["main"] == "__main__"
        assert seen["imported"]  # from the server's preload
        assert seen["mark"] is None  # what the command before it changed stayed in its process
    assert [seen["argv"][1:] for seen, _ in results] == [["0"], ["3"]]
    assert [seen["probe"] for seen, _ in results] == ["0", "3"]


def test_a_forked_script_runs_as_python_script_does(server, tmp_path):
    import json

    forks, env, probes = server
    script = probes / "probe_module.py"
    done = forks.run(str(script), ["3", "x"], tmp_path, env, 60, script=True)
    assert done.returncode == 3, done.output
    seen = json.loads(done.stdout)
    assert seen["pid"] == done.pid not in (os.getpid(), forks.process.pid)
    assert seen["argv"] == [str(script), "3", "x"]
    assert seen["cwd"] == str(tmp_path)
    assert seen["path0"] == str(probes)  # the script's directory, as `python SCRIPT` puts first
    assert seen["main"] == "__main__"


def test_a_command_past_its_timeout_is_killed_and_the_server_serves_the_next(server, tmp_path):
    forks, env, _ = server
    with pytest.raises(subprocess.TimeoutExpired):
        forks.run("sleep_module", [], tmp_path, env, 0.5)
    done = forks.run("probe_module", ["0"], tmp_path, env, 60)  # it waited for the killed one
    assert done.returncode == 0, done.output


def test_only_a_command_in_the_server_s_own_environment_is_forked(server):
    forks, env, _ = server
    assert forks.serves(dict(env, PYTEST_CURRENT_TEST="another test"))
    assert forks.serves(dict(env, OMP_NUM_THREADS="7"))  # a fork sets torch's threads as its import would have
    assert not forks.serves(dict(env, OMP_NUM_THREADS=""))  # torch's own default for none is not one a fork can set
    assert not forks.serves(dict(env, OTHER_VARIABLE="3"))  # a library may read it at its import
    # what the server's own imports set, as they set it: a command that imported the same (the test process) has it
    assert forks.preloaded_env[_SET_BY_LIGHTNING] == "1"
    assert forks.serves(dict(env, **{_SET_BY_LIGHTNING: "1"}))
    assert not forks.serves(dict(env, **{_SET_BY_LIGHTNING: "0"}))


# a script that starts ranks of its job as Lightning's launcher and torch elastic do (a script, `-u`, `-c`, a console
# script), then one with a variable changed that a library may read at its import; each rank says who started it
_LAUNCHER = """
import json, os, signal, subprocess, sys, time
if len(sys.argv) > 1:
    forked = "torch" in sys.modules  # the server's import: a new Python has not imported it yet
    print(json.dumps({"rank": os.environ["LOCAL_RANK"], "pid": os.getpid(), "parent": os.getppid(),
                      "forked": forked, "threads": __import__("torch").get_num_threads(),
                      "session": os.getsid(0) == os.getpid(), "argv": sys.argv, "path0": sys.path[0],
                      "main": __name__}), flush=True)
    if sys.argv[1] == "sleep":
        time.sleep(120)
    sys.exit(int(sys.argv[1]) if sys.argv[1] != "sleep" else 0)
ranks = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "5"], env=dict(os.environ, LOCAL_RANK="1")),
         subprocess.Popen([sys.executable, os.path.abspath(__file__), "6"],
                          env=dict(os.environ, LOCAL_RANK="2", OTHER_VARIABLE="3"))]
statuses = [rank.wait(timeout=60) for rank in ranks]
with open("rank4.log", "w") as log:  # as a bench starts a job: its own log, threads and session
    logged = subprocess.Popen([sys.executable, os.path.abspath(__file__), "0"], stdout=log, stderr=subprocess.STDOUT,
                              env=dict(os.environ, LOCAL_RANK="4", OMP_NUM_THREADS="3"), start_new_session=True)
captured = [subprocess.run(command, capture_output=True, text=True, env=dict(os.environ, LOCAL_RANK=rank), timeout=60)
            for rank, command in [("5", [sys.executable, os.path.abspath(__file__), "7"]),
                                  ("6", [sys.executable, "-u", "-c", open(__file__).read(), "8"]),  # torch elastic's -u
                                  ("7", [os.path.join(os.path.dirname(__file__), "tool"), "9"])]]
sleeper = subprocess.Popen([sys.executable, os.path.abspath(__file__), "sleep"], env=dict(os.environ, LOCAL_RANK="3"))
assert sleeper.poll() is None
import psutil
in_tree = sleeper.pid in [p.pid for p in psutil.Process().children(recursive=True)]
try:
    sleeper.wait(timeout=0.2)
except subprocess.TimeoutExpired:
    sleeper.kill()
print(json.dumps({"statuses": statuses, "killed": sleeper.wait(timeout=60), "pids": [r.pid for r in ranks],
                  "in_tree": in_tree,
                  "me": os.getpid(), "logged": [logged.wait(timeout=60), logged.pid],
                  "captured": [[c.returncode, json.loads(c.stdout)] for c in captured]}), flush=True)
"""


def test_a_rank_a_forked_command_starts_is_forked_as_its_descendant_and_any_other_process_starts_anew(server, tmp_path):
    import json
    import sys

    forks, env, probes = server
    script = probes / "launcher.py"
    script.write_text(_LAUNCHER)
    tool = probes / "tool"  # a console script of this interpreter, as torchrun and `accelerate` are
    tool.write_text(f"#!{sys.executable}\n{_LAUNCHER}")
    tool.chmod(0o755)
    done = forks.run(str(script), [], tmp_path, env, 120, script=True)
    assert done.returncode == 0, done.output
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    ranks = {line["rank"]: line for line in lines if "rank" in line}
    (summary,) = [line for line in lines if "statuses" in line]
    assert summary["statuses"] == [5, 6]  # each rank's exit status, through the server for the forked one
    assert summary["killed"] == -9
    assert [ranks["1"]["pid"], ranks["2"]["pid"]] == summary["pids"]
    # forked (the job's variables differ from the command's alone) by the command's own server, the command's child:
    # in the command's process tree, its parent the command, as a new Python's would be
    assert ranks["1"]["forked"]
    assert not ranks["2"]["forked"]  # a new Python: a variable a library may read at its import differs
    assert ranks["3"]["forked"]
    assert summary["in_tree"]
    assert all(rank["parent"] == done.pid for rank in ranks.values())
    assert not ranks["1"]["session"]
    # a job with a log of its own, its threads and a session: forked, torch's threads as OMP_NUM_THREADS says
    logged = json.loads((tmp_path / "rank4.log").read_text())
    assert logged["forked"]
    assert [logged["pid"], 0] == summary["logged"][::-1]
    assert logged["threads"] == 3
    assert logged["session"]
    # outputs through pipes, as subprocess.run captures them: a script, `python -u -c CODE`, a console script
    (script_status, script_rank), (code_status, code_rank), (tool_status, tool_rank) = summary["captured"]
    assert [script_status, code_status, tool_status] == [7, 8, 9]
    assert [rank["rank"] for rank in (script_rank, code_rank, tool_rank)] == ["5", "6", "7"]
    assert all(rank["forked"] for rank in (script_rank, code_rank, tool_rank))
    assert (code_rank["argv"], code_rank["path0"], code_rank["main"]) == (["-c", "8"], "", "__main__")
    assert (tool_rank["argv"], tool_rank["path0"], tool_rank["main"]) == ([str(tool), "9"], str(probes), "__main__")


# a torch elastic worker: says where it runs, then waits to be killed
_WORKER = """
import json, os, sys, time
# one write with its newline: unbuffered (PYTHONUNBUFFERED), print writes the line's end apart, and the two workers'
# lines could interleave in the agent's log
sys.stdout.write(json.dumps({"rank": os.environ["RANK"], "pid": os.getpid()}) + "\\n")
sys.stdout.flush()
time.sleep(120)
"""


def test_torchrun_forked_has_its_workers_in_its_process_tree_and_a_killed_tree_dies_whole(server, tmp_path):
    # as lightning_dynamix.bench.cluster preempts a node without notice: every process of the agent's tree, SIGKILL
    import json
    import signal
    import sys
    import time
    from pathlib import Path

    import psutil

    forks, env, probes = server
    (probes / "worker.py").write_text(_WORKER)
    torchrun = Path(sys.executable).parent / "torchrun"
    command = [str(torchrun), "--standalone", "--nproc-per-node", "2", str(probes / "worker.py")]
    with open(tmp_path / "agent.log", "w") as log:
        agent = forks.popen(command, cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while len(workers := [json.loads(line) for line in _lines(tmp_path / "agent.log") if line.startswith("{")]) < 2:
        assert agent.poll() is None, (tmp_path / "agent.log").read_text()
        assert time.monotonic() < deadline, (tmp_path / "agent.log").read_text()
        time.sleep(0.1)
    tree = [psutil.Process(agent.pid), *psutil.Process(agent.pid).children(recursive=True)]
    assert {w["pid"] for w in workers} <= {p.pid for p in tree}
    assert psutil.Process(agent.pid).cmdline()[1:3] == ["-m", "tests.forkserver"]  # forked, not a new Python
    for process in tree:
        process.send_signal(signal.SIGKILL)
    assert agent.wait(timeout=30) == -signal.SIGKILL
    _, alive = psutil.wait_procs(tree[1:], timeout=30)
    assert alive == []


def _lines(path):
    return path.read_text().splitlines()


# a command that ends as asked, with a non-daemon thread still running and an atexit handler that sees it joined
_ENDING = """
import atexit, os, sys, threading, time
def late():
    time.sleep(0.3)
    with open("thread", "w") as out:
        out.write("joined")
def at_exit():
    with open("atexit", "w") as out:
        out.write(str(os.path.exists("thread")))
atexit.register(at_exit)
threading.Thread(target=late).start()
sys.excepthook = lambda kind, error, trace: print(f"hook: {kind.__name__}: {error}", file=sys.stderr)
how = sys.argv[1]
if how == "raise":
    raise ValueError("boom")
if how == "interrupt":
    raise KeyboardInterrupt
sys.exit("a message" if how == "message" else int(how))
"""


@pytest.mark.parametrize(
    ("how", "status", "printed"),
    [("4", 4, ""), ("raise", 1, "hook: ValueError: boom"), ("message", 1, "a message"),
     ("interrupt", -2, "hook: KeyboardInterrupt")],
)  # fmt: skip
def test_a_forked_command_ends_as_a_new_python_does(server, tmp_path, how, status, printed):
    forks, env, probes = server
    (probes / "ending_module.py").write_text(_ENDING)
    done = forks.run("ending_module", [how], tmp_path, env, 60)
    assert done.returncode == status, done.output
    assert printed in done.stderr
    assert (tmp_path / "thread").read_text() == "joined"  # the non-daemon thread ran to its end
    assert (tmp_path / "atexit").read_text() == "True"  # then the atexit handlers, as Python's end runs them


# a command that starts a busy co-tenant as the benches do (it ends once its starter is gone), checks it runs, and ends
_STARTS_BUSY = """
import time
import psutil
from lightning_dynamix.bench.contention import start_busy
busy = start_busy()
time.sleep(1.0)
assert busy.poll() is None, busy.returncode  # it sees its starter as its parent
print(psutil.Process(busy.pid).cmdline()[1:3], busy.pid, flush=True)  # forked: the server's command line
"""


def test_a_forked_child_that_watches_its_parent_sees_its_starter_and_then_its_end(server, tmp_path):
    import psutil

    forks, env, probes = server
    (probes / "starts_busy.py").write_text(_STARTS_BUSY)
    done = forks.run("starts_busy", [], tmp_path, env, 60)
    assert done.returncode == 0, done.output
    assert done.stdout.startswith("['-m', 'tests.forkserver']"), done.stdout  # forked, so its parent is not its starter
    busy = psutil.Process(int(done.stdout.split()[-1]))
    busy.wait(timeout=30)  # it saw its starter end, as a new Python re-parented does
