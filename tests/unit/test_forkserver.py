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


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    probes = tmp_path_factory.mktemp("probes")
    (probes / "probe_module.py").write_text(_PROBE)
    (probes / "sleep_module.py").write_text("import time\ntime.sleep(120)\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(probes), os.environ.get("PYTHONPATH", "")]))
    server = ForkServer(("json",), env)
    yield server, env, probes
    server.close()


def test_a_forked_command_has_its_own_process_directory_arguments_and_exit_status(server, tmp_path):
    import json

    forks, env, _ = server
    results = []
    for code in (0, 3):
        status, output, pid = forks.run("probe_module", [str(code)], tmp_path, dict(env, PROBE=str(code)), 60)
        assert status == code, output
        results.append((json.loads(output), pid))
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
    status, output, pid = forks.run(str(script), ["3", "x"], tmp_path, env, 60, script=True)
    assert status == 3, output
    seen = json.loads(output)
    assert seen["pid"] == pid not in (os.getpid(), forks.process.pid)
    assert seen["argv"] == [str(script), "3", "x"]
    assert seen["cwd"] == str(tmp_path)
    assert seen["path0"] == str(probes)  # the script's directory, as `python SCRIPT` puts first
    assert seen["main"] == "__main__"


def test_a_command_past_its_timeout_is_killed_and_the_server_serves_the_next(server, tmp_path):
    forks, env, _ = server
    with pytest.raises(subprocess.TimeoutExpired):
        forks.run("sleep_module", [], tmp_path, env, 0.5)
    status, output, _ = forks.run("probe_module", ["0"], tmp_path, env, 60)  # it waited for the killed one
    assert status == 0, output


def test_only_a_command_in_the_server_s_own_environment_is_forked(server):
    forks, env, _ = server
    assert forks.serves(dict(env, PYTEST_CURRENT_TEST="another test"))
    assert not forks.serves(dict(env, OMP_NUM_THREADS="7"))  # torch read the server's at import
