"""``python -m MODULE ARGS`` and ``python SCRIPT ARGS`` for the tests, forked from a Python that has imported torch,
Lightning and the package.

A new Python spends about 3.4 s of a core importing torch and Lightning before a ``dynamix`` command does
anything, and the CLI tests start some twenty of them. :class:`ForkServer` starts one process that imports
``preload`` once and waits; each :meth:`ForkServer.run` has it fork a child that runs the command as ``python
-m`` does (``runpy.run_module`` as ``__main__``, the working directory first on ``sys.path``), in the
command's working directory, environment and output files, and reports the child's exit status; a script runs as
``python SCRIPT`` does (``runpy.run_path`` as ``__main__``, the script's directory first on ``sys.path``). The child is
a process of its own: its id, its signal handlers, the threads, CPU affinity and cgroups it sets, its exit
(``atexit`` included) are its own and die with it; a rank Lightning's launcher starts from it runs ``python -m
MODULE ARGS`` (or ``python SCRIPT ARGS``) anew, as from any process.

The server forks only while it runs one Python thread (it refuses to start otherwise), and only for a command whose
environment is the server's own (the variables torch and its libraries read at import time are those the
command would have read); :func:`run_module` and :func:`run_script` start any other command as a new Python.

Usage (the server): python -m tests.forkserver SOCKET [MODULE...]
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import json
import os
import runpy
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
_IGNORED = ("PYTEST_CURRENT_TEST",)  # set per test; the child gets the command's value


class ForkServer:
    """A process that has imported ``preload`` (module names) in environment ``env``, forking commands on request.

    Args:
        preload: the modules to import once.
        env: the server's environment, and so that of every command it may run.
        start_timeout: seconds to wait for the server to import ``preload`` and listen.
    """

    def __init__(self, preload: tuple[str, ...], env: dict[str, str], start_timeout: float = 120.0) -> None:
        self.env = dict(env)
        self._dir = tempfile.mkdtemp(prefix="forkserver-")
        self.path = os.path.join(self._dir, "socket")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tests.forkserver", self.path, *preload],
            cwd=ROOT, env=self.env, stdin=subprocess.DEVNULL,
        )  # fmt: skip
        ends = time.monotonic() + start_timeout
        while not os.path.exists(self.path):
            if self.process.poll() is not None:
                raise RuntimeError(f"the fork server exited with {self.process.returncode} before listening")
            if time.monotonic() > ends:
                self.close()
                raise RuntimeError(f"the fork server did not listen within {start_timeout:g} s")
            time.sleep(0.05)

    def serves(self, env: dict[str, str]) -> bool:
        """Whether a command with environment ``env`` may be forked from this server."""
        return self.process.poll() is None and _without(env) == _without(self.env)

    def run(
        self, target: str, args: list[str], cwd: Path, env: dict[str, str], timeout: float, script: bool = False
    ) -> tuple[int, str, int]:
        """Run ``python -m target args`` (``python target args`` for a ``script``) in ``cwd``: its exit status, its
        output (stdout, then stderr) and its process id. Raises ``subprocess.TimeoutExpired`` (the command killed)
        after ``timeout`` seconds."""
        with tempfile.TemporaryDirectory(prefix="forked-") as out:
            outputs = [os.path.join(out, name) for name in ("stdout", "stderr")]
            kind = "script" if script else "module"
            request = {kind: target, "args": args, "cwd": str(cwd), "env": env, "outputs": outputs}
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as connection:
                connection.connect(self.path)
                connection.sendall((json.dumps(request) + "\n").encode())
                reader = connection.makefile("r")
                pid = int(reader.readline())
                connection.settimeout(timeout)
                try:
                    status = int(reader.readline())
                except TimeoutError:
                    os.kill(pid, signal.SIGKILL)
                    raise subprocess.TimeoutExpired([target, *args], timeout) from None
            output = "".join(Path(path).read_text(errors="replace") for path in outputs)
        return status, output, pid

    def close(self) -> None:
        """Stop the server (a command it forked runs to its end)."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        with contextlib.suppress(OSError):
            os.unlink(self.path)
        with contextlib.suppress(OSError):
            os.rmdir(self._dir)


def _without(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k not in _IGNORED}


_SERVERS: dict[tuple[str, ...], ForkServer] = {}


def run_module(
    module: str, args: list[str], cwd: Path, env: dict[str, str], timeout: float, preload: tuple[str, ...]
) -> tuple[int, str, int]:
    """:meth:`ForkServer.run` on this process's server for ``preload`` (started at the first call, stopped at this
    process's exit), or ``python -m module args`` as a new process where ``env`` is not the server's."""
    return _run_forked(module, args, cwd, env, timeout, preload, script=False)


def run_script(
    script: str, args: list[str], cwd: Path, env: dict[str, str], timeout: float, preload: tuple[str, ...]
) -> tuple[int, str, int]:
    """:func:`run_module` for ``python script args``."""
    return _run_forked(script, args, cwd, env, timeout, preload, script=True)


def _run_forked(
    target: str, args: list[str], cwd: Path, env: dict[str, str], timeout: float, preload: tuple[str, ...], script: bool
) -> tuple[int, str, int]:
    server = _SERVERS.get(preload)
    if server is None or server.process.poll() is not None:
        server = _SERVERS[preload] = ForkServer(preload, env)
        atexit.register(server.close)
    if server.serves(env):
        return server.run(target, args, cwd, env, timeout, script=script)
    command = [sys.executable, target] if script else [sys.executable, "-m", target]
    with subprocess.Popen(
        [*command, *args], cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    ) as proc:
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    return proc.returncode, stdout + stderr, proc.pid


def _serve(path: str, preload: list[str]) -> dict[str, Any] | None:
    """Import ``preload``, then fork a child per request; in a child, its request; ``None`` when the server ends."""
    for name in preload:
        importlib.import_module(name)
    if threading.active_count() != 1:  # native pools (numpy's OpenBLAS) handle a fork themselves
        sys.exit(f"the fork server runs {threading.active_count()} Python threads after importing {preload}")
    parent = os.getppid()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path + ".new")
    os.rename(path + ".new", path)  # the client waits for the name: it appears once the server listens
    listener.listen()
    listener.settimeout(1.0)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    while True:
        try:
            connection, _ = listener.accept()
        except TimeoutError:
            if os.getppid() != parent:  # the test process is gone
                return None
            continue
        connection.settimeout(None)
        request = json.loads(connection.makefile("r").readline())
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            listener.close()
            connection.close()
            return request
        connection.sendall(f"{pid}\n".encode())
        _, status = os.waitpid(pid, 0)
        with contextlib.suppress(OSError):  # unless the client gave up (a timeout) and killed it
            connection.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())
        connection.close()


def _run(request: dict[str, Any]) -> None:
    """In the forked child: become ``python -m MODULE ARGS`` (or ``python SCRIPT ARGS``) in the request's directory,
    environment and files."""
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    stdin = os.open(os.devnull, os.O_RDONLY)
    os.dup2(stdin, 0)
    for fd, path in zip((1, 2), request["outputs"]):
        opened = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(opened, fd)
        os.close(opened)
    os.close(stdin)
    if "script" in request:
        script = request["script"]
        sys.path[0] = os.path.dirname(os.path.abspath(script))  # as `python SCRIPT` puts the script's directory first
        sys.argv = [script, *request["args"]]
        runpy.run_path(script, run_name="__main__")
    else:
        sys.path[0] = os.getcwd()  # as `python -m` puts the working directory first
        sys.argv = ["-m", *request["args"]]  # run_module sets argv[0] to the module's file
        runpy.run_module(request["module"], run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    _request = _serve(sys.argv[1], sys.argv[2:])
    if _request is not None:
        _run(_request)
