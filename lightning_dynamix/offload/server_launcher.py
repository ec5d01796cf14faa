"""Embedding servers forked from a warm process: the launcher a trainer keeps for the servers it starts.

A server started as a new Python spends most of its start importing torch. A trainer asks one launcher instead
(:func:`launch`): a process started once per trainer process, in a server's environment (no Lightning, no
CUDA device, one intra-op thread), that has imported what a server runs and forks each server from itself
(:func:`serve_requests`). A forked server runs ``python -m lightning_dynamix.serve`` with the arguments it was
given, in the trainer's working directory and environment of the moment it was asked for, and writes to the
trainer's stdout and stderr of that moment. It exits when the launcher does, which exits when the trainer's
end of their socket closes (the trainer ended, or died). The launcher runs one thread and never uses CUDA, so
forking it is safe.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import runpy
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback

from lightning_dynamix.offload.server_process import bootstrap

_MESSAGE_BYTES = 1 << 16
_GONE_POLL_S = 0.05


class _LauncherGone(RuntimeError):
    """The launcher ended before it answered."""


class LaunchedServer:
    """A server the launcher forked, with the methods of :class:`subprocess.Popen` a trainer uses.

    Attributes:
        pid: the server's process id.
        returncode: its exit status once known (``-N`` for signal ``N``, as Popen's), else ``None``; 1 where the
            launcher ended before it could say (the server ends then too).
    """

    def __init__(self, launcher: ServerLauncher, pid: int) -> None:
        self._launcher = launcher
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        """The exit status if the server has ended, else ``None``."""
        if self.returncode is None:
            self.returncode = self._launcher.status(self.pid, timeout=0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """Wait for the server to end; its exit status.

        Raises:
            subprocess.TimeoutExpired: it did not end within ``timeout`` seconds.
        """
        if self.returncode is None:
            self.returncode = self._launcher.status(self.pid, timeout)
        if self.returncode is None:
            raise subprocess.TimeoutExpired(f"embedding server (pid {self.pid})", timeout or 0.0)
        return self.returncode

    def send_signal(self, number: int) -> None:
        """Send signal ``number``, unless it has ended."""
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, number)

    def terminate(self) -> None:
        """Send SIGTERM, unless it has ended."""
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        """Send SIGKILL, unless it has ended."""
        self.send_signal(signal.SIGKILL)


class ServerLauncher:
    """The launcher process of this trainer process and the trainer's end of their socket."""

    def __init__(self, env: dict[str, str]) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        with theirs:
            self._process = subprocess.Popen(
                [sys.executable, "-c", bootstrap("lightning_dynamix.offload.server_launcher"), str(theirs.fileno())],
                env=env,
                pass_fds=(theirs.fileno(),),
                stdin=subprocess.DEVNULL,
            )
        self._socket = ours
        self._lock = threading.Lock()
        self._ended: dict[int, int] = {}  # exit statuses the launcher reported, by pid
        self._gone = False  # the launcher ended: no more statuses will come

    @property
    def alive(self) -> bool:
        """Whether the launcher still runs."""
        return not self._gone and self._process.poll() is None

    def start(self, args: list[str], env: dict[str, str]) -> LaunchedServer:
        """Fork a server running ``python -m lightning_dynamix.serve ARGS`` in ``env`` and this process's
        working directory, writing to this process's stdout and stderr.

        Raises:
            RuntimeError: the launcher did not answer (it ended).
            ValueError: the arguments and environment exceed one message (64 KiB).
        """
        request = json.dumps({"args": args, "env": env, "cwd": os.getcwd()}).encode()
        if len(request) > _MESSAGE_BYTES:
            raise ValueError(f"a server's arguments and environment take {len(request)} bytes, over {_MESSAGE_BYTES}")
        for stream in (sys.stdout, sys.stderr):  # what this process wrote comes before what the server writes
            with contextlib.suppress(Exception):
                stream.flush()
        with self._lock:
            try:
                socket.send_fds(self._socket, [request], [1, 2])  # where a new process would write
            except OSError as error:
                raise _LauncherGone(f"the embedding servers' launcher (pid {self._process.pid}) is gone") from error
            while True:
                message = self._receive(timeout=None)
                if message is None:
                    raise _LauncherGone(f"the embedding servers' launcher (pid {self._process.pid}) ended")
                if "started" in message:
                    return LaunchedServer(self, message["started"])

    def status(self, pid: int, timeout: float | None) -> int | None:
        """The exit status of server ``pid`` once it ends within ``timeout`` seconds (``None``: no limit),
        else ``None``."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            while pid not in self._ended:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                if self._gone:  # the server ends with its launcher, within its parent check
                    if not _running(pid):
                        self._ended[pid] = 1
                    elif left == 0.0:
                        return None
                    else:
                        time.sleep(_GONE_POLL_S if left is None else min(_GONE_POLL_S, left))
                    continue
                if self._receive(timeout=left) is None and not self._gone:
                    return None  # nothing within the timeout
            return self._ended[pid]

    def close(self) -> None:
        """End the launcher (its servers end within their parent check) and reap it."""
        self._socket.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._process.wait(timeout=5)
        if self._process.poll() is None:
            self._process.kill()
            self._process.wait()

    def _receive(self, timeout: float | None) -> dict | None:
        """The launcher's next message within ``timeout`` seconds; exit statuses are kept. ``None`` when none came,
        or the launcher ended (then ``_gone``)."""
        if self._gone:
            return None
        ready, _, _ = select.select([self._socket], [], [], timeout)
        if not ready:
            return None
        try:
            data = self._socket.recv(_MESSAGE_BYTES)
        except OSError:
            data = b""
        if not data:
            self._gone = True
            return None
        message = json.loads(data)
        if "ended" in message:
            self._ended[message["ended"]] = message["status"]
        return message


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


# what a process reads from its environment as it starts (torch's threads and logging, CUDA, Python itself): a
# launcher serves the requests whose environment agrees with its own on these
_READ_AT_START = ("TORCH", "OMP_", "MKL_", "KMP_", "CUDA_", "NCCL_", "GLOO_", "TP_", "PYTHON", "LD_")

_launchers: dict[tuple[tuple[str, str], ...], ServerLauncher] = {}
_launchers_lock = threading.Lock()


def launch(args: list[str], env: dict[str, str]) -> LaunchedServer:
    """Start a server as ``python -m lightning_dynamix.serve ARGS`` would, in ``env``, forked by this process's
    launcher for that environment (started the first time, and again where it ended).

    Raises:
        RuntimeError: a new launcher did not answer either.
    """
    key = tuple(sorted((k, v) for k, v in env.items() if k.startswith(_READ_AT_START)))
    with _launchers_lock:
        if not _launchers:
            atexit.register(_close_launchers)
        launcher = _launchers.get(key)
        if launcher is None or not launcher.alive:
            launcher = _launchers[key] = ServerLauncher(env)
        try:
            return launcher.start(args, env)
        except _LauncherGone:  # it ended since the last server: once more, with a new one
            launcher.close()
            launcher = _launchers[key] = ServerLauncher(env)
            return launcher.start(args, env)


def _close_launchers() -> None:
    for launcher in _launchers.values():
        launcher.close()


# the launcher process ---------------------------------------------------------------------------------------


def serve_requests(fd: int) -> None:
    """The launcher: fork a server for each request on the socket ``fd`` and report each one's pid and exit
    status, until the trainer's end of the socket closes."""
    control = socket.socket(fileno=fd)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C is for the trainer and the servers
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_write, False)
    signal.set_wakeup_fd(wake_write)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # wakes the select below through the pipe
    running: set[int] = set()
    while True:
        ready, _, _ = select.select([control, wake_read], [], [])
        if wake_read in ready:
            os.read(wake_read, 4096)
        while running:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            running.discard(pid)
            _send(control, {"ended": pid, "status": os.waitstatus_to_exitcode(status)})
        if control not in ready:
            continue
        try:
            message, fds, _, _ = socket.recv_fds(control, _MESSAGE_BYTES, 2)
        except OSError:
            message, fds = b"", []
        if not message:
            return  # the trainer's end closed: the servers see their parent go, and end
        request = json.loads(message)
        pid = os.fork()
        if pid == 0:
            os.close(wake_read)
            os.close(wake_write)
            _run_server(control, fds, request)
        for received in fds:
            os.close(received)
        running.add(pid)
        _send(control, {"started": pid})


def _send(control: socket.socket, message: dict) -> None:
    with contextlib.suppress(OSError):  # the trainer is gone: the loop ends at its socket's end
        control.send(json.dumps(message).encode())


def _run_server(control: socket.socket, fds: list[int], request: dict) -> None:
    """In a forked child: become the server the request describes; never returns."""
    code = 1
    try:
        control.close()
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for target, received in zip((1, 2), fds, strict=True):
            os.dup2(received, target)
            os.close(received)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        sys.argv = ["-m", *request["args"], "--parent-pid", str(os.getppid())]
        runpy.run_module("lightning_dynamix.serve", run_name="__main__", alter_sys=True)  # as `python -m` does
        code = 0
    except SystemExit as exit_:
        if exit_.code is None or isinstance(exit_.code, int):
            code = exit_.code or 0
        else:  # a message, as Python prints it
            print(exit_.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code)


if __name__ == "__main__":
    serve_requests(int(sys.argv[1]))
