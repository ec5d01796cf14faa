"""Measure, decide, apply, without a training framework: what Lightning's callbacks, Accelerate and torchft share.

* :class:`IntervalMeter`: one rank's bookkeeping between two decisions (step clock, system sample,
  loss, gradient noise scale) and the interval's one all_gather into a
  :class:`~lightning_dynamix.metrics.ClusterState`.
* :class:`DecisionMaker`: rank 0 asks the controller, checks its answer, applies the learning-rate
  rule, and broadcasts the :class:`~lightning_dynamix.control.Decision` so every rank applies the
  same one (a failing controller fails every rank instead of leaving the others in a collective).

Both are collectives where they say so: call them on every rank at the same step.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from lightning_dynamix._checks import require_int
from lightning_dynamix.control import CONTROLLERS, BatchController, Decision, lr_scale, make_controller
from lightning_dynamix.control.allocation import respect_batch_size_caps, respect_least_batch_size
from lightning_dynamix.distributed import broadcast_floats, gather_floats
from lightning_dynamix.metrics import ClusterState, GradientNoiseScale, StepClock, SystemMonitor, WorkerMetrics
from lightning_dynamix.metrics.arrivals import Span, clock_offsets, own_time_inside
from lightning_dynamix.metrics.clocks import HostClock
from lightning_dynamix.metrics.memory import CudaMemoryReader, DeviceMemory, check_margin
from lightning_dynamix.metrics.state import loss_slope

log = logging.getLogger(__name__)

NAN = float("nan")
_LOSS_HISTORY = 4  # intervals the loss slope is fitted over
_CLOCK_ROUNDS = 3  # all-gathers stamped before and after that put the ranks' clocks on one line
_OK, _ERROR = 1.0, -1.0
# a rank the controller keeps at size 0 is probed (given a few samples for one interval) after this many
# decisions, then after twice as many each time it stays out, up to _PROBE_WAIT_MOST, and never so soon
# that the probes cost the job more than _PROBE_BUDGET of its time (as the last probe measured)
_PROBE_WAIT_FIRST = 8
_PROBE_WAIT_MOST = 128
_PROBE_BUDGET = 0.05
_PROBE_SHARE = 0.25  # a probe's size: this fraction of an even share of the global batch


@dataclass(frozen=True)
class IntervalRecord:
    """What happened at one decision point.

    Attributes:
        step: the optimizer step at which the state was gathered.
        time: seconds since training started.
        state: the gathered cluster state.
        decision: the decision taken there (``None`` for a monitor, which only logs).
    """

    step: int
    time: float
    state: ClusterState
    decision: Decision | None = None


class IntervalMeter:
    """One rank's measurements between two decisions, and their gather into a ClusterState.

    Args:
        interval: optimizer steps between two gathers (>= 1).
        warmup_steps: optimizer steps measured by nobody at the start (start-up is slow).
        gradient_noise_scale: also estimate the gradient noise scale (fed through :meth:`record_gradient_norms`).
        noise_scale_ema: decay of the noise scale's moving average over intervals, in [0, 1).
        memory_margin: on a GPU, the share of its memory kept free when the largest batch it holds is derived
            from the measured peak bytes per sample (:class:`~lightning_dynamix.metrics.memory.DeviceMemory`);
            ``None``: not measured.
    """

    def __init__(
        self,
        interval: int = 10,
        warmup_steps: int = 5,
        gradient_noise_scale: bool = True,
        noise_scale_ema: float = 0.9,
        memory_margin: float | None = 0.1,
    ) -> None:
        self.memory_margin = None if memory_margin is None else check_margin("memory_margin", memory_margin)
        self.memory: DeviceMemory | None = None
        self.interval = require_int("interval", interval, 1)
        self.warmup_steps = require_int("warmup_steps", warmup_steps, 0)
        self.noise_scale = GradientNoiseScale(ema_decay=noise_scale_ema) if gradient_noise_scale else None
        self.history: list[IntervalRecord] = []
        self.clock: StepClock | None = None
        self._system: SystemMonitor | None = None
        self._loss_sum: torch.Tensor | None = None
        self._loss_count = 0
        self._loss_points: list[tuple[int, float]] = []
        self._last_step = -1
        self._started = 0.0

    def start(self, clock: StepClock, device: torch.device, step: int) -> None:
        """Training starts (or resumes) at optimizer step ``step`` on ``device``, timed by ``clock``."""
        self.clock = clock
        self._system = SystemMonitor(device.index if device.type == "cuda" else None)
        if device.type == "cuda" and self.memory_margin is not None:
            self.memory = DeviceMemory(CudaMemoryReader(device), self.memory_margin)
        if self.noise_scale is not None:
            self.noise_scale.to(device)
        self._last_step = step
        self._started = time.perf_counter()

    def elapsed(self) -> float:
        return time.perf_counter() - self._started

    def record_gradient_norms(
        self, local_sq_norm: torch.Tensor, local_samples: int, global_sq_norm: torch.Tensor, global_samples: int
    ) -> None:
        """A synchronisation's squared gradient norms, before and after the all-reduce (the noise scale's input)."""
        if self.noise_scale is not None:
            self.noise_scale.update(local_sq_norm, local_samples, global_sq_norm, global_samples)

    def end_batch(self, loss: object, step: int) -> bool:
        """A batch is over; ``step`` is the optimizer step count after it. True when the interval is due."""
        assert self.clock is not None, "IntervalMeter.start() was not called"
        self.clock.step_end()
        sat_out = self.clock.last_batch_size == 0
        if self.memory is not None and self.clock.last_batch_size is not None:
            self.memory.step_end(self.clock.last_batch_size)
        if isinstance(loss, torch.Tensor) and loss.numel() == 1 and not sat_out:  # no samples, no loss
            # summed on the loss's device: read back once per interval, not once per step
            if self._loss_sum is None:
                self._loss_sum = torch.zeros((), dtype=torch.float64, device=loss.device)
            self._loss_sum.add_(loss.detach().reshape(()))
            self._loss_count += 1
        if step == self._last_step:
            return False  # no optimizer step this batch (gradient accumulation)
        self._last_step = step
        if step <= self.warmup_steps:
            self.start_interval()
            return False
        return (step - self.warmup_steps) % self.interval == 0

    def start_interval(self) -> None:
        assert self.clock is not None
        self.clock.reset_interval()
        self._loss_sum, self._loss_count = None, 0
        if self.noise_scale is not None:
            self.noise_scale.reset()

    def _batch_size_cap(self, given: int | None) -> float:
        """This rank's largest size: the tighter of ``given`` and its measured device memory; NaN for none."""
        caps = [float(given)] if given is not None else []
        measured = self.memory.cap() if self.memory is not None else NAN
        if math.isfinite(measured):
            caps.append(measured)
        return min(caps) if caps else NAN

    def gather(
        self,
        *,
        rank: int,
        step: int,
        epoch: int,
        lr: float,
        sizes: Sequence[int],
        bounds: tuple[int, int | None],
        device: torch.device,
        least_batch_size: int = 1,
        batch_size_cap: int | None = None,
    ) -> ClusterState:
        """Every rank's interval into one :class:`ClusterState`: a collective, call it on all ranks.

        ``sizes`` are the per-rank sizes in force, used for a rank that completed no step in the interval;
        ``batch_size_cap`` is the largest size this rank may train (a cap for its machine, or one lowered after
        it ran out of memory), combined with what its device memory holds where that is measured.
        """
        assert self.clock is not None, "IntervalMeter.start() was not called"
        assert self._system is not None
        summary = self.clock.summary()
        system = self._system.sample()
        batch_size = summary.batch_size if summary.steps else sizes[rank]
        loss = float(self._loss_sum) / self._loss_count if self._loss_sum is not None else NAN
        values = {
            "data_time": summary.data_time,
            "compute_time": summary.compute_time,
            "sync_wait": summary.sync_wait,
            "step_time": summary.step_time,
            "samples_per_s": summary.samples_per_s,
            "cpu_util": system.cpu_util,
            "mem_util": system.mem_util,
            "gpu_util": system.gpu_util,
            "gpu_mem_util": system.gpu_mem_util,
            "gpu_power_w": system.gpu_power_w,
            "gpu_temperature_c": system.gpu_temperature_c,
            "comm_time": summary.comm_time,
            "comm_bytes": summary.comm_bytes,
            "bandwidth": summary.bandwidth,
            "cpu_time": summary.cpu_time,
            "cpu_quota": summary.cpu_quota,
            "least_sync_wait": summary.least_sync_wait,
            "max_batch_size": self._batch_size_cap(batch_size_cap),
            "work": summary.work,
            "padding": summary.padding,
        }
        names = WorkerMetrics.float_fields()
        # arrivals inside the step can be compared on the host's clock (a device's marks are not times of day)
        inside = summary.collectives if isinstance(self.clock.time_source, HostClock) else ()
        spans = sum(1 for step in inside if step)
        row = [float(batch_size), loss, float(spans), float(summary.steps), *(values[name] for name in names)]
        rows = gather_floats(row, device=device)  # the interval's one all_gather
        workers = tuple(WorkerMetrics(r, int(v[0]), **dict(zip(names, v[4:], strict=True))) for r, v in enumerate(rows))
        if len(rows) > 1 and all(v[2] > 0 and v[3] > 0 for v in rows):  # every rank's collectives: who waited
            last = int(min(v[3] for v in rows))  # the steps at every rank's latest size: its means are over them
            workers = self._waits_by_arrival(workers, inside[-last:], device)
        global_loss = _weighted_loss([(v[0], v[1]) for v in rows])
        if math.isfinite(global_loss):
            self._loss_points = [*self._loss_points, (step, global_loss)][-_LOSS_HISTORY:]
        noise_scale = float(self.noise_scale.compute()) if self.noise_scale is not None else NAN  # one more gather
        low, high = bounds
        return ClusterState(
            workers=workers,
            step=step,
            epoch=epoch,
            loss=global_loss,
            loss_slope=loss_slope(self._loss_points),
            gradient_noise_scale=noise_scale,
            lr=lr,
            min_batch_size=low,
            max_batch_size=high,
            least_batch_size=max(least_batch_size, low),
        )

    def _waits_by_arrival(
        self, workers: tuple[WorkerMetrics, ...], inside: Sequence[Sequence[Span]], device: torch.device
    ) -> tuple[WorkerMetrics, ...]:
        """The workers with their time inside the step's collectives split by arrival: waiting for the last rank
        stays ``sync_wait``, the rest (the collective itself, a rank descheduled inside it) is ``compute_time``.

        A collective (a few small all-gathers that put the ranks' clocks on one line, then one of the arrivals):
        call it on every rank, each with its own arrivals of the same steps. See :mod:`~lightning_dynamix.metrics.
        arrivals`.
        """
        assert self.clock is not None
        rounds = []
        for _ in range(_CLOCK_ROUNDS):
            before = self.clock.now()
            gather_floats([0.0], device=device)
            rounds.append((float(before), float(self.clock.now())))
        everyone: list[Any] = [None] * len(workers)
        dist.all_gather_object(everyone, (rounds, [list(step) for step in inside]))
        offsets = clock_offsets([r for r, _ in everyone])
        result = own_time_inside([steps for _, steps in everyone], offsets)
        if result is None:
            return workers
        own, _ = result
        return tuple(
            dataclasses.replace(w, compute_time=w.compute_time + seconds, sync_wait=max(0.0, w.sync_wait - seconds))
            for w, seconds in zip(workers, own)
        )

    def state_dict(self) -> dict[str, Any]:
        return {
            "loss_points": [list(p) for p in self._loss_points],
            "noise_scale": None if self.noise_scale is None else self.noise_scale.state_dict(),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._loss_points = [(int(s), float(v)) for s, v in state_dict.get("loss_points", [])]
        saved = state_dict.get("noise_scale")
        if saved is not None and self.noise_scale is not None:
            self.noise_scale.load_state_dict(saved)


def build_controller(
    controller: str | BatchController,
    controller_kwargs: dict[str, Any] | None,
    min_batch_size: int | None,
    max_batch_size: int | None,
    lr_scaling: str,
    finetune: bool = False,
) -> tuple[BatchController, str]:
    """A controller from a name (with its arguments and the bounds) or an object; returns it and its name.

    ``finetune`` asks the ``"ppo"`` controller to keep training its policy on the job's decisions.

    Raises:
        ValueError: for an unknown name, ``controller_kwargs`` with an object, or ``finetune``
            with a controller other than ``"ppo"``.
    """
    if finetune is not False and (not isinstance(finetune, bool) or controller != "ppo"):
        raise ValueError(
            f"`finetune` must be True or False and needs controller='ppo' (a learned policy), got finetune={finetune!r}"
            f" with controller={controller!r}"
        )
    if isinstance(controller, str):
        if controller not in CONTROLLERS:
            raise ValueError(
                f"`controller` must be one of {sorted(CONTROLLERS)} or a BatchController object, got {controller!r}"
            )
        kwargs = dict(controller_kwargs or {})
        if controller in ("pid", "goodput", "ppo"):  # the static controller takes no arguments
            bounds = {"min_batch_size": min_batch_size, "max_batch_size": max_batch_size}
            kwargs.update({k: v for k, v in bounds.items() if v is not None and k not in kwargs})
        if controller in ("pid", "goodput"):
            kwargs.setdefault("lr_scaling", lr_scaling)
        if finetune:
            kwargs["finetune"] = True
        return make_controller(controller, **kwargs), controller
    if isinstance(controller, BatchController):
        if controller_kwargs:
            raise ValueError(
                "`controller_kwargs` configure a controller given by name; this controller is an object"
                f" ({type(controller).__name__}): configure it directly. Got {controller_kwargs!r}."
            )
        return controller, type(controller).__name__
    raise ValueError(
        f"`controller` must be one of {sorted(CONTROLLERS)} or an object with decide(state),"
        f" state_dict() and load_state_dict(), got {controller!r}"
    )


def check_world_size(controller: BatchController, world_size: int) -> None:
    """Let a controller refuse a job size before training starts (``check_world_size(n)``, where it has one).

    Raises:
        ValueError: the controller's, when it cannot decide for ``world_size`` ranks.
    """
    check = getattr(controller, "check_world_size", None)
    if callable(check):
        check(world_size)


def wants_noise_scale(controller: BatchController, lr_scaling: str) -> bool:
    """Whether the controller (its ``needs_gradient_noise_scale``) or the learning-rate rule reads the gradient
    noise scale: ``goodput`` and ``ppo`` where they choose the global batch, and ``adascale``."""
    return lr_scaling == "adascale" or bool(getattr(controller, "needs_gradient_noise_scale", False))


class DecisionMaker:
    """Rank 0 decides with ``controller``, every rank receives the same :class:`Decision`.

    Args:
        controller: the controller (rank 0 calls its ``decide``).
        controller_name: how errors name it.
        lr_scaling: the learning-rate rule; it decides the scale, whatever a controller's decision carries.
        owner: how errors and warnings name the integration (``"DynamixCallback"``).
    """

    def __init__(self, controller: BatchController, controller_name: str, lr_scaling: str, owner: str) -> None:
        self.controller = controller
        self.controller_name = controller_name
        self.lr_scaling = lr_scaling
        self.owner = owner
        self.lr_scale = 1.0
        self.base_global_batch: int | None = None
        self._warned_not_finite = False
        self.machine_ids: list[str] | None = None
        """The machine of every rank, in rank order (see :func:`lightning_dynamix.elastic.machine_id`)."""
        self.regrouped_from: list[int | None] | None = None
        """After :meth:`join` found another group: every new rank's old rank, ``None`` for a new machine."""
        # per rank: decisions kept at size 0 since it last trained, decisions it has trained since it last
        # sat out, decisions to wait before probing it again, and whether it last came back through a probe
        self._out_for: list[int] = []
        self._in_for: list[int] = []
        self._probe_wait: list[int] = []
        self._probed: list[bool] = []
        # per rank: the wait its last probe's cost calls for; the job's time per sample in the last interval
        # measured without a probe
        self._cost_wait: list[int] = []
        self._time_per_sample = NAN

    def decide(self, state: ClusterState, current: Sequence[int], is_rank_zero: bool, device: torch.device) -> Decision:
        """The decision of this interval on every rank: a collective (one broadcast)."""
        current = list(current)
        world = len(current)
        payload = [_OK, self.lr_scale, -1.0, *map(float, current)]
        message = ""
        if is_rank_zero:
            try:
                decision = self.propose(state, current)
                payload = [_OK, decision.lr_scale, float(-1 if decision.from_step is None else decision.from_step)]
                payload += [float(b) for b in decision.batch_sizes]
            except Exception as err:  # every rank must leave the broadcast, then all fail alike
                message = f"{type(err).__name__}: {err}"
                payload = [_ERROR, 1.0, -1.0, *map(float, current)]
        payload = broadcast_floats(payload, device=device)
        if payload[0] == _ERROR:
            raise RuntimeError(
                f"{self.owner}'s controller {self.controller_name} failed on rank 0 at step {state.step}"
                + (f": {message}" if message else "; see rank 0's error.")
            )
        from_step = None if payload[2] < 0 else int(payload[2])
        return Decision(tuple(int(b) for b in payload[3 : 3 + world]), lr_scale=payload[1], from_step=from_step)

    def apply_lr_scale(self, decision: Decision, optimizers: Sequence[Any]) -> None:
        """Multiply every parameter group's learning rate by the change of scale ``decision`` brings."""
        if decision.lr_scale == self.lr_scale:
            return
        ratio = decision.lr_scale / self.lr_scale
        for optimizer in optimizers:
            for group in optimizer.param_groups:
                group["lr"] *= ratio
        self.lr_scale = decision.lr_scale

    def propose(self, state: ClusterState, current: Sequence[int]) -> Decision:
        """The controller's decision for ``state``, checked, with the learning-rate rule applied (no collective).

        A state with measurements that are not finite keeps ``current`` (and warns once).
        """
        current = list(current)
        needed = ("compute_time", "step_time", "data_time")
        if not state.is_finite(needed):
            if not self._warned_not_finite:
                bad = state.not_finite_ranks(needed)
                log.warning(
                    "%s: ranks %s reported no complete step in the interval ending at step %d"
                    " (not finite measurements); keeping the current batch sizes %s. This warning is shown once;"
                    " a longer `interval` gives every rank time to report.",
                    self.owner,
                    bad,
                    state.step,
                    current,
                )
                self._warned_not_finite = True
            return Decision(tuple(current), lr_scale=self.lr_scale)
        decision = self.controller.decide(state)
        low, high = state.min_batch_size, state.max_batch_size
        sizes = list(decision.batch_sizes)
        if len(sizes) != len(current) or any(b < low or (high is not None and b > high) for b in sizes):
            raise ValueError(
                f"the controller decided batch sizes {sizes} for {len(current)} ranks; every size must lie in"
                f" [{low}, {high if high is not None else 'no limit'}]"
            )
        if getattr(self.controller, "uses_measurements", True):
            sizes = self._probe(current, sizes, low, high, 1.0 / state.throughput)
        # no rank above what its memory holds, whatever a controller decided: the excess goes to the others
        caps = state.batch_size_caps
        sizes = list(respect_batch_size_caps(sizes, caps, [low] * len(sizes)))
        # a model with BatchNorm cannot train a rank on fewer than 2 samples: such a size becomes 0 or 2
        sizes = list(respect_least_batch_size(sizes, state.least_batch_size, caps))
        if self.base_global_batch is None:
            self.base_global_batch = sum(current)
        scale = lr_scale(self.lr_scaling, sum(sizes), self.base_global_batch, state.gradient_noise_scale)
        return Decision(tuple(sizes), lr_scale=scale, from_step=decision.from_step)

    def _probe(
        self, current: Sequence[int], sizes: list[int], low: int, high: int | None, time_per_sample: float
    ) -> list[int]:
        """Give a rank kept at size 0 a few samples for one interval now and then, so that it is measured again.

        A rank that sits out is not measured: only a probe shows whether it became fast enough to
        come back. The first probe comes :data:`_PROBE_WAIT_FIRST` decisions after it left, and the
        wait doubles each time a probe brings it back for fewer than that many decisions (up to
        :data:`_PROBE_WAIT_MOST`), so a rank that stays slow costs the job less and less; a rank that
        trains that long again starts afresh. A probe's cost is measured, the job's time per sample
        (``time_per_sample``, one over the state's throughput) in the probe's interval over the one before, and the wait
        is never shorter than what keeps the probes within :data:`_PROBE_BUDGET` of the job's time:
        ``(ratio - 1) / _PROBE_BUDGET`` decisions (a probe at 14 times the job's time per sample, an
        8x straggler whose step is mostly fixed cost, waits 260 decisions).
        """
        n = len(sizes)
        if len(self._out_for) != n:
            self._out_for, self._in_for = [0] * n, [0] * n
            self._probe_wait, self._probed = [_PROBE_WAIT_FIRST] * n, [False] * n
        if len(self._cost_wait) != n:
            self._cost_wait = [0] * n
        # a probe given at the last decision: the rank trains, and has trained no decision since
        measured = [r for r in range(n) if self._probed[r] and self._in_for[r] == 0 and current[r] > 0]
        if math.isfinite(time_per_sample) and time_per_sample > 0:
            if not measured:
                self._time_per_sample = time_per_sample
            elif math.isfinite(self._time_per_sample) and self._time_per_sample > 0:
                extra = max(0.0, time_per_sample / self._time_per_sample - 1.0)
                for r in measured:
                    self._cost_wait[r] = math.ceil(extra / _PROBE_BUDGET - 1e-9)
        total = sum(sizes)
        probe = max(1, int(_PROBE_SHARE * total / n))
        if high is not None:
            probe = min(probe, high)
        for r in range(n):
            if sizes[r] > 0:
                self._out_for[r] = 0
                self._in_for[r] += 1
                if self._in_for[r] >= _PROBE_WAIT_FIRST:  # back for good
                    self._probe_wait[r], self._probed[r] = _PROBE_WAIT_FIRST, False
                continue
            if self._probed[r]:  # out again within _PROBE_WAIT_FIRST decisions of a probe
                doubled = min(2 * self._probe_wait[r], _PROBE_WAIT_MOST)
                self._probe_wait[r] = max(doubled, self._cost_wait[r])
                self._probed[r] = False
            self._in_for[r] = 0
            self._out_for[r] += 1
            if self._out_for[r] < self._probe_wait[r]:
                continue
            # the probe's samples come from the largest ranks, one at a time, within their bounds
            taken = 0
            while taken < probe:
                donors = [i for i in range(n) if i != r and sizes[i] > max(low, 1)]
                donor = max(donors, key=lambda i: sizes[i], default=None)
                if donor is None:
                    break
                sizes[donor] -= 1
                taken += 1
            sizes[r] = taken
            self._out_for[r], self._probed[r] = 0, taken > 0
        return sizes

    def join(self, machine_ids: Sequence[str]) -> None:
        """The job runs (or resumed) on ranks with these machine ids, in rank order: the same call on every rank.

        When a resumed job's machines differ from the saved ones, the controller's per-rank state is
        carried over by machine (``controller.regroup``, where it has one): a machine that stays keeps
        what was learnt about it, a new one starts from the others' mean. A controller without
        ``regroup`` keeps its state as it is, which it must then cope with (a warning says so).
        """
        ids = list(machine_ids)
        saved, self.machine_ids = self.machine_ids, ids
        if saved is None or saved == ids:
            return
        previous = [saved.index(name) if name in saved else None for name in ids]
        self.regrouped_from = previous
        regroup = getattr(self.controller, "regroup", None)
        if callable(regroup):
            regroup(previous)
        else:
            log.warning(
                "%s: the job resumed on other machines (%s, was %s) but controller %s has no regroup(previous);"
                " its per-rank state is kept in rank order.",
                self.owner,
                ids,
                saved,
                self.controller_name,
            )

    def resume_weights(self) -> list[float] | None:
        """Every rank's speed as the controller knows it (``rank_speeds()``), to split a resumed global batch."""
        speeds_of = getattr(self.controller, "rank_speeds", None)
        speeds = speeds_of() if callable(speeds_of) else None
        if speeds is None or self.machine_ids is None or len(speeds) != len(self.machine_ids):
            return None
        if not all(math.isfinite(s) and s > 0 for s in speeds):
            return None
        return [float(s) for s in speeds]

    def state_dict(self) -> dict[str, Any]:
        return {
            "controller": self.controller.state_dict(),
            "lr_scale": self.lr_scale,
            "base_global_batch": self.base_global_batch,
            "warned_not_finite": self._warned_not_finite,
            "machine_ids": self.machine_ids,
            "probes": {
                "out": self._out_for,
                "in": self._in_for,
                "wait": self._probe_wait,
                "probed": self._probed,
                "cost_wait": self._cost_wait,
                "time_per_sample": self._time_per_sample,
            },
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.controller.load_state_dict(state_dict["controller"])
        self.lr_scale = float(state_dict["lr_scale"])
        self.base_global_batch = state_dict["base_global_batch"]
        self._warned_not_finite = bool(state_dict.get("warned_not_finite", False))
        saved = state_dict.get("machine_ids")
        self.machine_ids = None if saved is None else [str(i) for i in saved]
        probes = state_dict.get("probes", {})
        self._out_for = [int(v) for v in probes.get("out", [])]
        self._in_for = [int(v) for v in probes.get("in", [])]
        self._probe_wait = [int(v) for v in probes.get("wait", [])]
        self._probed = [bool(v) for v in probes.get("probed", [])]
        self._cost_wait = [int(v) for v in probes.get("cost_wait", [])]
        self._time_per_sample = float(probes.get("time_per_sample", NAN))


def interval_metrics(record: IntervalRecord, log_per_rank: bool = True) -> dict[str, float]:
    """One decision point's ``dynamix/...`` metrics for loggers and trackers (what ``dynamix report`` reads)."""
    state = record.state
    metrics: dict[str, float] = {
        "dynamix/global_batch": float(state.global_batch),
        "dynamix/throughput": state.throughput,
        "dynamix/ideal_throughput": state.ideal_throughput,
        "dynamix/throughput_to_ideal": state.throughput / state.ideal_throughput,
        "dynamix/network_share": state.network_share,
        "dynamix/step_time": state.step_time,
        "dynamix/gradient_noise_scale": state.gradient_noise_scale,
        "dynamix/loss": state.loss,
        "dynamix/lr": state.lr,
        "dynamix/bandwidth": state.bandwidth,
    }
    if math.isfinite(state.padding):
        metrics["dynamix/padding"] = state.padding
    if record.decision is not None:
        metrics["dynamix/lr_scale"] = record.decision.lr_scale
        for rank, size in enumerate(record.decision.batch_sizes):
            metrics[f"dynamix/rank_{rank}/next_batch_size"] = float(size)
    if log_per_rank:
        for w in state.workers:
            prefix = f"dynamix/rank_{w.rank}"
            metrics[f"{prefix}/batch_size"] = float(w.batch_size)
            metrics[f"{prefix}/data_time"] = w.data_time
            metrics[f"{prefix}/compute_time"] = w.compute_time
            metrics[f"{prefix}/sync_wait"] = w.sync_wait
            metrics[f"{prefix}/step_time"] = w.step_time
            metrics[f"{prefix}/samples_per_s"] = w.samples_per_s
            metrics[f"{prefix}/own_samples_per_s"] = w.own_samples_per_s
            metrics[f"{prefix}/comm_time"] = w.comm_time
            if math.isfinite(w.work):
                metrics[f"{prefix}/work_per_s"] = w.work / w.step_time if w.step_time > 0 else NAN
                metrics[f"{prefix}/padding"] = w.padding
            metrics[f"{prefix}/cpu_util"] = w.cpu_util
            metrics[f"{prefix}/mem_util"] = w.mem_util
            if math.isfinite(w.gpu_util):
                metrics[f"{prefix}/gpu_util"] = w.gpu_util
                metrics[f"{prefix}/gpu_mem_util"] = w.gpu_mem_util
                metrics[f"{prefix}/gpu_power_w"] = w.gpu_power_w
                metrics[f"{prefix}/gpu_temperature_c"] = w.gpu_temperature_c
    return metrics


def _weighted_loss(pairs: list[tuple[float, float]]) -> float:
    """The global loss: ranks' interval means weighted by their batch sizes (ranks that sat out: none)."""
    pairs = [(b, v) for b, v in pairs if b > 0]
    finite = [(b, v) for b, v in pairs if math.isfinite(v)]
    if len(finite) != len(pairs) or not finite:
        return NAN
    return sum(b * v for b, v in finite) / sum(b for b, _ in finite)


class ReplicaBalancer:
    """A controller's sizes for the replicas of a fault-tolerant job; the same on every replica.

    (:mod:`lightning_dynamix.distributed.fault_tolerance`'s docstring says how the replicas use it.)

    Args:
        maker: the controller and its checks (``DynamixCallback.maker``), keyed by machine.
        interval: committed steps between two decisions, >= 1.
        warmup_steps: a replica's first steps in its process that are not measured (start-up is slow), >= 0.
        min_batch_size: the smallest size a decision gives a replica, >= 1 (a replica asks for a share: it
            cannot sit steps out).
        max_batch_size: the largest, or ``None``.
        history: where each decision's :class:`~lightning_dynamix.decisions.IntervalRecord` is appended.
    """

    def __init__(
        self,
        maker: DecisionMaker,
        interval: int = 10,
        warmup_steps: int = 5,
        min_batch_size: int = 1,
        max_batch_size: int | None = None,
        history: list[IntervalRecord] | None = None,
    ) -> None:
        require_int("interval", interval, 1)
        require_int("warmup_steps", warmup_steps, 0)
        require_int("min_batch_size", min_batch_size, 1)
        if max_batch_size is not None:
            require_int("max_batch_size", max_batch_size, min_batch_size)
        self.maker = maker
        self.interval = interval
        self.warmup_steps = warmup_steps
        self.min_batch_size = min_batch_size
        self.max_batch_size = max_batch_size
        self.history: list[IntervalRecord] = history if history is not None else []
        self.decided: dict[int, int] = {}
        """The latest decision: each machine's size, by :func:`machine_key`."""
        self._started = time.monotonic()

    def decide(self, step: int, epoch: int, keys: Sequence[int], measured: Sequence[tuple[float, int, int]]) -> bool:
        """At a decision step (``step`` a multiple of ``interval``) where every participant measured steps:
        the controller's decision for the participants ``keys`` from ``measured`` (each one's seconds over
        its measured steps, how many, at which size). Returns whether it decided (the replicas then start
        measuring afresh)."""
        if step == 0 or step % self.interval != 0 or any(steps < 1 for _, steps, _ in measured):
            return False
        workers = tuple(
            WorkerMetrics(
                rank=rank,
                batch_size=size,
                data_time=0.0,
                compute_time=seconds / steps,
                sync_wait=0.0,
                step_time=seconds / steps,
                samples_per_s=size * steps / seconds if seconds > 0 else math.nan,
            )
            for rank, (seconds, steps, size) in enumerate(measured)
        )
        state = ClusterState(
            workers=workers,
            step=step,
            epoch=epoch,
            min_batch_size=self.min_batch_size,
            max_batch_size=self.max_batch_size,
        )
        self.maker.join([str(key) for key in keys])
        current = [size for _, _, size in measured]
        decision = self.maker.propose(state, current)
        self.decided = {key: max(self.min_batch_size, int(size)) for key, size in zip(keys, decision.batch_sizes)}
        self.history.append(IntervalRecord(step, time.monotonic() - self._started, state, decision))
        return True

    def state_dict(self) -> dict[str, Any]:
        return {"maker": self.maker.state_dict(), "decided": {str(k): v for k, v in self.decided.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.maker.load_state_dict(state["maker"])
        self.decided = {int(k): int(v) for k, v in state["decided"].items()}
