"""torch elastic on one machine: torchrun agents as nodes that can be preempted and added, on 127.0.0.1 or each
on a host of its own (:class:`~lightning_dynamix.bench.hosts.Hosts`); and the environments every bench gives the
processes it launches (:func:`node_environment`).

``dynamix bench elastic`` and the elastic tests run their jobs on it.
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil

from lightning_dynamix._checks import require_int
from lightning_dynamix.distributed import job_environment

if TYPE_CHECKING:
    from lightning_dynamix.bench.hosts import Hosts

STORE = """
import sys, time
from datetime import timedelta
import torch.distributed as dist
store = dist.TCPStore("127.0.0.1", 0, is_master=True, multi_tenant=True, wait_for_workers=False,
                      timeout=timedelta(seconds=60))
print(store.port, flush=True)
while True:
    time.sleep(3600)
"""

# a torchrun agent that has imported torch before it waits for the go (see LocalElasticCluster.add_nodes)
AGENT = """
import sys, time
from pathlib import Path
import torch.distributed.run as run
ready, go = Path(sys.argv[1]), Path(sys.argv[2])
ready.touch()
while not go.exists():
    time.sleep(0.01)
run.main(sys.argv[3:])
"""


def node_environment(rank: int, world: int, **extra: str) -> dict[str, str]:
    """:func:`job_environment` for rank ``rank`` of ``world`` launched as a node of one process (Lightning's
    ``num_nodes=world, devices=1``); ``extra`` adds the master's address and port and anything else."""
    return job_environment(NODE_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK="0", **extra)


class LocalElasticCluster:
    """A rendezvous store that no node owns, and torchrun agents (one worker each) started and preempted at will.

    Torch elastic re-forms the group whenever a node leaves or joins; this is the set-up it needs to
    do so on one machine (see docs/elastic.md): the c10d rendezvous on a store that outlives every
    agent (``is_host=false``), each rendezvous handing its workers a fresh store
    (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``) and short rendezvous timeouts.

    Args:
        command: what each agent runs: a script and its arguments, or ``["-m", module, ...]``.
        out: directory of the agents' logs (``<name>.log``).
        nnodes: torchrun's ``--nnodes``, ``MIN:MAX``.
        max_restarts: torchrun's ``--max-restarts``, for every agent.
        env: environment variables for every agent and worker, on top of this process's.
        run_id: the rendezvous id; a finished job closes it, so give each job its own.
        hosts: run every node on a host of its own (in the order nodes are first added, host 0 first) and the
            store on the last host, which no node uses: a rendezvous server on a machine of its own. The agents
            meet at that host's address, each advertises its own (``--local-addr``), and gloo uses the hosts'
            interface. ``None``: everything on 127.0.0.1.
        keep_alive_interval: whole seconds between an agent's heartbeats to the rendezvous.
        keep_alive_max_attempt: heartbeats a node may miss before the others drop it from the rendezvous. Their
            product is how long a node lost without leaving (a SIGTERM or a SIGKILL: torch elastic's agent does not
            leave the rendezvous on a signal) holds the survivors' next rendezvous up. Too short for the machine's
            load, and a node drops live ones: where it drops every node of a running group, it opens a new round
            that the running agents never see (they watch the waiting list), and waits there until its
            ``join_timeout``. 10 by default: what a loaded machine delays a heartbeat by is in docs/elastic.md.

    Raises:
        ValueError: for a node more than ``hosts`` has hosts for (one is kept for the store); at construction,
            for ``keep_alive_interval`` or ``keep_alive_max_attempt`` not an int >= 1.
    """

    def __init__(
        self,
        command: list[str],
        out: Path,
        nnodes: str,
        max_restarts: int = 8,
        env: dict[str, str] | None = None,
        run_id: str = "dynamix",
        hosts: Hosts | None = None,
        keep_alive_interval: int = 1,
        keep_alive_max_attempt: int = 10,
    ) -> None:
        # ints: torch elastic reads both as ints
        self.keep_alive_interval = require_int("keep_alive_interval", keep_alive_interval, 1)
        self.keep_alive_max_attempt = require_int("keep_alive_max_attempt", keep_alive_max_attempt, 1)
        self.command, self.out = [str(a) for a in command], Path(out)
        self.hosts = hosts
        self.host_of: dict[str, int] = {}
        self.nnodes, self.max_restarts, self.run_id = nnodes, max_restarts, run_id
        self.env = job_environment(OMP_NUM_THREADS="1", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", **(env or {}))
        self.nodes: dict[str, subprocess.Popen] = {}
        self.starts: dict[str, int] = {}
        self.retired: list[tuple[Path, subprocess.Popen]] = []  # agents of a name started again
        self.store: subprocess.Popen | None = None
        self.port: int | None = None

    def __enter__(self) -> LocalElasticCluster:
        self.out.mkdir(parents=True, exist_ok=True)
        self.store = self._popen(
            None if self.hosts is None else self._store_host,
            [sys.executable, "-c", STORE],
            stdout=subprocess.PIPE,
            text=True,
            env=self.env,
        )
        assert self.store.stdout is not None
        self.port = int(self.store.stdout.readline())
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def add_node(self, name: str) -> subprocess.Popen:
        """Start an agent (a node) named ``name``, which is also its DYNAMIX_MACHINE_ID.

        It logs to ``<out>/<name>.log``; a name used before (the machine back) logs to ``<name>.<n>.log``, and
        on hosts runs on the host it had.
        """
        return self.add_nodes([name])[0]

    def add_nodes(self, names: list[str], timeout: float = 120.0) -> list[subprocess.Popen]:
        """Start agents named ``names`` (as :meth:`add_node`) that join the rendezvous together: each imports
        torch, then all are let go at once. Started one by one, an agent whose imports took a few seconds longer
        on a loaded machine than the others' would miss the rendezvous's last call and join a group that
        already formed, restarting it at once.

        Raises:
            TimeoutError: an agent did not get through its imports in ``timeout`` seconds.
        """
        gate = self.out / f"go-{len(self.starts)}-{sum(self.starts.values())}"
        agents = [self._start_agent(name, gate) for name in names]
        deadline = time.monotonic() + timeout
        while not all(gate.with_name(f"{gate.name}.{name}").exists() for name in names):
            exited = [name for name, agent in zip(names, agents) if agent.poll() is not None]
            if exited or time.monotonic() > deadline:
                for agent in agents:
                    agent.kill()
                what = f"agents {exited} exited" if exited else f"not every agent imported torch in {timeout} s"
                raise TimeoutError(f"LocalElasticCluster.add_nodes({names}): {what}; see their logs in {self.out}")
            time.sleep(0.05)
        gate.touch()
        return agents

    def _start_agent(self, name: str, gate: Path) -> subprocess.Popen:
        store, local = "127.0.0.1", "127.0.0.1"
        env = dict(self.env, DYNAMIX_MACHINE_ID=name)
        if self.hosts is not None:
            if name not in self.host_of:
                if len(self.host_of) >= self._store_host:
                    raise ValueError(
                        f"node {name!r} has no host: {len(self.hosts.rates)} hosts hold {self._store_host} nodes and"
                        " the store"
                    )
                self.host_of[name] = len(self.host_of)
            store, local = self.hosts.address(self._store_host), self.hosts.address(self.host_of[name])
            env.update(self.hosts.env(self.host_of[name]))
            del env["MASTER_ADDR"], env["MASTER_PORT"]  # the rendezvous tells each worker its master
        command = [
            sys.executable, "-c", AGENT, str(gate.with_name(f"{gate.name}.{name}")), str(gate),
            "--nnodes", self.nnodes, "--nproc-per-node", "1", "--max-restarts", str(self.max_restarts),
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{store}:{self.port}", "--rdzv-id", self.run_id,
            "--rdzv-conf", "is_host=false,last_call_timeout=2,join_timeout=120,"
            f"keep_alive_interval={self.keep_alive_interval},keep_alive_max_attempt={self.keep_alive_max_attempt}",
            "--local-addr", local, "--monitor-interval", "0.5",
            *self.command,
        ]  # fmt: skip
        if name in self.nodes:
            self.retired.append((self.log_path(name), self.nodes[name]))
        self.starts[name] = self.starts.get(name, 0) + 1
        with open(self.log_path(name), "w") as log:
            host = self.host_of.get(name)
            self.nodes[name] = self._popen(host, command, stdout=log, stderr=subprocess.STDOUT, env=env)
        return self.nodes[name]

    def _popen(self, host: int | None, command: list[str], **kwargs: Any) -> subprocess.Popen:
        """``command`` in a session of its own, on ``host`` (``None``: this machine's network). On a host, nsenter
        enters the namespace and becomes the command: the same process, which :meth:`preempt` signals."""
        if host is None:
            return subprocess.Popen(command, start_new_session=True, **kwargs)
        assert self.hosts is not None
        return self.hosts.popen(host, command, start_new_session=True, **kwargs)

    @property
    def _store_host(self) -> int:
        assert self.hosts is not None
        return len(self.hosts.rates) - 1

    def processes(self, name: str) -> list[psutil.Process]:
        """The node's agent and its workers (torch elastic starts each worker in a session of its own)."""
        try:
            agent = psutil.Process(self.nodes[name].pid)
            return [agent, *agent.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def preempt(self, name: str, signal_number: int = signal.SIGTERM) -> None:
        """A spot machine taken back: SIGTERM to every process of the node, as its shutdown sends (SIGKILL: a
        machine lost without notice)."""
        for process in self.processes(name):
            with contextlib.suppress(psutil.NoSuchProcess):
                process.send_signal(signal_number)

    def wait(self, names: list[str], timeout: float) -> dict[str, int | None]:
        """Each node's agent's exit code, waiting up to ``timeout`` seconds in all (None: still running)."""
        deadline = time.monotonic() + timeout
        for name in names:
            try:
                self.nodes[name].wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                break
        return {name: self.nodes[name].poll() for name in names}

    def log_path(self, name: str) -> Path:
        starts = self.starts.get(name, 1)
        return self.out / (f"{name}.log" if starts <= 1 else f"{name}.{starts}.log")

    def log(self, name: str) -> str:
        """The log of the node's latest agent."""
        return self.log_path(name).read_text(errors="replace")

    def close(self) -> None:
        """Kill whatever still runs: agents, their workers, the store."""
        agents = [*self.nodes.values(), *(agent for _, agent in self.retired)]
        for agent in agents:
            try:
                tree = psutil.Process(agent.pid)
                processes = [tree, *tree.children(recursive=True)]
            except psutil.NoSuchProcess:
                processes = []
            for process in processes:  # the agent first: it would restart a killed worker
                with contextlib.suppress(psutil.NoSuchProcess):
                    process.kill()
            agent.wait()
        if self.store is not None:
            self.store.kill()
            self.store.wait()
