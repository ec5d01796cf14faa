"""``python -m MODULE ARGS``, ``python SCRIPT ARGS`` and ``python -c CODE ARGS`` for the tests, forked from a Python
that has imported torch, Lightning and the package.

A new Python spends about 5 s of a core importing torch and Lightning before a ``dynamix`` command does anything,
and the tests start hundreds. :class:`ForkServer` starts one process that imports ``preload`` once and waits; each
:meth:`ForkServer.run` has it fork a child that runs the command as ``python -m`` does (``runpy.run_module`` as
``__main__``, the working directory first on ``sys.path``), in the command's working directory, environment and
output files, and reports the child's exit status; a script runs as ``python SCRIPT`` does (``runpy.run_path`` as
``__main__``, the script's directory first on ``sys.path``). The child is a process of its own: its id, its signal
handlers, the threads, CPU affinity and cgroups it sets are its own and die with it. It ends as a new Python begins
to (its exit status, non-daemon threads joined, ``atexit`` handlers, output flushed) and skips the rest of
Python's finalization (:func:`_exit_as_python`).

A Python that a forked command starts with ``subprocess.Popen`` (a rank Lightning's launcher starts, a worker of
torchrun or ``accelerate launch``, a bench's job, a server) is forked too where it may be: ``python [-u] -m MODULE
ARGS``, ``python [-u] SCRIPT ARGS``, ``python [-u] -c CODE ARGS`` or a console script of this interpreter (``torchrun``,
``accelerate``: ``python SCRIPT`` as the kernel runs it), in the command's environment but for what a launcher sets
for a rank (the job's variables, torch elastic's, Accelerate's, torchft's, ``OMP_NUM_THREADS``, which the child gives
torch as a new Python's import would, and ``PYTHONPATH``, whose new entries go on ``sys.path``), with the files Popen
made for it (its pipes, a log file, ``DEVNULL``, or the command's own 0, 1 and 2) sent over the socket, in a session
of its own where asked. ``Popen`` returns as it would, its ``pid``, ``poll``, ``wait``, ``communicate`` and signals
reading the forking server's word on the child. The forking server is the command's own (:func:`_own_server`): a
fork of the command made before it ran, so the Pythons it starts are its descendants, as a new Python's children are
(torch elastic's agents' workers are found by walking the tree, as ``lightning_dynamix.bench.cluster`` preempts a
node), and its ``os.getppid()`` is the command while that server lives, as code that watches its parent expects (a
busy co-tenant, a server's ``--parent-pid``), then, once both are gone, the real one. A forked child has the CPU
affinity and cgroup its command had at its start: the benches that pin ranks say so in their environment
(``DYNAMIX_BENCH_CPUS``, ``DYNAMIX_BENCH_CGROUP``), which is not free, so those ranks start anew. :func:`popen` and
:func:`serving` do the same for the processes a test starts (a pool of ranks, a replica, a launcher, a local torch
elastic cluster). Every other process starts as it would anywhere.

The server forks only while it runs one Python thread (it refuses to start otherwise), and only for a command whose
environment is the server's own but for what a launcher sets and what the server's imports set as the command has it
(the variables torch and its libraries read at import time are those the command would have read);
:func:`run_module` and :func:`run_script` start any other command as a new Python.

Usage (the server): python -m tests.forkserver SOCKET [MODULE...]
"""

from __future__ import annotations

import atexit
import builtins
import contextlib
import ctypes
import importlib
import inspect
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
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from lightning_dynamix.distributed.launching import JOB_VARIABLES, job_environment

ROOT = Path(__file__).resolve().parents[1]
# set per test, or by a module as it loads, and read only as a module loads that no server's preload loads (a server
# refuses to start otherwise; a lighthouse the package starts sets RUST_LOG, gymnasium's import
# PYGAME_HIDE_SUPPORT_PROMPT): the child gets the command's value
_IGNORED = ("PYTEST_CURRENT_TEST", "RUST_LOG", "PYGAME_HIDE_SUPPORT_PROMPT")
# modules a server must not preload: each reads, as it loads, variables that are free or ignored here
_READ_AS_THEY_LOAD = {
    "torchft": "RUST_LOG, read as it loads, would be the server's in every forked child",
    "pygame": "PYGAME_HIDE_SUPPORT_PROMPT, read as it loads, would be the server's in every forked child",
    "accelerate": "the variables `accelerate launch` sets for its workers are free only while no server has loaded it",
}


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
        return self.process.poll() is None and _may_fork(env, self.env, self.preloaded_env)

    def run(
        self, target: str, args: list[str], cwd: Path, env: dict[str, str], timeout: float, script: bool = False
    ) -> Completed:
        """Run ``python -m target args`` (``python target args`` for a ``script``) in ``cwd`` to its end. Raises
        ``subprocess.TimeoutExpired`` (the command killed) after ``timeout`` seconds."""
        with tempfile.TemporaryDirectory(prefix="forked-") as out:
            outputs = [os.path.join(out, name) for name in ("stdout", "stderr")]
            kind = "script" if script else "module"
            request = {
                kind: target,
                "args": args,
                "cwd": str(cwd),
                "env": env,
                "outputs": outputs,
                "parent": os.getpid(),
            }
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

    def popen(self, args: list[str], free: tuple[str, ...] = (), **kwargs: Any) -> subprocess.Popen:
        """``subprocess.Popen(args, **kwargs)``, forked by this server where it may be (:func:`_served_request`;
        ``free``: more variables the command reads only once it runs, which may differ from the server's)."""
        return _ForkingPopen(args, route=(self.path, self.env, self.preloaded_env), free=free, **kwargs)

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
    has them (``preloaded``: its environment after them); a name in ``free`` that ends with ``*`` frees every variable
    that starts with what precedes it."""
    changed = {k for k in set(env) | set(base) if env.get(k) != base.get(k)}
    prefixes = tuple(name[:-1] for name in free if name.endswith("*"))
    return all(k in free or k.startswith(prefixes) or env.get(k) == preloaded.get(k) for k in changed)


def _may_fork(env: dict[str, str], base: dict[str, str], preloaded: dict[str, str], free: tuple[str, ...] = ()) -> bool:
    """Whether a command with environment ``env`` may be forked from a process whose own is ``base`` (see
    :func:`_differs_only_in`): it differs only in what a launcher sets (:data:`_FREE`), what ``free`` names and what
    no preloaded module reads (:data:`_IGNORED`), and names a thread count a fork can set."""
    if not _differs_only_in(env, base, preloaded, (*_FREE, *_IGNORED, *free)):
        return False
    threads = env.get("OMP_NUM_THREADS")
    return threads == base.get("OMP_NUM_THREADS") or (threads or "").isdigit()  # torch's default for none: no


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


def _server(preload: tuple[str, ...], env: dict[str, str]) -> ForkServer:
    """This process's server for ``preload``, started in ``env`` at the first call (stopped at this process's exit)."""
    server = _SERVERS.get(preload)
    if server is None or server.process.poll() is not None:
        server = _SERVERS[preload] = ForkServer(preload, env)
        atexit.register(server.close)
    return server


def _run_forked(
    target: str, args: list[str], cwd: Path, env: dict[str, str], timeout: float, preload: tuple[str, ...], script: bool
) -> Completed:
    server = _server(preload, env)
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
    for module, why in _READ_AS_THEY_LOAD.items():  # free only while no server has loaded what reads them
        if module in sys.modules:
            sys.exit(f"the fork server imported {module} with {preload}: {why}")
    if threading.active_count() != 1:  # native pools (numpy's OpenBLAS) handle a fork themselves
        sys.exit(f"the fork server runs {threading.active_count()} Python threads after importing {preload}")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path + ".new")
    listener.listen()
    os.rename(path + ".new", path)  # the client waits for the name: it appears once the server listens
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    return _listen(listener, _GETPPID())


def _listen(listener: socket.socket, parent: int) -> tuple[dict[str, Any], list[int]] | None:
    """Fork a child per request on ``listener``, several at once, and send each its child's id, then its exit
    status; in a child, its request and the files it was sent; ``None`` once ``parent`` has ended."""
    wake, woken = os.pipe()  # SIGCHLD writes here: a child ended
    os.set_blocking(woken, False)
    signal.set_wakeup_fd(woken)
    signal.signal(signal.SIGCHLD, lambda *_: None)
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
        if _GETPPID() != parent:  # the test process (for a command's own server: the command) is gone
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


# in the processes a server forks: the socket of the server that forks the Pythons they start (the top server's, then
# each command's own), the top server's environment once it imported its preload, the command's
_SERVER: str | None = None
_PRELOADED_ENV: dict[str, str] = {}
_COMMAND_ENV: dict[str, str] = {}
# what a launcher sets in a rank's environment (no library reads these at import time), and two a forked child sets
# as a new Python would have read them (:func:`_as_a_new_python_reads`)
_FREE = (
    *JOB_VARIABLES, "PL_GLOBAL_SEED", "PL_SEED_WORKERS", "OMP_NUM_THREADS", "PYTHONPATH",
    "TORCHFT_LIGHTHOUSE", "REPLICA_GROUP_ID",  # torchft's, for a replica: read when its manager is made
    # torch elastic's, for a worker of torchrun or `accelerate launch`: read when its job starts
    "ROLE_RANK", "ROLE_NAME", "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "TORCHELASTIC_*",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING",
    "ACCELERATE_*", "FSDP_*", "MEGATRON_LM_*",  # `accelerate launch`'s, for its workers (no server loads accelerate)
)  # fmt: skip


_POPEN = subprocess.Popen
_GETPPID = os.getppid  # the real one: a forked child's is its starter's (:func:`_enter`)
_EXECUTE_CHILD = inspect.signature(subprocess.Popen._execute_child)
# Popen's ways of starting a child that a fork cannot honour (a fork server's child is the server's, not ours)
_UNSERVED = {"preexec_fn": None, "pass_fds": (), "shell": False, "gid": None, "gids": None, "uid": None, "umask": -1}


class _ForkingPopen(subprocess.Popen):
    """``subprocess.Popen`` whose Python starts a fork server makes where it may (see :func:`_served_request`), with
    the files Popen made for it (its pipes, a log, ``DEVNULL``) sent over the socket; every other command starts as
    ``Popen`` starts it. A forked child is the server's: its exit status comes over the connection, which ``poll``,
    ``wait``, ``communicate`` and ``send_signal`` read as Popen reads ``waitpid``'s.

    Args:
        route: the server's socket, the environment of the command (or worker) it serves and what its imports set;
            ``None``: this forked command's own server (:func:`_own_server`).
        free: more variables the command reads only once it runs.
    """

    def __init__(
        self,
        *args: Any,
        route: tuple[str, dict[str, str], dict[str, str]] | None = None,
        free: tuple[str, ...] = (),
        **kwargs: Any,
    ) -> None:
        self._route = route or (_SERVER, _COMMAND_ENV, _PRELOADED_ENV)
        self._free = free
        self._connection: socket.socket | None = None
        self._buffer = b""
        super().__init__(*args, **kwargs)

    def _execute_child(self, *args: Any, **kwargs: Any) -> None:
        bound = _EXECUTE_CHILD.bind(self, *args, **kwargs).arguments
        request = _served_request(bound, *self._route[1:], self._free)
        if request is None or self._route[0] is None:
            return super()._execute_child(*args, **kwargs)
        p2cread, c2pwrite, errwrite = bound["p2cread"], bound["c2pwrite"], bound["errwrite"]
        files = [p2cread if p2cread != -1 else 0, c2pwrite if c2pwrite != -1 else 1, errwrite if errwrite != -1 else 2]
        connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        connection.connect(self._route[0])
        socket.send_fds(connection, [(json.dumps(request) + "\n").encode()], files)
        self._connection = connection
        self.pid = int(self._line(None) or -1)
        self._child_created = True
        names = ("p2cread", "p2cwrite", "c2pread", "c2pwrite", "errread", "errwrite")
        self._close_pipe_fds(*(bound[name] for name in names))  # the child's ends, as Popen closes them after a fork
        return None

    def _line(self, timeout: float | None) -> str | None:
        """The server's next line; ``None`` if none came within ``timeout`` (0: none waiting now)."""
        assert self._connection is not None
        self._connection.settimeout(timeout)
        while b"\n" not in self._buffer:
            try:
                more = self._connection.recv(64)
            except (TimeoutError, BlockingIOError):
                return None
            if not more:
                raise RuntimeError(f"the fork server ended before {self.args} did")
            self._buffer += more
        line, self._buffer = self._buffer.split(b"\n", 1)
        return line.decode()

    def _ended(self, line: str | None) -> int | None:
        if line is not None:
            self.returncode = int(line)
            assert self._connection is not None
            self._connection.close()
        return self.returncode

    def _internal_poll(self, *args: Any, **kwargs: Any) -> int | None:
        if self._connection is None:
            return super()._internal_poll(*args, **kwargs)
        return self.returncode if self.returncode is not None else self._ended(self._line(0))

    def _wait(self, timeout: float | None) -> int:
        if self._connection is None:
            return super()._wait(timeout)
        if self.returncode is None and self._ended(self._line(timeout)) is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0)
        assert self.returncode is not None
        return self.returncode


def _served_request(
    bound: dict[str, Any], base: dict[str, str], preloaded: dict[str, str], free: tuple[str, ...] = ()
) -> dict[str, Any] | None:
    """The server's request for a Popen start (``bound``: ``_execute_child``'s arguments) that it may fork: ``python
    -m MODULE ARGS``, ``python SCRIPT ARGS``, ``python -c CODE ARGS`` (each with ``-u`` where the environment asks for
    unbuffered output anyway) or a console script of this interpreter, in an environment that differs from ``base``
    only as :func:`_may_fork` allows, started by none of the means a fork cannot honour (:data:`_UNSERVED`); else
    ``None``."""
    args = bound["args"]
    if not isinstance(args, (list, tuple)) or len(args) < 2 or not all(isinstance(word, str) for word in args):
        return None
    if any(bound.get(name, default) != default for name, default in _UNSERVED.items()):
        return None
    if bound.get("process_group") not in (None, -1):
        return None
    env = dict(os.environ if bound["env"] is None else bound["env"])
    if not _may_fork(env, base, preloaded, free):
        return None
    cwd = os.fspath(bound["cwd"] or os.getcwd())
    words = list(args)
    if words[0] != sys.executable:  # a console script of this interpreter, which the kernel runs as `python SCRIPT`
        script = console_script(words[0], env, cwd)
        if script is None or bound["executable"] not in (None, words[0]):
            return None
        words = [sys.executable, script, *words[1:]]
    elif bound["executable"] not in (None, sys.executable):
        return None
    options = words[1:]
    if options[:1] == ["-u"] and env.get("PYTHONUNBUFFERED"):  # the environment asks for unbuffered output anyway
        options = options[1:]
    if len(options) > 1 and options[0] in ("-m", "-c"):
        target, args = {"module" if options[0] == "-m" else "code": options[1]}, options[2:]
    elif options and not options[0].startswith("-") and os.path.isfile(os.path.join(cwd, options[0])):
        target, args = {"script": options[0]}, options[1:]
    else:
        return None
    where = {"cwd": cwd, "env": env, "session": bool(bound["start_new_session"]), "parent": os.getpid()}
    return {**target, "args": args, **where}


def console_script(program: str, env: dict[str, str], cwd: str) -> str | None:
    """The path the kernel hands this interpreter for ``program`` where ``program`` is a script of its (a console
    script such as ``torchrun``: its first line ``#!`` and this interpreter), else ``None``."""
    path = program if os.sep in program else shutil.which(program, path=env.get("PATH", os.defpath))
    if path is None or not os.path.isfile(os.path.join(cwd, path)):
        return None
    with open(os.path.join(cwd, path), "rb") as script:
        return path if script.readline().rstrip(b"\n") == f"#!{sys.executable}".encode() else None


def popen(args: list[str], preload: tuple[str, ...], free: tuple[str, ...] = (), **kwargs: Any) -> subprocess.Popen:
    """``subprocess.Popen(args, **kwargs)``, the command forked by this process's server for ``preload`` (started at
    the first call) where it may be (:func:`_served_request`; ``free``: more variables the command reads only once it
    runs, which may differ from the server's)."""
    return _server(preload, job_environment()).popen(args, free, **kwargs)  # the server: whoever starts it first


@contextlib.contextmanager
def serving(preload: tuple[str, ...], free: tuple[str, ...] = ()) -> Iterator[None]:
    """Within it, this process's ``subprocess.Popen`` is :func:`popen`'s, for ``preload`` and ``free``: for code that
    starts its Pythons itself (``lightning_dynamix.bench.cluster``'s torch elastic agents and rendezvous store)."""
    server = _server(preload, job_environment())
    route = (server.path, server.env, server.preloaded_env)

    class _Routed(_ForkingPopen):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, route=route, free=free, **kwargs)

    original, subprocess.Popen = subprocess.Popen, _Routed  # type: ignore[misc]
    try:
        yield
    finally:
        subprocess.Popen = original  # type: ignore[misc]


_new_entries: list[str] = []


def _as_a_new_python_reads(before: dict[str, str]) -> None:
    """What a new Python would have read from this environment at its start and this process read from ``before``:
    torch's threads from ``OMP_NUM_THREADS`` (where the server imported torch; one that did not reads it at the import)
    and the entries ``PYTHONPATH`` adds (put on ``sys.path`` by :func:`_run`)."""
    global _new_entries
    threads = os.environ.get("OMP_NUM_THREADS")
    if threads != before.get("OMP_NUM_THREADS") and threads and "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(int(threads))
    known = set(_PRELOADED_ENV.get("PYTHONPATH", "").split(os.pathsep))  # on the server's sys.path, a command's too
    entries = [e for e in os.environ.get("PYTHONPATH", "").split(os.pathsep) if e and e not in known]
    _new_entries = [os.path.abspath(e) for e in entries]


def _run(request: dict[str, Any], fds: list[int]) -> None:
    """In the forked child: become the command (``python -m MODULE ARGS``, ``python SCRIPT ARGS`` or ``python -c CODE
    ARGS``) in the request's directory, environment and files (the ``outputs`` it names, or the files it was sent),
    with a server of its own (:func:`_own_server`) for the Pythons it starts."""
    while True:
        _enter(request, fds)
        served = _own_server()
        if served is None:
            break
        request, fds = served  # in a child of the command's server: a Python the command started
    _execute(request)


def _enter(request: dict[str, Any], fds: list[int]) -> None:
    """The request's parent, session, directory, environment and files."""
    global _COMMAND_ENV
    starter, server = request["parent"], _GETPPID()

    def getppid() -> int:  # the starter while the server that forked this child lives (it dies with the starter,
        # or, for the tests' own server, soon after the test process); then, re-parented, the real one
        parent = _GETPPID()
        return starter if parent == server else parent

    os.getppid = getppid  # code that watches its parent (a busy co-tenant, a server's --parent-pid) sees its starter
    if request.get("session"):
        os.setsid()
    os.chdir(request["cwd"])
    before = dict(os.environ)
    os.environ.clear()
    os.environ.update(request["env"])
    _COMMAND_ENV = dict(request["env"])
    _as_a_new_python_reads(before)
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


_PR_SET_PDEATHSIG = 1  # prctl(2): the signal a process gets when the thread that forked it ends


def _own_server() -> tuple[dict[str, Any], list[int]] | None:
    """Fork the command, before it runs (one thread, nothing of its own yet), into the server of the Pythons it
    starts: they are then its descendants, as a new Python's children are, so a walk of its process tree finds them
    (``lightning_dynamix.bench.cluster`` preempts a torch elastic node so) and a killed tree dies whole. The server
    ignores the signals a command's group or tree gets (its children report their ends to the command to the last)
    and dies with the command. In the command: ``None``; in a child the server forked: its request and files."""
    global _SERVER
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(f"\0forkserver-{os.getpid()}-{os.urandom(6).hex()}")  # an abstract name: no file to remove
    listener.listen()
    command = os.getpid()
    handlers = {number: signal.getsignal(number) for number in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    sys.stdout.flush()
    sys.stderr.flush()
    if os.fork() != 0:
        _SERVER = listener.getsockname()
        listener.close()
        return None
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if _GETPPID() != command:  # it ended before the line above
        os._exit(0)
    for number in handlers:
        signal.signal(number, signal.SIG_IGN)
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):  # nothing holds the command's pipes open after it
        os.dup2(null, fd)
    os.close(null)
    served = _listen(listener, command)
    if served is None:
        os._exit(0)
    for number, handler in handlers.items():
        signal.signal(number, handler)
    return served


def _execute(request: dict[str, Any]) -> None:
    """Run the command as a new Python would, its ``subprocess.Popen`` starts served (:class:`_ForkingPopen`)."""
    subprocess.Popen = _ForkingPopen  # type: ignore[misc]
    for module in list(sys.modules.values()):  # those that took the name (torch elastic's workers' handler does)
        if getattr(module, "__dict__", {}).get("Popen") is _POPEN:
            module.Popen = _ForkingPopen
    sys.path[1:1] = _new_entries  # PYTHONPATH's new entries, after the first as a new Python puts them
    if "script" in request:
        script = request["script"]
        sys.path[0] = os.path.dirname(os.path.abspath(script))  # as `python SCRIPT` puts the script's directory first
        sys.argv = [script, *request["args"]]
        runpy.run_path(script, run_name="__main__")
    elif "code" in request:
        sys.path[0] = ""  # as `python -c` puts the working directory first
        sys.argv = ["-c", *request["args"]]
        main = types.ModuleType("__main__")
        main.__dict__["__builtins__"] = builtins
        sys.modules["__main__"] = main
        exec(compile(request["code"], "<string>", "exec"), main.__dict__)
    else:
        sys.path[0] = os.getcwd()  # as `python -m` puts the working directory first
        sys.argv = ["-m", *request["args"]]  # run_module sets argv[0] to the module's file
        runpy.run_module(request["module"], run_name="__main__", alter_sys=True)


def _exit_as_python(run: Callable[[], None]) -> NoReturn:
    """``run()`` (the command), then its end as a new Python's: an uncaught exception to ``sys.excepthook`` and
    status 1, a ``SystemExit``'s status or message, a ``KeyboardInterrupt`` an end by SIGINT; then non-daemon threads
    joined, the ``atexit`` handlers run and the output flushed, as Python's finalization begins. The rest of it (every
    module's objects freed) is skipped: in a forked child, freeing what it shares with the server writes to every page
    of it, about 1 s of a core a process with torch loaded, which multiprocessing's forked children skip too (a file
    the command leaves open without a close is not flushed for it, where a new Python's end would)."""
    code: int = 0
    interrupted = False
    try:
        run()
    except SystemExit as exit_:
        if exit_.code is None or isinstance(exit_.code, int):
            code = exit_.code or 0
        else:  # a message, as Python prints it
            print(exit_.code, file=sys.stderr)
            code = 1
    except KeyboardInterrupt:
        sys.excepthook(*sys.exc_info())  # as Python reports it (torch.distributed's hook prefixes each line's rank)
        interrupted = True
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 1
    threading._shutdown()  # type: ignore[attr-defined]  # as finalization joins non-daemon threads first
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    if interrupted:  # as Python ends on an uncaught KeyboardInterrupt: by the signal, for its parent to see
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(code)


if __name__ == "__main__":
    _request = _serve(sys.argv[1], sys.argv[2:])
    if _request is not None:
        _exit_as_python(lambda: _run(*_request))
