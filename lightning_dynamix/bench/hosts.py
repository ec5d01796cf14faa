"""Hosts on one machine: each in a network namespace of its own, with its own address and a link of its own rate.

Processes that share the loopback interface share one link with no rate: every figure taken that way
hides what a node on a slower link does to each all-reduce. :class:`Hosts` gives each host (a rank, a
torchrun agent, an embedding server) a network namespace with one interface, ``eth0``, at an address of
198.18.0.0/24 (RFC 2544's range for network benchmarks), joined by a veth pair to a bridge in a switch
namespace of its own. Each host's link gets its rate with ``tc``: a token bucket (``tbf``) on both ends,
so the rate holds in both directions. A link gets a rate, not a delay (``netem``, which adds delays, is a
kernel module that many machines lack).

Nothing leaves the machine: the addresses live only on links inside the namespaces made here, and
traffic between hosts crosses the bridge, never 127.0.0.1. On exit, also after Ctrl-C or when the
process that made them is killed, the namespaces go, with every process inside: a reaper process of its
own session waits for its maker's end (the pipe it reads closes) and removes what is left.

Needs root (``CAP_SYS_ADMIN`` and ``CAP_NET_ADMIN``), ``ip``/``tc`` (iproute2) and ``nsenter``
(util-linux); :func:`check_hosts` says what is missing.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

SUBNET = "198.18.0"  # /24 of 198.18.0.0/15, reserved for network benchmarks
INTERFACE = "eth0"
_counter = itertools.count()

REAPER = """
import subprocess, sys
names = sys.argv[1:]
sys.stdin.read()  # returns when every writer has closed the pipe: the maker closed it, or ended
for name in names:
    pids = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True).stdout.split()
    for pid in pids:
        subprocess.run(["kill", "-9", pid], capture_output=True)
    subprocess.run(["ip", "netns", "delete", name], capture_output=True)
"""


class HostsUnavailable(RuntimeError):
    """Network namespaces or tc cannot be used here; the message says what is missing."""


def _run(*command: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(command), capture_output=True, text=True)


def check_hosts() -> None:
    """Raise :class:`HostsUnavailable` naming what is missing for :class:`Hosts` (root, ip, tc, namespaces, tbf)."""
    if os.name != "posix" or not sys.platform.startswith("linux"):
        raise HostsUnavailable(f"hosts in network namespaces need Linux, this is {sys.platform}")
    if os.geteuid() != 0:
        raise HostsUnavailable(
            "hosts in network namespaces need root (CAP_SYS_ADMIN and CAP_NET_ADMIN to make namespaces, veth links"
            f" and tc qdiscs); this process runs as uid {os.geteuid()}"
        )
    for tool, package in (("ip", "iproute2"), ("tc", "iproute2"), ("nsenter", "util-linux")):
        if shutil.which(tool) is None:
            raise HostsUnavailable(f"hosts in network namespaces need `{tool}` ({package}), not found on PATH")
    name = f"dxprobe{os.getpid()}"
    made = _run("ip", "netns", "add", name)
    if made.returncode != 0:
        raise HostsUnavailable(f"`ip netns add` failed: {made.stderr.strip()}")
    try:
        steps = [
            ("ip", "-n", name, "link", "add", "p0", "type", "veth", "peer", "name", "p1"),
            ("tc", "-n", name, "qdisc", "add", "dev", "p0", "root", "tbf", "rate", "1mbit", "burst", "32kb",
             "latency", "50ms"),
        ]  # fmt: skip
        for step in steps:
            result = _run(*step)
            if result.returncode != 0:
                raise HostsUnavailable(f"`{' '.join(step[:4])} ...` failed: {result.stderr.strip()}")
    finally:
        _run("ip", "netns", "delete", name)


def _rate(name: str, value: object) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"`{name}` must be a rate in Mbit/s > 0 (or None: no limit), got {value!r}")
    return float(value)


def parse_links(text: str, hosts: int | None = None) -> list[float | None]:
    """``--links`` as rates in Mbit/s, one a host (``0`` or ``-``: no limit), e.g. ``"1000,1000,50"``.

    Raises:
        ValueError: naming the value, for a rate that is not a positive number, or a count other than ``hosts``.
    """
    rates: list[float | None] = []
    for part in str(text).split(","):
        part = part.strip()
        if part in ("0", "-"):
            rates.append(None)
            continue
        try:
            rates.append(_rate("--links", float(part)))
        except ValueError:
            raise ValueError(
                f"`--links` must list one rate a host in Mbit/s (> 0; 0 or - for no limit), got {part!r} in {text!r}"
            ) from None
    if hosts is not None and len(rates) != hosts:
        raise ValueError(f"`--links` {text!r} gives {len(rates)} hosts a rate, but the job has {hosts}: give one each")
    return rates


def describe_links(rates: Sequence[float | None]) -> str:
    """``hosts on links of -,-,50 Mbit/s``: the hosts' link rates for a bench's header (``-``: no limit)."""
    return "hosts on links of " + ",".join("-" if rate is None else f"{rate:g}" for rate in rates) + " Mbit/s"


MIN_BURST = 4096  # bytes: the token bucket holds at least two packets of one MTU
_SEGMENT = 1500  # bytes: the largest packet the kernel hands a link (its MTU; no larger GSO segments)


class Hosts:
    """Hosts in network namespaces of their own, joined through a bridge, each link at its own rate.

    Args:
        rates: each host's link rate in Mbit/s, both directions (``None``: no limit); one host a rate.
        burst_ms: the token bucket's depth, in milliseconds at the link's rate (at least :data:`MIN_BURST`).

    A link passes no more than its rate, as a real one: the kernel hands each link packets of one MTU (no
    segments of 64 KiB, which a token bucket must hold at once), and the bucket holds 1 ms at the rate by
    default. A deeper bucket lets a link that idled send that much at once: at 30 Mbit/s a bucket of 64 KiB
    made a burst of 140 KB every 50 ms take 22 ms instead of 37.

    Use it as a context manager; :meth:`popen` starts a process on a host. Host ``i`` is at
    :meth:`address` ``(i)``; processes reach each other there (gloo: ``GLOO_SOCKET_IFNAME=eth0``, which
    :meth:`env` sets, with ``MASTER_ADDR`` at host 0).

    Raises:
        ValueError: for no hosts, more than 250, or a rate that is not a positive number.
        HostsUnavailable: on entering, where namespaces or tc cannot be used (see :func:`check_hosts`).
    """

    def __init__(self, rates: Sequence[float | None], burst_ms: float = 1.0) -> None:
        rates = list(rates)
        if not 1 <= len(rates) <= 250:
            raise ValueError(f"`rates` must give 1 to 250 hosts a rate, got {len(rates)}")
        self.rates = [_rate(f"rates[{i}]", rate) for i, rate in enumerate(rates)]
        if isinstance(burst_ms, bool) or not isinstance(burst_ms, int | float) or not burst_ms > 0:
            raise ValueError(f"`burst_ms` must be a number of milliseconds > 0, got {burst_ms!r}")
        self.burst_ms = float(burst_ms)
        self.prefix = f"dx{os.getpid()}n{next(_counter)}"
        self.switch = f"{self.prefix}sw"
        self.namespaces = [f"{self.prefix}h{i}" for i in range(len(self.rates))]
        self.processes: list[subprocess.Popen[Any]] = []
        self._reaper: subprocess.Popen[str] | None = None

    # ------------------------------------------------------------------ life
    def __enter__(self) -> Hosts:
        check_hosts()
        # the reaper first: whatever is made from here on goes, however this process ends
        self._reaper = subprocess.Popen(
            [sys.executable, "-c", REAPER, *self.namespaces, self.switch],
            stdin=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        try:
            self._make()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _make(self) -> None:
        sw = self.switch
        self._ip("netns", "add", sw)
        self._ip("-n", sw, "link", "add", "br0", "type", "bridge")
        self._ip("-n", sw, "link", "set", "br0", "up")
        for i, ns in enumerate(self.namespaces):
            self._ip("netns", "add", ns)
            # the pair is made in the host's namespace, its far end moved to the switch: no name in the root one
            self._ip("-n", ns, "link", "add", INTERFACE, "type", "veth", "peer", "name", f"p{i}", "netns", sw)
            self._ip("-n", ns, "addr", "add", f"{self.address(i)}/24", "dev", INTERFACE)
            self._ip("-n", ns, "link", "set", "lo", "up")
            self._ip("-n", ns, "link", "set", INTERFACE, "up")
            self._ip("-n", sw, "link", "set", f"p{i}", "master", "br0")
            self._ip("-n", sw, "link", "set", f"p{i}", "up")
            # packets of one MTU, both ways: a segment of 64 KiB would pass the token bucket at once
            self._ip("-n", ns, "link", "set", "dev", INTERFACE, "gso_max_size", str(_SEGMENT))
            self._ip("-n", sw, "link", "set", "dev", f"p{i}", "gso_max_size", str(_SEGMENT))
            self.set_rate(i, self.rates[i])

    def close(self) -> None:
        """Stop every process on the hosts and remove the namespaces (safe to call more than once)."""
        for process in self.processes:
            if process.poll() is None:
                process.kill()
            process.wait()
        if self._reaper is not None:
            assert self._reaper.stdin is not None
            self._reaper.stdin.close()  # the reaper kills what is left inside and deletes the namespaces
            self._reaper.wait()
            self._reaper = None

    # ------------------------------------------------------------------ use
    def address(self, host: int) -> str:
        """Host ``host``'s address on its link."""
        return f"{SUBNET}.{host + 1}"

    def env(self, host: int, master_host: int = 0, port: int = 29500) -> dict[str, str]:
        """Variables a process on ``host`` needs to meet the others: the master's address and port, gloo's
        interface."""
        return {
            "MASTER_ADDR": self.address(master_host),
            "MASTER_PORT": str(port),
            "GLOO_SOCKET_IFNAME": INTERFACE,
        }

    def command(self, host: int, command: Sequence[str]) -> list[str]:
        """``command`` as run on ``host``: in its network namespace only (``nsenter --net``; ``ip netns exec``
        would also mount a /sys of its own, hiding the cgroups that ``--contention quota`` writes)."""
        return ["nsenter", f"--net=/run/netns/{self.namespaces[host]}", *[str(part) for part in command]]

    def popen(self, host: int, command: Sequence[str], **kwargs: Any) -> subprocess.Popen[Any]:
        """Start ``command`` on ``host`` (``subprocess.Popen`` arguments in ``kwargs``); stopped by :meth:`close`."""
        process = subprocess.Popen(self.command(host, command), **kwargs)
        self.processes.append(process)
        return process

    def set_rate(self, host: int, rate: float | None) -> None:
        """Host ``host``'s link at ``rate`` Mbit/s both ways from now on (``None``: no limit)."""
        rate = _rate("rate", rate)
        self.rates[host] = rate
        shape_link(self.namespaces[host], self.switch, host, rate, self.burst_ms)

    def description(self) -> str:
        """The hosts' namespaces and burst as JSON: what a process on a host needs to change a link's rate
        (:func:`shape_link`)."""
        return json.dumps({"namespaces": self.namespaces, "switch": self.switch, "burst_ms": self.burst_ms})

    def _ip(self, *args: str) -> None:
        result = _run("ip", *args)
        if result.returncode != 0:
            raise HostsUnavailable(f"`ip {' '.join(args)}` failed: {result.stderr.strip()}")


def shape_link(namespace: str, switch: str, host: int, rate: float | None, burst_ms: float = 1.0) -> None:
    """Host ``host``'s link (``eth0`` in ``namespace``, ``p<host>`` in ``switch``) at ``rate`` Mbit/s both ways,
    ``None``: no limit. Raises :class:`HostsUnavailable` where ``tc`` refuses."""
    for ns, device in ((namespace, INTERFACE), (switch, f"p{host}")):
        if rate is None:
            _run("tc", "-n", ns, "qdisc", "del", "dev", device, "root")  # none there yet: nothing to remove
            continue
        burst = max(MIN_BURST, int(rate * 1e6 / 8 * burst_ms / 1e3))
        command = ["tc", "-n", ns, "qdisc", "replace", "dev", device, "root", "tbf", "rate", f"{rate}mbit"]
        result = _run(*command, "burst", str(burst), "latency", "100ms")
        if result.returncode != 0:
            raise HostsUnavailable(f"`{' '.join(command)} ...` failed: {result.stderr.strip()}")


SERVER_PORT = 29600  # where an offload job's trainer on host 0 and its servers meet (every host has its own ports)


def run_offload_job(
    hosts: Hosts, trainer: Sequence[str], servers: int, staleness: int, log: Any, timeout_s: float = 120.0
) -> int | str:
    """Run an offload job across hosts: ``trainer`` (one process, its strategy told ``launch_servers=False`` and
    :data:`SERVER_PORT`) on host 0, and ``servers`` embedding servers on hosts ``1..servers``, started as a
    cluster starts them (``python -m lightning_dynamix.serve``), meeting at host 0's address. Every lookup and
    update crosses the links. Their output goes to ``log`` (an open file).

    Returns:
        The trainer's exit status, or what went wrong where it exited 0 and a server did not end after it.
    """
    from lightning_dynamix.offload.server_process import server_command

    process = hosts.popen(0, trainer, env={**os.environ, **hosts.env(0)}, stdout=log, stderr=subprocess.STDOUT)
    address = f"{hosts.address(0)}:{SERVER_PORT}"
    started = [
        hosts.popen(
            k + 1,
            server_command(
                "--address", address, "--server-rank", str(k), "--num-servers", str(servers), "--num-trainers", "1",
                "--staleness", str(staleness), "--timeout", f"{timeout_s:g}",
            ),
            env={**os.environ, **hosts.env(k + 1)},
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        for k in range(servers)
    ]  # fmt: skip
    code: int | str = process.wait()
    for server in started:  # a server ends once its trainers have finished
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
            code = code or "a server that did not end"
    return code


def offload_job_result(
    hosts: Hosts, module: str, spec: dict[str, Any], servers: int, staleness: int, bench: str
) -> dict[str, Any]:
    """:func:`run_offload_job` with ``python -m module --job SPEC`` as its trainer: ``spec`` (JSON) gains an
    ``output`` path where the trainer writes its result as JSON, which is returned.

    Raises:
        SystemExit: naming ``bench``, with the end of the job's output, where the job failed.
    """
    with tempfile.TemporaryDirectory() as folder:
        result, log = Path(folder, "result.json"), Path(folder, "job.log")
        trainer = [sys.executable, "-m", module, "--job", json.dumps({**spec, "output": str(result)})]
        with open(log, "w") as out:
            code = run_offload_job(hosts, trainer, servers, staleness, out)
        if code != 0 or not result.exists():
            raise SystemExit(f"{bench}: the job on hosts ended with {code}:\n{log.read_text()[-12000:]}")
        return json.loads(result.read_text())


def leftovers(prefix: str = "dx") -> list[str]:
    """Network namespaces named by :class:`Hosts` (``prefix``) that still exist."""
    listed = _run("ip", "netns", "list").stdout.split("\n")
    return [line.split()[0] for line in listed if line.strip() and line.split()[0].startswith(prefix)]
