"""What one decision sees: every rank's measurements over an interval, and the encoding policies read.

:class:`WorkerMetrics` is one rank over one decision interval (means over the interval's steps),
:class:`ClusterState` is all ranks plus the job's global signals. Both are small frozen values:
the real callback builds them from measurements, the cluster simulator builds the same type, so
a controller or a policy cannot tell the two apart. :meth:`ClusterState.observation` is the one
numeric encoding every learned policy reads.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from functools import cached_property

import numpy as np

NAN = float("nan")


@dataclass(frozen=True)
class WorkerMetrics:
    """One rank over one decision interval; times are means per step, in seconds.

    Attributes:
        rank: global rank.
        batch_size: the rank's batch size (samples) in the interval's last step.
        data_time: waiting for the DataLoader.
        compute_time: this rank's own forward and backward, up to its last gradient bucket being
            ready (for a step that does not synchronise, up to the end of backward); excludes any
            wait for other ranks.
        sync_wait: from the last bucket being ready to the end of backward: waiting for the
            all-reduce, which includes waiting for slower ranks.
        step_time: from one batch end to the next (data, compute, synchronisation, optimizer).
        samples_per_s: the rank's samples over the interval divided by its wall time.
        cpu_util: CPU utilisation of the machine, percent (0-100 per core summed over cores / cores).
        mem_util: memory in use on the machine, percent.
        gpu_util: utilisation of the rank's GPU, percent; NaN without a GPU.
        gpu_mem_util: memory in use on the rank's GPU, percent; NaN without a GPU.
        gpu_power_w: power draw of the rank's GPU, watts; NaN without a GPU.
        gpu_temperature_c: temperature of the rank's GPU, degrees Celsius; NaN without a GPU.
        comm_time: time with at least one gradient all-reduce in flight, per synchronising step.
        comm_bytes: gradient bytes all-reduced per synchronising step.
        bandwidth: comm_bytes / comm_time, bytes per second; NaN when nothing was all-reduced.
        cpu_time: CPU seconds used per step, charged to the rank's CPU quota where it has one (its
            cgroup's counter), else the process's own.
        cpu_quota: the rank's CPU quota (cgroup CFS bandwidth), cores of CPU time per second; NaN
            without one.
        least_sync_wait: the least ``sync_wait`` of any synchronising step in the interval (not a
            mean): the bare transfer at a step no rank was late for.
        max_batch_size: the largest batch this rank can train, samples: what its device memory holds
            (measured), a cap given for its machine, or a size lowered after it ran out of memory; NaN
            for no limit of its own. Every controller's decision keeps within it.
        work: the rank's work per step, where its samples differ in size: a language model's token positions
            (padding included) with ``count_items`` (:class:`~lightning_dynamix.data.items.LabelTokens`), else
            the items it counts; NaN where nothing is counted. Controllers judge step times per unit of work
            (:meth:`ClusterState.at_mean_work`), so a rank that drew long sequences does not look slow.
        padding: the fraction of ``work`` that was padding, in [0, 1]; NaN where not known.
    """

    rank: int
    batch_size: int
    data_time: float = NAN
    compute_time: float = NAN
    sync_wait: float = NAN
    step_time: float = NAN
    samples_per_s: float = NAN
    cpu_util: float = NAN
    mem_util: float = NAN
    gpu_util: float = NAN
    gpu_mem_util: float = NAN
    gpu_power_w: float = NAN
    gpu_temperature_c: float = NAN
    comm_time: float = NAN
    comm_bytes: float = NAN
    bandwidth: float = NAN
    cpu_time: float = NAN
    cpu_quota: float = NAN
    least_sync_wait: float = NAN
    max_batch_size: float = NAN
    work: float = NAN
    padding: float = NAN

    @property
    def own_step_time(self) -> float:
        """The rank's step without waiting for the all-reduce: ``step_time - sync_wait``, seconds."""
        return self.step_time - self.sync_wait

    @property
    def quota_step_time(self) -> float:
        """The shortest step the rank's CPU quota allows on average: ``cpu_time / cpu_quota``, seconds; NaN without one.

        A rank that used up its quota is frozen until the next period, also while the others wait for
        it in a collective, so over an interval it cannot step faster than this however its step's
        parts are timed.
        """
        return self.cpu_time / self.cpu_quota if self.cpu_quota > 0 else NAN

    @property
    def own_samples_per_s(self) -> float:
        """The rank's speed without any all-reduce: samples per second of data loading, compute and optimizer step.

        The ideal throughput adds the transfer that every rank pays (:attr:`ClusterState.rank_speeds`).
        """
        own = self.own_step_time
        return self.batch_size / own if own > 0 else NAN

    @classmethod
    def float_fields(cls) -> tuple[str, ...]:
        """Names of the measured fields (everything but ``rank`` and ``batch_size``), in order."""
        return tuple(f.name for f in fields(cls) if f.name not in ("rank", "batch_size"))


# what the plots call ClusterState.ideal_throughput
IDEAL_LABEL = "ideal: ranks finishing together, all-reduce included"

# names of the columns of ClusterState.observation(); the order is part of the policy file format
LOCAL_FEATURES: tuple[str, ...] = (
    "log2_batch_share",  # log2(b_r / mean b)
    "relative_compute_time",  # compute_r / mean compute - 1
    "relative_own_speed",  # s_r / mean s - 1
    "data_fraction",  # data_time / step_time
    "sync_wait_fraction",  # sync_wait / step_time
    "comm_fraction",  # comm_time / step_time
    "cpu_util",  # fraction
    "mem_util",  # fraction
    "gpu_util",  # fraction, 0 without a GPU
    "gpu_mem_util",  # fraction, 0 without a GPU
    "log2_batch_to_max",  # log2(b_r / the rank's largest size: ClusterState.batch_size_caps), 0 without a bound
)
GLOBAL_FEATURES: tuple[str, ...] = (
    "log2_world_size",
    "log2_global_batch",
    "log10_noise_scale_to_batch",  # log10(B_noise / global batch), 0 when unknown
    "noise_scale_known",
    "log1p_loss",
    "relative_loss_slope",  # loss slope per step * 100 / loss
    "throughput_to_ideal",  # sum b / step time over sum_r s_r
    "log10_bandwidth",  # log10(bytes/s) - 9, 0 when unknown
    "has_gpu",
)


def loss_slope(points: Sequence[tuple[int, float]]) -> float:
    """Least-squares change of the loss per optimizer step over ``(step, loss)`` points; NaN for fewer than 2 steps."""
    if len(points) < 2:
        return NAN
    xs = [float(s) for s, _ in points]
    ys = [float(v) for _, v in points]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var > 0 else NAN


# the WorkerMetrics fields observation() reads
_OBSERVED = (
    "data_time",
    "compute_time",
    "sync_wait",
    "step_time",
    "comm_time",
    "cpu_util",
    "mem_util",
    "gpu_util",
    "gpu_mem_util",
)


def _finite(value: float, default: float = 0.0) -> float:
    return value if math.isfinite(value) else default


@dataclass(frozen=True)
class ClusterState:
    """Every rank's :class:`WorkerMetrics` over one interval, plus the job's global signals.

    Attributes:
        workers: one entry per rank, in rank order.
        step: the optimizer step (``trainer.global_step``) at which the state was gathered.
        epoch: the epoch at which the state was gathered.
        loss: the training loss averaged over the interval (NaN if not known).
        loss_slope: change of the loss per optimizer step over recent intervals (NaN if not known).
        gradient_noise_scale: the simple noise scale B_noise in samples (NaN if not known).
        lr: the learning rate of the first parameter group (NaN if not known).
        min_batch_size: the smallest size any rank may be given.
        max_batch_size: the largest size any rank may be given; ``None`` for no limit.
        least_batch_size: the smallest size a rank that trains may be given (with ``min_batch_size=0``,
            the sizes between 0 and this are not allowed): 2 for a model with BatchNorm.
    """

    workers: tuple[WorkerMetrics, ...]
    step: int = 0
    epoch: int = 0
    loss: float = NAN
    loss_slope: float = NAN
    gradient_noise_scale: float = NAN
    lr: float = NAN
    min_batch_size: int = 1
    max_batch_size: int | None = None
    least_batch_size: int = 1

    def __post_init__(self) -> None:
        if not self.workers:
            raise ValueError("`workers` must hold one WorkerMetrics per rank, got none")
        ranks = [w.rank for w in self.workers]
        if ranks != list(range(len(ranks))):
            raise ValueError(f"`workers` must be in rank order 0..{len(ranks) - 1}, got ranks {ranks}")

    @property
    def world_size(self) -> int:
        return len(self.workers)

    @property
    def batch_size_caps(self) -> tuple[int | None, ...]:
        """Per rank, the largest size it may be given: the tighter of ``max_batch_size`` and the rank's own
        (:attr:`WorkerMetrics.max_batch_size`: its memory); ``None`` for no limit."""
        caps: list[int | None] = []
        for worker in self.workers:
            given = (self.max_batch_size, worker.max_batch_size)
            limits = [int(c) for c in given if c is not None and math.isfinite(c)]
            caps.append(max(1, min(limits)) if limits else None)
        return tuple(caps)

    @cached_property
    def batch_sizes(self) -> tuple[int, ...]:
        return tuple(w.batch_size for w in self.workers)

    @cached_property
    def global_batch(self) -> int:
        return sum(self.batch_sizes)

    @cached_property
    def work_per_sample(self) -> float:
        """The interval's mean work per sample over the ranks that trained (token positions per sequence); NaN unless
        every rank that trained counted its work (and it was positive)."""
        trained = [w for w in self.workers if w.batch_size > 0]
        if not trained or not all(math.isfinite(w.work) and w.work > 0 for w in trained):
            return NAN
        return sum(w.work for w in trained) / sum(w.batch_size for w in trained)

    def work_factors(self, per_sample: float | None = None) -> tuple[float, ...]:
        """Per rank, what its times are multiplied by to stand for a batch of samples of ``per_sample`` work each.

        ``b_r * per_sample / w_r``, ``w_r`` a rank's :attr:`WorkerMetrics.work` per step and ``per_sample`` by default
        the interval's :attr:`work_per_sample`: a rank that drew longer sequences than that did more work for its
        samples, and its time divided by that much is what its size costs it on average. 1.0 for every rank where
        the work was not counted.
        """
        reference = self.work_per_sample if per_sample is None else per_sample
        if not (math.isfinite(self.work_per_sample) and math.isfinite(reference) and reference > 0):
            return (1.0,) * self.world_size
        return tuple(w.batch_size * reference / w.work if w.batch_size > 0 else 1.0 for w in self.workers)

    def at_mean_work(self, per_sample: float | None = None) -> ClusterState:
        """This interval as if every rank had drawn samples of ``per_sample`` work each: what controllers decide on.

        Each rank's data, compute and CPU times are multiplied by its :meth:`work_factors`, its own step with them;
        the step then ends when the latest of them does, plus the transfer every rank waits for
        (:attr:`transfer_time`), and each rank's ``sync_wait`` is the rest of that step. A controller's step-time
        model (a fixed cost and a cost per sample) is then one per unit of work, and the sizes it chooses do not
        follow the lengths each rank happened to draw. ``per_sample`` is best the job's long-run mean
        (:class:`MeanWork`): the interval's own mean (the default) moves from one interval to the next with the
        lengths drawn. ``self`` where the work was not counted.
        """
        factors = self.work_factors(per_sample)
        if all(f == 1.0 for f in factors):
            return self
        transfer = self.transfer_time
        own = [w.own_step_time * f for w, f in zip(self.workers, factors)]
        finite = [t for t in own if math.isfinite(t)]
        step = (max(finite) if finite else NAN) + transfer
        workers = tuple(
            replace(
                w,
                data_time=w.data_time * f,
                compute_time=w.compute_time * f,
                cpu_time=w.cpu_time * f,
                step_time=step,
                sync_wait=step - t,
                samples_per_s=w.batch_size / step if step > 0 else NAN,
                work=w.work * f,
            )
            for w, f, t in zip(self.workers, factors, own)
        )
        return replace(self, workers=workers)

    @cached_property
    def padding(self) -> float:
        """The fraction of the job's work (token positions) that was padding, in [0, 1]; NaN where not known."""
        trained = [w for w in self.workers if w.batch_size > 0]
        if not trained or not all(math.isfinite(w.work) and math.isfinite(w.padding) for w in trained):
            return NAN
        total = sum(w.work for w in trained)
        return sum(w.work * w.padding for w in trained) / total if total > 0 else NAN

    @cached_property
    def step_time(self) -> float:
        """The job's step time: the slowest rank's (all ranks wait for it in the all-reduce)."""
        return max(w.step_time for w in self.workers)

    @cached_property
    def throughput(self) -> float:
        """Achieved samples per second of the whole job."""
        step = self.step_time
        return self.global_batch / step if step > 0 else NAN

    @cached_property
    def transfer_time(self) -> float:
        """The all-reduce time no batch split can remove, seconds per step: the least ``sync_wait`` of any rank.

        The rank that is ready last waits only for the transfer itself; every other rank also waits
        for it. Averaged over an interval, a rank that is last only most of the time also waits for
        the others' random jitter now and then, so with ranks of equal speed this slightly
        overestimates the transfer. 0 when no rank measured its wait.
        """
        waits = [w.sync_wait for w in self.workers if math.isfinite(w.sync_wait)]
        return max(0.0, min(waits)) if waits else 0.0

    @cached_property
    def bare_transfer_time(self) -> float:
        """The all-reduce alone, seconds per step: the least wait of any rank at any step of the interval.

        :attr:`transfer_time` is a least mean, and a mean also holds the steps at which a rank was late
        or frozen by its CPU quota inside the collective; the least single step
        (:attr:`WorkerMetrics.least_sync_wait`) holds neither. :attr:`transfer_time` where no rank
        measured it.
        """
        least = [w.least_sync_wait for w in self.workers if math.isfinite(w.least_sync_wait)]
        return max(0.0, min(least)) if least else self.transfer_time

    @cached_property
    def rank_speeds(self) -> tuple[float, ...]:
        """``s_r`` per rank: samples per second the rank would reach if it never waited for another rank.

        ``b_r / (step_time_r - sync_wait_r + transfer_time)``: the rank's own data loading,
        compute and optimizer step, plus the transfer every rank pays (:attr:`transfer_time`).
        Equal batches at equal speeds therefore run at their ideal, and a job whose ranks all finish
        their own work together reaches ``sum_r s_r``. NaN for a rank whose own time is not positive.
        """
        transfer = self.transfer_time
        return tuple(
            w.batch_size / (w.own_step_time + transfer) if w.own_step_time + transfer > 0 else NAN for w in self.workers
        )

    @cached_property
    def ideal_throughput(self) -> float:
        """``sum_r s_r`` (:attr:`rank_speeds`): what the job would achieve if no rank ever waited for another.

        The ideal of this global batch on these links: each rank's own work plus the all-reduce's exposed time
        (:attr:`transfer_time`: what the last rank to arrive waits, so the part of the all-reduce that overlaps
        the backward pass is not counted where the run overlaps it). Throughput against it is what the split
        loses; :attr:`network_share` is how much of the ideal step is the all-reduce, which no split removes.
        """
        return sum(self.rank_speeds)

    @cached_property
    def network_share(self) -> float:
        """The all-reduce's share of the ideal step, in [0, 1]: :attr:`transfer_time` over ``global_batch /
        ideal_throughput``; NaN where the ideal is not known.

        Near 0 where the network is fast beside the compute, near 1 where a link bounds every step. Beside
        ``throughput / ideal`` it tells the two losses apart: a job at 0.97 of its ideal with a share of 0.96 is
        balanced and link-bound, and only fewer all-reduces per sample (a larger global batch) or a faster link
        speeds it up. ``throughput / ideal * (1 - network_share)`` is, with ranks balanced, the job's throughput
        against its ranks' compute alone (the all-reduce free), which means the same on any link.
        """
        ideal = self.ideal_throughput
        if not (math.isfinite(ideal) and ideal > 0):
            return NAN
        return min(1.0, self.transfer_time * ideal / self.global_batch)

    @cached_property
    def bandwidth(self) -> float:
        """The best all-reduce bandwidth any rank measured, bytes per second (NaN if none).

        The rank that reaches the all-reduce last waits least, so its figure is closest to the
        network's own.
        """
        values = [w.bandwidth for w in self.workers if math.isfinite(w.bandwidth)]
        return max(values) if values else NAN

    def is_finite(self, names: Sequence[str] = ("data_time", "compute_time", "step_time")) -> bool:
        """Whether the given fields are finite on every rank and every rank that trained took time.

        A rank that sat the interval out (batch size 0) may report a step of no time: on a GPU its step's first
        and last marks can lie together on a stream it queued nothing on.
        """
        return not self.not_finite_ranks(names)

    def not_finite_ranks(self, names: Sequence[str] = ("data_time", "compute_time", "step_time")) -> list[int]:
        """The ranks whose given fields are not all finite, or that trained and report a step of no time."""
        return [
            w.rank
            for w in self.workers
            if not all(math.isfinite(getattr(w, n)) for n in names) or (w.step_time <= 0 and w.batch_size > 0)
        ]

    def observation(self) -> dict[str, np.ndarray]:
        """The encoding every policy reads: scale-free, finite, float32.

        Returns:
            ``{"ranks": (world_size, len(LOCAL_FEATURES)), "cluster": (len(GLOBAL_FEATURES),)}``;
            unknown values (NaN: no GPU, no noise-scale estimate yet) encode as 0.
        """
        sizes = np.array(self.batch_sizes, dtype=np.float64)
        table = np.array([[getattr(w, name) for name in _OBSERVED] for w in self.workers], dtype=np.float64)
        column = dict(zip(_OBSERVED, table.T))
        compute = column["compute_time"]
        own_step = column["step_time"] - column["sync_wait"]
        with np.errstate(divide="ignore", invalid="ignore"):
            speeds = np.where(own_step > 0, sizes / own_step, NAN)
            mean_compute = np.nanmean(compute) if np.isfinite(compute).any() else NAN
            mean_speed = np.nanmean(speeds) if np.isfinite(speeds).any() else NAN
            step = np.where(column["step_time"] > 0, column["step_time"], NAN)
            caps = np.array([NAN if c is None else c for c in self.batch_size_caps], dtype=np.float64)
            rows = np.stack(
                [
                    np.log2(sizes / sizes.mean()),
                    compute / mean_compute - 1.0,
                    speeds / mean_speed - 1.0,
                    column["data_time"] / step,
                    column["sync_wait"] / step,
                    column["comm_time"] / step,
                    column["cpu_util"] / 100.0,
                    column["mem_util"] / 100.0,
                    column["gpu_util"] / 100.0,
                    column["gpu_mem_util"] / 100.0,
                    np.log2(sizes / caps),
                ],
                axis=1,
            )
        rows = np.where(np.isfinite(rows), rows, 0.0)
        noise = self.gradient_noise_scale
        noise_known = math.isfinite(noise) and noise > 0
        ideal = self.ideal_throughput
        bandwidth = self.bandwidth
        cluster = [
            math.log2(self.world_size),
            math.log2(self.global_batch),
            math.log10(noise / self.global_batch) if noise_known else 0.0,
            1.0 if noise_known else 0.0,
            _finite(math.log1p(max(self.loss, 0.0))) if math.isfinite(self.loss) else 0.0,
            _finite(100.0 * self.loss_slope / self.loss) if math.isfinite(self.loss) and self.loss > 0 else 0.0,
            _finite(self.throughput / ideal) if ideal > 0 else 0.0,
            math.log10(bandwidth) - 9.0 if math.isfinite(bandwidth) and bandwidth > 0 else 0.0,
            1.0 if any(math.isfinite(w.gpu_util) for w in self.workers) else 0.0,
        ]
        return {
            "ranks": np.clip(rows.astype(np.float32), -10.0, 10.0),
            "cluster": np.clip(np.asarray(cluster, dtype=np.float32), -10.0, 10.0),
        }


class MeanWork:
    """The job's mean work per sample over every interval seen (token positions per sequence): the reference a
    controller judges each interval's times at (:meth:`ClusterState.at_mean_work`), steadier than one interval's.

    A state whose ranks drew alike work per sample (data of one length, or a state already judged at a mean) is
    taken as it is and not added, so a controller that hands its judged state to another (PPO's balancer) is
    judged once.
    """

    def __init__(self) -> None:
        self.work = 0.0
        self.samples = 0.0

    def observe(self, state: ClusterState) -> ClusterState:
        """Add ``state``'s work and return it at the mean work per sample so far (``state`` where none is counted)."""
        if all(f == 1.0 for f in state.work_factors()):
            return state
        trained = [w for w in state.workers if w.batch_size > 0]
        self.work += sum(w.work for w in trained)
        self.samples += sum(w.batch_size for w in trained)
        return state.at_mean_work(self.work / self.samples)

    def state_dict(self) -> dict[str, float]:
        return {"work": self.work, "samples": self.samples}

    def load_state_dict(self, state_dict: dict[str, float]) -> None:
        self.work = float(state_dict.get("work", 0.0))
        self.samples = float(state_dict.get("samples", 0.0))
