"""``python -m MODULE ARGS`` and ``python SCRIPT ARGS`` for the tests, forked from a Python that has imported torch,
Lightning and the package.

A new Python spends about 3.4 s of a core importing torch and Lightning before a ``dynamix`` command does
anything, and the CLI tests start some twenty of them. :class:`ForkServer` starts one process that imports
``preload`` once and waits; each :meth:`ForkServer.run` has it fork a child that runs the command as ``python
-m`` does (``runpy.run_module`` as ``__main__``, the working directory first on ``sys.path``), in the
command's working directory, environment and output files, and reports the child's exit status; a script runs as
``python SCRIPT`` does (``runpy.run_path`` as ``__main__``, the script's directory first on ``sys.path``). The child is
a process of its own: its id, its signal handlers, the threads, CPU affinity and cgroups it sets, its exit
(``atexit`` included) are its own and die with it.

A rank of the command's job that its launcher starts (Lightning's starts ``python -m MODULE ARGS`` or ``python SCRIPT
ARGS`` with ``subprocess.Popen``, in the command's environment and the job's variables) is forked by the server too,
with the command's files 0, 1 and 2 (sent over the socket): ``subprocess.Popen`` in a forked command hands such a
start to the server and returns a :class:`ForkedRank`, with the ``Popen`` methods a launcher uses (``pid``, ``poll``,
``wait``, ``send_signal``, ``terminate``, ``kill``). Every other process a command starts starts as it would anywhere.

The server forks only while it runs one Python thread (it refuses to start otherwise), and only for a command whose
environment is the server's own, but for what the server's imports set as the command has it (the variables torch
and its libraries read at import time are those the command would have read); :func:`run_module` and
:func:`run_script` start any other command as a new Python.

Usage (the server): python -m tests.forkserver SOCKET [MODULE...]
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import json
import os
import runpy
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning_dynamix.distributed.launching import JOB_VARIABLES

ROOT = Path(__file__).resolve().parents[1]
_IGNORED = ("PYTEST_CURRENT_TEST",)  # set per test; the child gets the command's value


@dataclass(frozen=True)
class Completed:
    """A command run to its end: its exit status (``-N`` for signal ``N``), its outputs and its process id."""

    returncode: int
    stdout: str
    stderr: str
    pid: int

    @property
    def output(self) -> str:
        """stdout, then stderr."""
        return self.stdout + self.stderr


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
        with open(self.path + ".env") as written:
            self.preloaded_env: dict[str, str] = json.load(written)  # the server's, once its imports set theirs

    def serves(self, env: dict[str, str]) -> bool:
        """Whether a command with environment ``env`` may be forked from this server."""
        return self.process.poll() is None and _differs_only_in(env, self.env, self.preloaded_env, _IGNORED)

    def run(
        self, target: str, args: list[str], cwd: Path, env: dict[str, str], timeout: float, script: bool = False
    ) -> Completed:
        """Run ``python -m target args`` (``python target args`` for a ``script``) in ``cwd`` to its end. Raises
        ``subprocess.TimeoutExpired`` (the command killed) after ``timeout`` seconds."""
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
            stdout, stderr = (Path(path).read_text(errors="replace") for path in outputs)
        return Completed(status, stdout, stderr, pid)

    def close(self) -> None:
        """Stop the server (a command it forked runs to its end)."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        shutil.rmtree(self._dir, ignore_errors=True)  # its socket and environment


def _differs_only_in(
    env: dict[str, str], base: dict[str, str], preloaded: dict[str, str], free: tuple[str, ...]
) -> bool:
    """Whether ``env`` is ``base`` but for the variables ``free`` names and those the server's imports set as ``env``
    has them (``preloaded``: its environment after them; stable-baselines3's import sets one, for pygame)."""
    changed = {k for k in set(env) | set(base) if env.get(k) != base.get(k)}
    return all(k in free or env.get(k) == preloaded.get(k) for k in changed)


_SERVERS: dict[tuple[str, ...], ForkServer] = {}


def run_module(
    module: str, args: list[str], cwd: Path, env: dict[str, str], timeout: float, preload: tuple[str, ...]
) -> Completed:
    """:meth:`ForkServer.run` on this process's server for ``preload`` (started at the first call, stopped at this
    process's exit), or ``python -m module args`` as a new process where ``env`` is not the server's."""
    return _run_forked(module, args, cwd, env, timeout, preload, script=False)


def run_script(
    script: str, args: list[str], cwd: Path, env: dict[str, str], timeout: float, preload: tuple[str, ...]
) -> Completed:
    """:func:`run_module` for ``python script args``."""
    return _run_forked(script, args, cwd, env, timeout, preload, script=True)


def _run_forked(
    target: str, args: list[str], cwd: Path, env: dict[str, str], timeout: float, preload: tuple[str, ...], script: bool
) -> Completed:
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
    return Completed(proc.returncode, stdout, stderr, proc.pid)


def _serve(path: str, preload: list[str]) -> tuple[dict[str, Any], list[int]] | None:
    """Import ``preload``, then fork a child per request, several at once (a forked rank asks for the job's other
    ranks while it runs); in a child, its request and the files it was sent; ``None`` when the server ends."""
    global _SERVER, _PRELOADED_ENV
    for name in preload:
        importlib.import_module(name)
    _SERVER, _PRELOADED_ENV = path, dict(os.environ)
    with open(path + ".env", "w") as written:  # for the client's choice of commands it may fork (read once it listens)
        json.dump(_PRELOADED_ENV, written)
    if threading.active_count() != 1:  # native pools (numpy's OpenBLAS) handle a fork themselves
        sys.exit(f"the fork server runs {threading.active_count()} Python threads after importing {preload}")
    parent = os.getppid()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path + ".new")
    listener.listen()
    os.rename(path + ".new", path)  # the client waits for the name: it appears once the server listens
    wake, woken = os.pipe()  # SIGCHLD writes here: a child ended
    os.set_blocking(woken, False)
    signal.set_wakeup_fd(woken)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    waiting: dict[int, socket.socket] = {}  # a running child's pid: the connection its status goes to
    while True:
        ready, _, _ = select.select([listener, wake], [], [], 1.0)
        if listener in ready:
            connection, _ = listener.accept()
            try:
                request, fds = _receive(connection)
            except (OSError, ValueError):
                connection.close()
                continue
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                signal.set_wakeup_fd(-1)
                for number in (signal.SIGCHLD, signal.SIGTERM):
                    signal.signal(number, signal.SIG_DFL)
                for other in (listener, *waiting.values(), connection):
                    other.close()
                os.close(wake)
                os.close(woken)
                return request, fds
            for fd in fds:
                os.close(fd)
            with contextlib.suppress(OSError):
                connection.sendall(f"{pid}\n".encode())
            waiting[pid] = connection
        if wake in ready:
            with contextlib.suppress(BlockingIOError):
                os.read(wake, 512)
        for pid in list(waiting):
            ended, status = os.waitpid(pid, os.WNOHANG)
            if ended:
                connection = waiting.pop(pid)
                with contextlib.suppress(OSError):  # unless the client gave up (a timeout) and killed it
                    connection.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())
                connection.close()
        if os.getppid() != parent:  # the test process is gone
            return None


def _receive(connection: socket.socket) -> tuple[dict[str, Any], list[int]]:
    """A request (a line of JSON) and the files sent with its first bytes."""
    connection.settimeout(30.0)
    data, fds, _, _ = socket.recv_fds(connection, 1 << 16, 3)
    while not data.endswith(b"\n"):
        more = connection.recv(1 << 16)
        if not more:
            raise ValueError("the request ended before its line did")
        data += more
    connection.settimeout(None)
    return json.loads(data), list(fds)


# in the processes the server forks: its socket, its environment once it imported its preload, the command's
_SERVER: str | None = None
_PRELOADED_ENV: dict[str, str] = {}
_COMMAND_ENV: dict[str, str] = {}
# what a launcher sets in a rank's environment (no library reads these at import time)
_LAUNCHERS = (*JOB_VARIABLES, "PL_GLOBAL_SEED", "PL_SEED_WORKERS")


class ForkedRank:
    """A rank a forked command asked the server for, with the methods of :class:`subprocess.Popen` a launcher uses.

    Args:
        args: the command, as it was given to ``Popen``.
        request: the request for the server (the command's files are this process's 0, 1 and 2).
    """

    def __init__(self, args: list[str], request: dict[str, Any]) -> None:
        self.args = args
        self.stdin = self.stdout = self.stderr = None
        self.returncode: int | None = None
        assert _SERVER is not None
        self._connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._connection.connect(_SERVER)
        socket.send_fds(self._connection, [(json.dumps(request) + "\n").encode()], [0, 1, 2])
        self._buffer = b""
        self.pid = int(self._line(None))

    def _line(self, timeout: float | None) -> str | None:
        """The server's next line; ``None`` if none came within ``timeout`` (0: none waiting now)."""
        self._connection.settimeout(timeout)
        while b"\n" not in self._buffer:
            try:
                more = self._connection.recv(64)
            except (TimeoutError, BlockingIOError):
                return None
            if not more:
                raise RuntimeError(f"the fork server ended before rank {self.args} did")
            self._buffer += more
        line, self._buffer = self._buffer.split(b"\n", 1)
        return line.decode()

    def poll(self) -> int | None:
        if self.returncode is None:
            line = self._line(0)
            if line is not None:
                self.returncode = int(line)
                self._connection.close()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            line = self._line(timeout)
            if line is None:
                raise subprocess.TimeoutExpired(self.args, timeout or 0)
            self.returncode = int(line)
            self._connection.close()
        return self.returncode

    def send_signal(self, number: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, number)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def __enter__(self) -> ForkedRank:
        return self

    def __exit__(self, *_: object) -> None:
        self.wait()


def _rank_request(args: Any, rest: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any] | None:
    """The server's request for ``Popen(args, *rest, **kwargs)``, where it starts a rank of this command's job: ``python
    -m MODULE ARGS`` or ``python SCRIPT ARGS``, with this process's files, in an environment that differs from this
    command's only in what a launcher sets for a rank (and what the imports the server made set); else ``None``."""
    if rest or not set(kwargs) <= {"env", "cwd"} or not isinstance(args, (list, tuple)) or len(args) < 2:
        return None
    if not all(isinstance(word, str) for word in args) or args[0] != sys.executable:
        return None
    env = dict(os.environ if kwargs.get("env") is None else kwargs["env"])
    if not _differs_only_in(env, _COMMAND_ENV, _PRELOADED_ENV, _LAUNCHERS):
        return None
    cwd = os.fspath(kwargs.get("cwd") or os.getcwd())
    if args[1] == "-m" and len(args) > 2:
        return {"module": args[2], "args": list(args[3:]), "cwd": cwd, "env": env}
    if args[1].endswith(".py") and os.path.isfile(os.path.join(cwd, args[1])):
        return {"script": args[1], "args": list(args[2:]), "cwd": cwd, "env": env}
    return None


class _ForkingPopen(subprocess.Popen):
    """``subprocess.Popen`` in a forked command: a rank of its job (see :func:`_rank_request`) forked by the server,
    any other command started as ``Popen`` starts it."""

    def __new__(cls, args: Any, *rest: Any, **kwargs: Any) -> Any:
        request = _rank_request(args, rest, kwargs)
        if request is None:
            return super().__new__(cls)
        return ForkedRank(list(args), request)


def _run(request: dict[str, Any], fds: list[int]) -> None:
    """In the forked child: become ``python -m MODULE ARGS`` (or ``python SCRIPT ARGS``) in the request's directory,
    environment and files (the ``outputs`` it names, or the files it was sent); the ranks it starts are forked too."""
    global _COMMAND_ENV
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    _COMMAND_ENV = dict(request["env"])
    if fds:
        for fd, sent in zip((0, 1, 2), fds):
            os.dup2(sent, fd)
            os.close(sent)
    else:
        stdin = os.open(os.devnull, os.O_RDONLY)
        os.dup2(stdin, 0)
        for fd, path in zip((1, 2), request["outputs"]):
            opened = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(opened, fd)
            os.close(opened)
        os.close(stdin)
    subprocess.Popen = _ForkingPopen  # type: ignore[misc]
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
        _run(*_request)
