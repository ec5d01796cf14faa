"""Per-step fault tolerance on torchft: replicas that fail, leave or join while the others keep training.

Restart-based elasticity (torch elastic, :mod:`lightning_dynamix.elastic`) stops every worker when one
leaves or joins. torchft keeps the survivors running instead: before every step the replicas form a
quorum through a *lighthouse*, the process group is rebuilt over the quorum's members when it changed,
a step in which any member failed is not committed (no optimizer step anywhere), and a replica that
joins receives the model, optimizer and data position from a peer over the network (no file).

How it works, in full: ``docs/internals.md``, section ``lightning_dynamix/distributed/fault_tolerance.py``.
"""

from __future__ import annotations

import hashlib
import math
import os
import socket
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Protocol
from urllib.parse import urlsplit

import torch
from torch.utils.data import default_collate

from lightning_dynamix._checks import require_int, require_number
from lightning_dynamix.control.allocation import split_in_proportion
from lightning_dynamix.data.loader import EmptyBatch
from lightning_dynamix.data.sampler import EpochPermutation
from lightning_dynamix.data.schedule import final_step_sizes
from lightning_dynamix.metrics.clocks import HostClock, TimeSource

DEFAULT_LIGHTHOUSE_PORT = 29510
"""The port torchft's examples give the lighthouse."""

PROBE_SHARE = 0.25
"""A joining replica's request until a decision has measured it: this share of the others' mean request."""

# per participant in a step's all-reduce: its machine key, its request (> 0 a size, 0 an even share, < 0 a
# probe: that share of the others' mean), and its measurements (seconds over steps, steps, the size they
# were measured at)
_SLOT = 5


def machine_key(name: str) -> int:
    """A number for a machine's name, the same in every process: 48 bits of its BLAKE2 hash (exact in a float64)."""
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=6).digest(), "big")


def _torchft() -> Any:
    try:
        import torchft
    except ImportError as error:  # pragma: no cover - the project's set-up installs it
        raise ImportError(
            "per-step fault tolerance needs torchft: pip install 'lightning-dynamix[ft]' (or torchft==0.2.0)"
        ) from error
    return torchft


def lighthouse_host_port(address: str) -> tuple[str, int]:
    """The host and port of a lighthouse address such as ``http://10.0.0.1:29510``.

    Raises:
        ValueError: naming the address, for one without a host or a port.
    """
    parts = urlsplit(address if "://" in address else f"http://{address}")
    try:
        port = parts.port
    except ValueError:
        port = None
    if not parts.hostname or port is None:
        raise ValueError(f"`lighthouse` {address!r} is not an address of the form http://HOST:PORT")
    return parts.hostname, port


def check_lighthouse(address: str, timeout: float = 5.0) -> None:
    """Raise a ``ConnectionError`` naming ``address`` when no lighthouse answers there within ``timeout`` seconds.

    torchft's own client retries a lighthouse that is not there until its connect timeout; this check
    fails at once with what to do.
    """
    host, port = lighthouse_host_port(address)
    try:
        with socket.create_connection((host, port), timeout=timeout):
            pass
    except OSError as error:
        raise ConnectionError(
            f"no torchft lighthouse answers at {address} ({error}); start one with `torchft_lighthouse"
            f" --min_replicas 1 --quorum_tick_ms 100 --join_timeout_ms 1000 --bind {host}:{port}` on {host}"
            " and give its address (`lighthouse=` or the TORCHFT_LIGHTHOUSE environment variable)"
        ) from None


class Lighthouse:
    """torchft's lighthouse (the quorum's coordinator) running in this process, for tests and benches.

    A job's own lighthouse is better started on its own (``torchft_lighthouse ...``, module docstring),
    on a machine that does not fail with a replica.

    torchft logs a line for every quorum at its INFO level: where ``RUST_LOG`` is not set, the lighthouse logs
    warnings and errors only (``RUST_LOG`` is read once per process, as torchft loads: set ``RUST_LOG=info``
    before it is imported to see them).

    Args:
        min_replicas: the fewest replicas a quorum may have.
        host: the address to listen on and to give replicas.
        port: the port; 0 picks a free one.
        join_timeout: seconds to wait for more replicas to join a forming quorum before it is formed
            with those there (at least ``min_replicas``).
        quorum_tick: seconds between the lighthouse's checks of a forming quorum.
        heartbeat_timeout: seconds without a replica's heartbeat after which it is taken for dead.
    """

    def __init__(
        self,
        min_replicas: int = 1,
        host: str = "127.0.0.1",
        port: int = 0,
        join_timeout: float = 1.0,
        quorum_tick: float = 0.05,
        heartbeat_timeout: float = 1.0,
    ) -> None:
        require_int("min_replicas", min_replicas, 1)
        require_int("port", port, 0)
        for name, value in (("join_timeout", join_timeout), ("quorum_tick", quorum_tick)):
            require_number(name, value, 0.0, math.inf, low_open=False, high_open=True)
        require_number("heartbeat_timeout", heartbeat_timeout, 0.0, math.inf, low_open=True, high_open=True)
        os.environ.setdefault("RUST_LOG", "warn")  # read as torchft loads: no line per quorum in a terminal
        _torchft()  # a clear error where the extra is missing
        from torchft.coordination import LighthouseServer

        self.host = host
        self._server = LighthouseServer(
            bind=f"{host}:{port}",
            min_replicas=min_replicas,
            join_timeout_ms=round(join_timeout * 1000),
            quorum_tick_ms=max(1, round(quorum_tick * 1000)),
            heartbeat_timeout_ms=max(1, round(heartbeat_timeout * 1000)),
        )
        self.port = lighthouse_host_port(self._server.address())[1]

    @property
    def address(self) -> str:
        """Where replicas find it: ``http://HOST:PORT``."""
        return f"http://{self.host}:{self.port}"

    def close(self) -> None:
        """Stop it (replicas then fail to form quorums)."""
        self._server.shutdown()

    def __enter__(self) -> Lighthouse:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass(frozen=True)
class StepPlan:
    """What one replica trains at one step, agreed by every participant of the step's quorum.

    Attributes:
        step: committed steps before this one (the job's optimizer steps so far).
        epoch: the epoch whose order the step reads.
        cursor: the epoch's committed position: the step's global batch starts there.
        participant: this replica's rank among the step's participants.
        batch_sizes: every participant's size at this step, in participant order, samples.
        indices: this replica's dataset indices.
    """

    step: int
    epoch: int
    cursor: int
    participant: int
    batch_sizes: tuple[int, ...]
    indices: list[int]

    @property
    def participants(self) -> int:
        """How many replicas take part in the step."""
        return len(self.batch_sizes)

    @property
    def global_batch(self) -> int:
        """The step's global batch, samples."""
        return sum(self.batch_sizes)

    @property
    def batch_size(self) -> int:
        """This replica's size at the step, samples."""
        return self.batch_sizes[self.participant]


def participant_sizes(global_batch: int, requested: Sequence[float], remaining: int) -> tuple[int, ...]:
    """The participants' sizes at a step: ``global_batch`` in proportion to ``requested`` (> 0 each), or
    at the epoch's end (fewer than ``global_batch`` plus one per participant ``remaining``) all that remain.

    A participant beyond what the last samples can give one each gets 0 at that step.
    """
    n = len(requested)
    if remaining < global_batch + n:
        training = min(n, remaining)
        sizes = split_in_proportion(
            min(global_batch, remaining), list(requested[:training]), [1] * training, [None] * training
        )
        return final_step_sizes(sizes, remaining) + (0,) * (n - training)
    return split_in_proportion(global_batch, list(requested), [1] * n, [None] * n)


class Balancer(Protocol):
    """What :class:`FaultTolerantReplica` asks of the controller that decides its sizes
    (:class:`lightning_dynamix.decisions.ReplicaBalancer`)."""

    warmup_steps: int
    decided: dict[int, int]

    def decide(self, step: int, epoch: int, keys: Sequence[int], measured: Sequence[tuple[float, int, int]]) -> bool:
        """At a decision step, the decision for ``keys`` from ``measured``; whether it decided."""
        ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class FaultTolerantReplica:
    """One replica of a job that keeps training while others fail, leave or join (module docstring).

    Args:
        num_samples: the dataset's length; every replica must give the same.
        global_batch_size: samples per step over all participants, >= 1.
        state_dict: the caller's state a joining replica receives (model, optimizer, controller), as a
            dict of tensors and plain values.
        load_state_dict: loads what ``state_dict`` gave, on a joining replica.
        lighthouse: the lighthouse's address (``http://HOST:PORT``).
        replica_id: a name for this replica (a machine's); torchft makes it unique.
        host: the address other replicas reach this one at (its process group, store and recovery).
        min_replicas: commit a step only with at least this many participants.
        shuffle: a new order every epoch (seeded with ``seed + epoch``), or the dataset's order.
        seed: the order's seed; every replica must give the same.
        timeout: seconds before a collective, a commit or a recovery is given up (the step is then not
            committed).
        quorum_timeout: seconds to wait for a quorum.
        backend: ``"gloo"`` (CPU tensors) or ``"nccl"`` (CUDA).
        balancer: the controller whose decisions this replica asks for
            (:class:`~lightning_dynamix.decisions.ReplicaBalancer`); its state travels to a joining replica with the
            caller's. ``None``: the sizes given to :meth:`begin_step`.
        time_source: what times this replica's own work (from its plan to :meth:`sync_gradients`) for the
            balancer: the host's clock by default; CUDA events on a GPU
            (:func:`~lightning_dynamix.metrics.clocks.time_source_for`), so that it is the device's time.

    Raises:
        ValueError: for a bad argument, naming it.
        ConnectionError: when no lighthouse answers at ``lighthouse``.
    """

    def __init__(
        self,
        num_samples: int,
        global_batch_size: int,
        state_dict: Callable[[], dict[str, Any]],
        load_state_dict: Callable[[dict[str, Any]], None],
        lighthouse: str,
        replica_id: str = "replica",
        host: str = "127.0.0.1",
        min_replicas: int = 1,
        shuffle: bool = True,
        seed: int = 0,
        timeout: float = 10.0,
        quorum_timeout: float = 60.0,
        backend: str = "gloo",
        balancer: Balancer | None = None,
        time_source: TimeSource | None = None,
    ) -> None:
        require_int("num_samples", num_samples, 1)
        require_int("global_batch_size", global_batch_size, 1)
        require_int("min_replicas", min_replicas, 1)
        require_int("seed", seed, 0)
        for name, value in (("timeout", timeout), ("quorum_timeout", quorum_timeout)):
            require_number(name, value, 0.0, math.inf, low_open=True, high_open=True)
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"`backend` must be 'gloo' or 'nccl', got {backend!r}")
        if not replica_id or ":" in replica_id:
            raise ValueError(f"`replica_id` must be a non-empty name without ':', got {replica_id!r}")
        check_lighthouse(lighthouse)
        torchft = _torchft()
        from torch.distributed import TCPStore

        self.num_samples = num_samples
        self.global_batch_size = global_batch_size
        self.order = EpochPermutation(num_samples, shuffle=shuffle, seed=seed)
        self.step = 0
        self.epoch = 0
        self.cursor = 0
        self.failed = 0
        """Steps this replica took part in that were not committed (including quorums whose members could not
        agree on the sizes)."""
        self._plan: StepPlan | None = None
        self.balancer = balancer
        self.key = machine_key(replica_id)
        self.joined = False
        """Whether this replica received the job's state from a peer (it joined a job under way)."""
        # this process's own time per step: steps committed here, and the interval's (seconds, steps, size)
        self._steps_here = 0
        self._measured: tuple[float, int, int] = (0.0, 0, 0)
        self.time_source: TimeSource = time_source if time_source is not None else HostClock()
        self._planned_at: Any = None  # the time source's mark at the plan
        self._busy = math.nan
        self._user_state_dict = state_dict
        self._user_load_state_dict = load_state_dict
        # a store of its own for the replica group (one process): torchft's manager meets there
        self._store = TCPStore(host, 0, world_size=1, is_master=True, wait_for_workers=False)
        pg_timeout = timedelta(seconds=timeout)
        pg = torchft.ProcessGroupGloo(timeout=pg_timeout) if backend == "gloo" else torchft.ProcessGroupNCCL(pg_timeout)
        self.manager = torchft.Manager(
            pg=pg,
            load_state_dict=self._load_state_dict,
            state_dict=self._state_dict,
            min_replica_size=min_replicas,
            use_async_quorum=False,
            timeout=pg_timeout,
            quorum_timeout=timedelta(seconds=quorum_timeout),
            connect_timeout=timedelta(seconds=timeout),
            rank=0,
            world_size=1,
            store_addr=host,
            store_port=self._store.port,
            lighthouse_addr=lighthouse,
            replica_id=replica_id,
            hostname=host,
        )

    def _state_dict(self) -> dict[str, Any]:
        state = {
            "user": self._user_state_dict(),
            "data": {"step": self.step, "epoch": self.epoch, "cursor": self.cursor},
        }
        if self.balancer is not None:
            state["balancer"] = self.balancer.state_dict()
        return state

    def _load_state_dict(self, state: dict[str, Any]) -> None:
        self._user_load_state_dict(state["user"])
        self.step, self.epoch, self.cursor = (int(state["data"][k]) for k in ("step", "epoch", "cursor"))
        if self.balancer is not None and "balancer" in state:
            self.balancer.load_state_dict(state["balancer"])
        self.joined = True
        self._measured = (0.0, 0, 0)

    def _request(self, batch_size: int | None) -> float:
        """What this replica asks for at the next step (the slot's code: > 0 a size, 0 even, < 0 a probe)."""
        if self.balancer is None:
            return float(batch_size) if batch_size is not None else 0.0
        if self.key in self.balancer.decided:
            return float(self.balancer.decided[self.key])
        return -PROBE_SHARE if self.joined else (float(batch_size) if batch_size is not None else 0.0)

    def begin_step(self, batch_size: int | None = None) -> StepPlan:
        """Join the step's quorum and agree on its sizes; ``batch_size`` is the size this replica asks for
        (a weight: the participants' requests are scaled to the global batch), ``None`` for an even share.

        A quorum whose members cannot agree (one failed meanwhile) is left uncommitted and formed again.
        """
        if batch_size is not None:
            require_int("batch_size", batch_size, 1)
        while True:
            self.manager.start_quorum()
            participant = self.manager.participating_rank()
            participants = self.manager.num_participants()
            if participant is None or participants < 1:  # not in this quorum (a spare): wait for the next
                self.manager.should_commit()
                continue
            seconds, steps, size = self._measured
            slots = torch.zeros(participants, _SLOT, dtype=torch.float64)
            slots[participant] = torch.tensor(
                [float(self.key), self._request(batch_size), seconds, float(steps), float(size)], dtype=torch.float64
            )
            self.manager.allreduce(slots, reduce_op=torch.distributed.ReduceOp.SUM).wait()
            if self.manager.errored() is None:
                break
            self.manager.should_commit()  # not committed: nothing was trained; try the next quorum
            self.failed += 1
        rows = slots.tolist()
        if self.balancer is not None:
            keys = [int(row[0]) for row in rows]
            measured = [(row[2], int(row[3]), int(row[4])) for row in rows]
            if self.balancer.decide(self.step, self.epoch, keys, measured):
                self._measured = (0.0, 0, 0)  # every participant decided at this step: all measure afresh
        asked = [row[1] for row in rows]
        given = [r for r in asked if r > 0]
        mean = sum(given) / len(given) if given else 1.0
        weights = [r if r > 0 else (mean if r == 0 else -r * mean) for r in asked]
        sizes = participant_sizes(self.global_batch_size, weights, self.num_samples - self.cursor)
        self.order.set_epoch(self.epoch)
        start = self.cursor + sum(sizes[:participant])
        self._plan = StepPlan(
            step=self.step,
            epoch=self.epoch,
            cursor=self.cursor,
            participant=participant,
            batch_sizes=sizes,
            indices=self.order.indices(start, start + sizes[participant]),
        )
        if self.balancer is not None:
            if self._planned_at is not None:  # a plan whose step never reached its gradients
                self.time_source.release(self._planned_at)
            self._planned_at, self._busy = self.time_source.mark(), math.nan
        return self._plan

    def sync_gradients(self, parameters: Iterable[torch.nn.Parameter]) -> None:
        """Replace each parameter's gradient (the mean over this replica's samples) by the mean over the
        step's global batch: weighted by ``b_p / B`` and summed over the participants, in one all-reduce.
        A parameter without a gradient counts as zero."""
        plan = self._require_plan()
        if self._planned_at is not None:  # this replica's own work: its batch, forward and backward
            end = self.time_source.mark()
            self._busy = self.time_source.elapsed(self._planned_at, end)
            self.time_source.release(self._planned_at)
            self.time_source.release(end)
            self._planned_at = None
        params = [p for p in parameters if p.requires_grad]
        if not params:
            return
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        flat = torch.cat([p.grad.reshape(-1) for p in params])  # type: ignore[union-attr]
        flat.mul_(plan.batch_size / plan.global_batch)
        self.manager.allreduce(flat, reduce_op=torch.distributed.ReduceOp.SUM).wait()
        offset = 0
        for p in params:
            n = p.numel()
            p.grad.copy_(flat[offset : offset + n].view_as(p))  # type: ignore[union-attr]
            offset += n

    def commit(self) -> bool:
        """Whether the step is committed: step the optimizer only then. A committed step moves the cursor
        past its global batch (to the next epoch after the last one)."""
        plan = self._require_plan()
        self._plan = None
        committed = self.manager.should_commit()
        if committed:
            self._steps_here += 1
            warm = self.balancer is not None and self._steps_here > self.balancer.warmup_steps
            if warm and plan.batch_size > 0 and math.isfinite(self._busy):
                seconds, steps, size = self._measured
                if size != plan.batch_size:  # another size: another operating point, measured afresh
                    seconds, steps, size = 0.0, 0, plan.batch_size
                self._measured = (seconds + self._busy, steps + 1, size)
            self.step += 1
            self.cursor += plan.global_batch
            if self.cursor >= self.num_samples:
                self.epoch += 1
                self.cursor = 0
        else:
            self.failed += 1
        return committed

    def _require_plan(self) -> StepPlan:
        if self._plan is None:
            raise RuntimeError("begin_step() must come first: each step is begin_step, sync_gradients, commit")
        return self._plan

    def close(self) -> None:
        """Leave the job: the others go on without this replica."""
        self.manager.shutdown(wait=False)


@dataclass(frozen=True)
class ReplicaSettings:
    """What a replica of a job is given, checked: the arguments ``FaultTolerantStrategy`` and
    ``FaultTolerantAccelerate`` share (see either for their meaning). Build it with :meth:`checked`."""

    global_batch_size: int
    lighthouse: str
    replica_id: str
    host: str = "127.0.0.1"
    batch_size: int | None = None
    min_replicas: int = 1
    timeout: float = 10.0
    quorum_timeout: float = 60.0
    seed: int = 0
    shuffle: bool = True

    @classmethod
    def checked(
        cls,
        global_batch_size: int,
        lighthouse: str | None = None,
        replica_id: str | None = None,
        host: str = "127.0.0.1",
        batch_size: int | None = None,
        min_replicas: int = 1,
        timeout: float = 10.0,
        quorum_timeout: float = 60.0,
        seed: int = 0,
        shuffle: bool = True,
    ) -> ReplicaSettings:
        """The settings, each checked (a clear ``ValueError`` naming it); ``lighthouse`` ``None`` reads
        ``TORCHFT_LIGHTHOUSE``, ``replica_id`` ``None`` reads ``REPLICA_GROUP_ID``, else the host name."""
        require_int("global_batch_size", global_batch_size, 1)
        if batch_size is not None:
            require_int("batch_size", batch_size, 1)
        require_int("min_replicas", min_replicas, 1)
        require_int("seed", seed, 0)
        for name, value in (("timeout", timeout), ("quorum_timeout", quorum_timeout)):
            require_number(name, value, 0.0, math.inf, low_open=True, high_open=True)
        lighthouse = lighthouse if lighthouse is not None else os.environ.get("TORCHFT_LIGHTHOUSE")
        if not lighthouse:
            raise ValueError(
                "`lighthouse` is needed: the address of the job's torchft lighthouse (http://HOST:PORT),"
                " given here or in the TORCHFT_LIGHTHOUSE environment variable"
            )
        lighthouse_host_port(lighthouse)  # a clear error now for a malformed address
        replica_id = replica_id or os.environ.get("REPLICA_GROUP_ID") or socket.gethostname()
        return cls(
            global_batch_size, lighthouse, replica_id, host, batch_size, min_replicas, timeout, quorum_timeout, seed,
            bool(shuffle),
        )  # fmt: skip

    def replica(
        self,
        num_samples: int,
        state_dict: Callable[[], dict[str, Any]],
        load_state_dict: Callable[[dict[str, Any]], None],
        backend: str,
        balancer: Balancer | None,
        time_source: TimeSource | None,
    ) -> FaultTolerantReplica:
        """This replica's :class:`FaultTolerantReplica` for a dataset of ``num_samples``."""
        return FaultTolerantReplica(
            num_samples,
            self.global_batch_size,
            state_dict,
            load_state_dict,
            lighthouse=self.lighthouse,
            replica_id=self.replica_id,
            host=self.host,
            min_replicas=self.min_replicas,
            shuffle=self.shuffle,
            seed=self.seed,
            timeout=self.timeout,
            quorum_timeout=self.quorum_timeout,
            backend=backend,
            balancer=balancer,
            time_source=time_source,
        )


def steps_left_in_epoch(num_samples: int, global_batch: int, cursor: int) -> int:
    """The most steps an epoch can still take from ``cursor`` (with one participant, whose final step comes last)."""
    steps = 0
    while cursor < num_samples:
        remaining = num_samples - cursor
        cursor += remaining if remaining < global_batch + 1 else global_batch
        steps += 1
    return steps


class StepBatches:
    """This replica's batches for the rest of its current epoch, each planned when it is asked for.

    Iterating runs :meth:`FaultTolerantReplica.begin_step` for every batch, then reads the plan's samples
    from ``dataset`` and collates them, in this process. It stops where the replica's epoch ends (a
    committed step past its last sample). Its length is the most steps the epoch can still take.
    A participant without samples at a step (more participants than samples at an epoch's end) gets
    :class:`~lightning_dynamix.data.loader.EmptyBatch`.

    Args:
        replica: the replica whose steps these are.
        dataset: a map-style dataset of ``replica.num_samples`` samples.
        collate_fn: makes a batch of a list of samples.
        batch_size: the size this replica asks for at every step (``None``: an even share).
    """

    def __init__(
        self,
        replica: FaultTolerantReplica,
        dataset: Any,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        batch_size: int | None = None,
    ) -> None:
        if batch_size is not None:
            require_int("batch_size", batch_size, 1)
        self.replica = replica
        self.dataset = dataset
        self.collate_fn = collate_fn if collate_fn is not None else default_collate
        self.batch_size = batch_size
        self.plan: StepPlan | None = None
        """The plan of the batch handed out last."""

    def __len__(self) -> int:
        return steps_left_in_epoch(self.replica.num_samples, self.replica.global_batch_size, self.replica.cursor)

    def next_batch(self) -> Any:
        """The next step's batch (its plan in :attr:`plan`), whatever the epoch."""
        self.plan = self.replica.begin_step(self.batch_size)
        if not self.plan.indices:
            return EmptyBatch()
        return self.collate_fn([self.dataset[i] for i in self.plan.indices])

    def __iter__(self) -> Iterator[Any]:
        epoch = self.replica.epoch
        while self.replica.epoch == epoch:
            batch = self.next_batch()
            # a replica that joined received the job's position with its state: its epoch is the job's
            epoch = self.plan.epoch if self.plan is not None else epoch
            yield batch
