"""Per-layer profiles of a model, from real timed runs: what the placement planner prices.

:func:`profile_model` runs the model once on an example batch with hooks on every leaf module, which
finds the layers in the order they execute and records each one's inputs; it then replays every
layer alone, forward and backward, on every device type asked for, and times it. A layer's profile
holds its forward+backward seconds per sample on each device type, its parameter bytes, the bytes
of its output per sample (what crosses to the next stage if the model is cut after it), and
whether it is sparse (an embedding lookup) or dense.

Timings are made to hold still, so that the same model profiled twice is planned the same way: every
timed sample runs a layer enough passes to last :data:`MIN_SAMPLE_SECONDS` (a lookup of a few
microseconds is not timed against the clock's own cost), the layers are timed in rounds, one sample of
each layer per round (a machine that slows down for a moment slows every layer alike, not the one
being timed), and each layer keeps the fastest of its samples (on an idle machine noise only adds
time). The spread of its samples (their interquartile range over the median) is kept beside it, so a
plan can say how far it trusts them. A table is timed with a sparse gradient, the rows its batch
touched, as an embedding server updates it.

Work done outside modules (``torch.cat``, a ``bmm`` written in ``forward``) belongs to no layer;
:attr:`ModelProfile.unattributed_seconds` says how much of the whole step that is.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import statistics
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from lightning_dynamix._checks import require_int, require_number

SPARSE_TYPES = (nn.Embedding, nn.EmbeddingBag)
MIN_SAMPLE_SECONDS = 2e-3  # a timed sample runs a layer this long at least
DEFAULT_REPEATS = 10  # timed samples of every layer, one per round
Forward = Callable[[nn.Module, Any], Tensor]


@dataclass(frozen=True)
class LayerProfile:
    """One layer (a leaf module) as measured.

    Attributes:
        name: the module's name in the model (``named_modules()``).
        kind: ``"sparse"`` for ``nn.Embedding`` / ``nn.EmbeddingBag``, ``"dense"`` otherwise.
        seconds: per device type (``"cpu"``, ``"cuda"``), forward+backward seconds per sample.
        parameter_bytes: bytes of the layer's parameters.
        activation_bytes: bytes of the layer's output per sample.
        calls: how many times one forward pass calls it (its seconds count every call).
        spread: per device type, the interquartile range of the timed samples over their median
            (0.05: the middle half of the samples lie within 5% of each other); empty if unknown.
    """

    name: str
    kind: str
    seconds: Mapping[str, float]
    parameter_bytes: int
    activation_bytes: int
    calls: int = 1
    spread: Mapping[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class RunnerProfile:
    """The offload runner's costs outside the layers, at one batch size (per step, or per row).

    Attributes:
        batch_size: samples per step the terms were measured at.
        step_seconds: the strategy's empty step: Lightning's loop and one lookup and push round trip.
        loader_seconds: reading one batch from the training DataLoader.
        optimizer_seconds: one step of the dense optimiser.
        rows: per table (layer name), the distinct rows one batch looks up.
        trainer_row_seconds: per distinct row looked up, the trainer's work: routing the ids,
            assembling the rows that come back, splitting their gradients per server.
        server_row_seconds: per distinct row, a server's work: its lookup and its update.
        request_seconds: what one more server adds to a step: its lookup and push round trip and its
            work per table (the empty step includes the first server's).
        server_table_seconds: of ``request_seconds``, the server's own work per table (a lookup and an
            update of one row of every table), which runs at its resource type's speed; the rest is
            the round trip and the trainer's work per server.
    """

    batch_size: int
    step_seconds: float
    loader_seconds: float
    optimizer_seconds: float
    rows: Mapping[str, float] = field(default_factory=dict)
    trainer_row_seconds: float = 0.0
    server_row_seconds: float = 0.0
    request_seconds: float = 0.0
    server_table_seconds: float = 0.0

    def summary(self) -> str:
        """The terms in one line, per step of :attr:`batch_size` samples (as ``dynamix plan`` prints them)."""
        return (
            f"loop and round trip {1e3 * self.step_seconds:.2f} ms, batch {1e3 * self.loader_seconds:.2f} ms,"
            f" dense optimizer {1e3 * self.optimizer_seconds:.2f} ms, a second server {1e3 * self.request_seconds:.2f}"
            f" ms (its tables {1e3 * self.server_table_seconds:.2f} ms); {sum(self.rows.values()):.0f} rows looked up"
            f" per batch at {1e6 * self.trainer_row_seconds:.2f} us each on the trainer"
            f" and {1e6 * self.server_row_seconds:.2f} us on a server"
        )

    def scaled(self, factor: float) -> RunnerProfile:
        """These terms on a machine ``factor`` times as slow: every time (``*_seconds``) multiplied by it, the
        rows as they are."""
        times = [f.name for f in dataclasses.fields(self) if f.name.endswith("_seconds")]
        return dataclasses.replace(self, **{name: getattr(self, name) * factor for name in times})

    @property
    def fixed_seconds(self) -> float:
        """What every step pays whatever the placement: the empty step, the batch and the dense optimiser."""
        return self.step_seconds + self.loader_seconds + self.optimizer_seconds

    def to_dict(self) -> dict[str, Any]:
        return {
            "batch_size": self.batch_size,
            "step_seconds": self.step_seconds,
            "loader_seconds": self.loader_seconds,
            "optimizer_seconds": self.optimizer_seconds,
            "rows": dict(self.rows),
            "trainer_row_seconds": self.trainer_row_seconds,
            "server_row_seconds": self.server_row_seconds,
            "request_seconds": self.request_seconds,
            "server_table_seconds": self.server_table_seconds,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RunnerProfile:
        return cls(
            batch_size=int(data["batch_size"]),
            step_seconds=float(data["step_seconds"]),
            loader_seconds=float(data["loader_seconds"]),
            optimizer_seconds=float(data["optimizer_seconds"]),
            rows={str(k): float(v) for k, v in data.get("rows", {}).items()},
            trainer_row_seconds=float(data.get("trainer_row_seconds", 0.0)),
            server_row_seconds=float(data.get("server_row_seconds", 0.0)),
            request_seconds=float(data.get("request_seconds", 0.0)),
            server_table_seconds=float(data.get("server_table_seconds", 0.0)),
        )


@dataclass(frozen=True)
class ModelProfile:
    """A model's layers in execution order, with the batch they were measured on.

    Attributes:
        layers: the layers, first executed first.
        batch_size: samples of the example batch.
        step_seconds: per device type, one whole forward+backward pass per sample, timed as a whole.
        step_spread: per device type, the spread of the whole pass's samples (as a layer's ``spread``).
        runner: what a step of LayerOffloadStrategy pays outside the layers
            (:func:`~lightning_dynamix.strategies.layer_offload.profile_runner`, beside the strategy), or None
            when not measured.
    """

    layers: tuple[LayerProfile, ...]
    batch_size: int
    step_seconds: Mapping[str, float] = field(default_factory=dict)
    step_spread: Mapping[str, float] = field(default_factory=dict)
    runner: RunnerProfile | None = None

    @property
    def devices(self) -> tuple[str, ...]:
        """The device types every layer was timed on."""
        return tuple(self.layers[0].seconds) if self.layers else ()

    def unattributed_seconds(self, device: str) -> float:
        """Seconds per sample of a whole pass on ``device`` that no layer accounts for (may be < 0 from noise)."""
        return self.step_seconds[device] - sum(layer.seconds[device] for layer in self.layers)

    def spread(self, device: str) -> float:
        """The spread of the layers' timings on ``device``, weighted by their seconds: how far the profile's
        total can be trusted (0.03: the middle half of a typical layer's samples lie within 3%)."""
        total = sum(layer.seconds[device] for layer in self.layers)
        weighted = sum(layer.seconds[device] * layer.spread.get(device, 0.0) for layer in self.layers)
        return weighted / total if total > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "batch_size": self.batch_size,
            "step_seconds": dict(self.step_seconds),
            "step_spread": dict(self.step_spread),
            "layers": [
                {**asdict(layer), "seconds": dict(layer.seconds), "spread": dict(layer.spread)} for layer in self.layers
            ],
            "runner": None if self.runner is None else self.runner.to_dict(),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ModelProfile:
        layers = tuple(LayerProfile(**layer) for layer in data["layers"])
        runner = data.get("runner")
        return cls(
            layers,
            int(data["batch_size"]),
            dict(data.get("step_seconds", {})),
            dict(data.get("step_spread", {})),
            None if runner is None else RunnerProfile.from_dict(runner),
        )

    def with_runner(self, runner: RunnerProfile | None) -> ModelProfile:
        """This profile with the runner's terms ``runner`` (measured at the same batch size)."""
        if runner is not None and runner.batch_size != self.batch_size:
            raise ValueError(
                f"the runner's terms were measured at batch size {runner.batch_size}, the layers at {self.batch_size}"
            )
        return dataclasses.replace(self, runner=runner)

    def scaled(self, factor: float) -> ModelProfile:
        """This profile as a machine ``factor`` times as slow would measure it: every time multiplied by
        ``factor`` (the layers', the whole passes', the runner's terms); bytes, calls, spreads and rows as they are.

        Raises:
            ValueError: for a factor that is not a positive number.
        """
        factor = require_number("factor", factor, 0.0, low_open=True)
        layers = tuple(
            dataclasses.replace(layer, seconds={device: s * factor for device, s in layer.seconds.items()})
            for layer in self.layers
        )
        return dataclasses.replace(
            self,
            layers=layers,
            step_seconds={device: s * factor for device, s in self.step_seconds.items()},
            runner=None if self.runner is None else self.runner.scaled(factor),
        )

    def save(self, path: str | Path) -> None:
        """Write the profile as JSON."""
        Path(path).write_text(json.dumps(self.to_dict(), indent=2))

    @classmethod
    def load(cls, path: str | Path) -> ModelProfile:
        """Read a profile written by :meth:`save`."""
        return cls.from_dict(json.loads(Path(path).read_text()))


def available_devices() -> tuple[str, ...]:
    """The device types of this machine: ``"cpu"``, and ``"cuda"`` where a GPU is."""
    return ("cpu", "cuda") if torch.cuda.is_available() else ("cpu",)


def default_forward(module: nn.Module, batch: Any) -> Tensor:
    """A LightningModule's ``training_step(batch, 0)``; otherwise the sum of ``module(batch)``."""
    if hasattr(module, "training_step"):
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r".*self\.log\(\).*")  # no Trainer while profiling
            output = module.training_step(batch, 0)
        if isinstance(output, Mapping):
            output = output["loss"]
        return output
    output = module(*batch) if isinstance(batch, (tuple, list)) else module(batch)
    return output.float().sum()


@dataclass
class LayerCall:
    """A leaf module's calls in one forward pass, as :func:`record_layer_calls` recorded them.

    Attributes:
        name: its name in the model (as in ``named_modules()``).
        module: the module.
        inputs: the inputs of its first call, detached copies.
        output: the output of its first call, detached.
        calls: how many times the forward pass called it.
    """

    name: str
    module: nn.Module
    inputs: tuple[Any, ...]
    output: Tensor
    calls: int = 1


def profile_model(
    module: nn.Module,
    example_batch: Any,
    devices: Sequence[str] | None = None,
    forward: Forward | None = None,
    repeats: int = DEFAULT_REPEATS,
    warmup: int = 2,
) -> ModelProfile:
    """Profile every layer of ``module`` on ``example_batch``, on each device type in ``devices``.

    Args:
        module: the model (left as it was: layers are timed on copies).
        example_batch: one batch, as the training step takes it; its first tensor's length is the
            batch size.
        devices: device types to time on; default :func:`available_devices`.
        forward: ``forward(module, batch) -> loss``; default :func:`default_forward`.
        repeats: timed samples per layer and device, one per round over the layers (the fastest is kept);
            a sample runs as many forward+backward passes as last :data:`MIN_SAMPLE_SECONDS`.
        warmup: untimed passes of each layer before them.

    Raises:
        ValueError: for a device type this machine does not have, a batch with no tensor, or a model
            that cannot run a forward and backward pass on the batch (with the error it raised).
    """
    devices = tuple(devices) if devices is not None else available_devices()
    for device in devices:
        if device not in available_devices():
            raise ValueError(f"`devices` includes {device!r}; this machine has {list(available_devices())}")
    require_int("repeats", repeats, 1)
    require_int("warmup", warmup, 0)
    forward = forward or default_forward
    batch_size = batch_size_of(example_batch)
    calls = record_layer_calls(module, example_batch, forward)
    if not calls:
        raise ValueError(f"{type(module).__name__} called no leaf module on the example batch: nothing to profile")
    # per device: every layer's pass, and the whole step's last, timed together in rounds
    timed = {}
    for device in devices:
        passes = [_layer_pass(call, device) for call in calls] + [_step_pass(module, example_batch, forward, device)]
        timed[device] = time_passes(passes, device, repeats, warmup)
    layers = []
    for index, call in enumerate(calls):
        layers.append(
            LayerProfile(
                name=call.name,
                kind="sparse" if isinstance(call.module, SPARSE_TYPES) else "dense",
                seconds={device: call.calls * timed[device][index][0] / batch_size for device in devices},
                parameter_bytes=sum(p.numel() * p.element_size() for p in call.module.parameters()),
                activation_bytes=call.output.numel() * call.output.element_size() // batch_size,
                calls=call.calls,
                spread={device: timed[device][index][1] for device in devices},
            )
        )
    step = {device: timed[device][-1][0] / batch_size for device in devices}
    step_spread = {device: timed[device][-1][1] for device in devices}
    return ModelProfile(tuple(layers), batch_size, step, step_spread)


def layer_names(module: nn.Module, example_batch: Any, forward: Forward | None = None) -> tuple[str, ...]:
    """The layers :func:`profile_model` would time, in execution order (one forward and backward pass, untimed):
    what a saved profile must list to be planned for ``module``."""
    return tuple(call.name for call in record_layer_calls(module, example_batch, forward or default_forward))


def batch_size_of(batch: Any) -> int:
    """Samples in ``batch``: the length of its first tensor with a batch dimension (in tuples, lists and dicts).

    Raises:
        ValueError: for a batch with no such tensor.
    """
    tensors = [t for t in _flatten(batch) if isinstance(t, Tensor) and t.dim() > 0]
    if not tensors:
        raise ValueError(f"`example_batch` holds no tensor with a batch dimension: {type(batch).__name__}")
    return int(tensors[0].shape[0])


def _flatten(value: Any) -> list[Any]:
    if isinstance(value, Mapping):
        return [x for v in value.values() for x in _flatten(v)]
    if isinstance(value, (tuple, list)):
        return [x for v in value for x in _flatten(v)]
    return [value]


def record_layer_calls(module: nn.Module, batch: Any, forward: Forward) -> list[LayerCall]:
    """The leaf modules of ``module`` that one forward pass of ``forward(module, batch)`` calls, in the order it
    first calls them, with their inputs and outputs (a module whose output is not one tensor is left out). The
    pass runs backward too (and its gradients are cleared), so that a model that cannot train fails here.

    Raises:
        ValueError: for a model that cannot run a forward and backward pass on ``batch``, with the error it raised.
    """
    calls: dict[int, LayerCall] = {}
    names = {id(m): name for name, m in module.named_modules()}

    def record(leaf: nn.Module, inputs: tuple[Any, ...], output: Any) -> None:
        if not isinstance(output, Tensor):
            return  # a layer whose output is not one tensor cannot be cut after; its time stays unattributed
        key = id(leaf)
        if key in calls:
            calls[key].calls += 1
        else:
            kept = tuple(_kept(x) for x in inputs)
            calls[key] = LayerCall(names[key], leaf, kept, output.detach())

    leaves = [m for m in module.modules() if not list(m.children())]
    handles = [leaf.register_forward_hook(record) for leaf in leaves]
    try:
        loss = forward(module, batch)
        loss.backward()
    except Exception as error:
        raise ValueError(
            f"{type(module).__name__} cannot run a forward and backward pass on `example_batch`"
            f" ({type(error).__name__}: {error}); give a batch as its training step takes it, or `forward`"
        ) from error
    finally:
        for handle in handles:
            handle.remove()
        module.zero_grad(set_to_none=True)
    return list(calls.values())


def _kept(value: Any) -> Any:
    return value.detach().clone().requires_grad_(value.requires_grad) if isinstance(value, Tensor) else value


def _layer_pass(call: LayerCall, device: str) -> Callable[[], None]:
    layer = copy.deepcopy(call.module).to(device)
    if isinstance(layer, SPARSE_TYPES) and _sparse_gradient_allowed(layer):
        # a table's step is its lookup and the gradient of the rows the batch touched (what an embedding
        # server updates), not a zero-filled gradient of the whole table: that costs as much as the table
        # is large, and its time moved by 15-25% from one profile to the next
        layer.sparse = True
    inputs = tuple(
        x.detach().to(device).requires_grad_(x.requires_grad) if isinstance(x, Tensor) else x for x in call.inputs
    )
    grad = torch.ones_like(call.output, device=device)

    def one_pass() -> None:
        output = layer(*inputs)
        if output.requires_grad:
            output.backward(grad)
        layer.zero_grad(set_to_none=True)

    return one_pass


def _sparse_gradient_allowed(layer: nn.Module) -> bool:
    """Whether torch computes ``layer``'s gradient as a sparse one (not with ``scale_grad_by_freq`` nor a max bag)."""
    return not layer.scale_grad_by_freq and getattr(layer, "mode", "sum") != "max"


def _step_pass(module: nn.Module, batch: Any, forward: Forward, device: str) -> Callable[[], None]:
    model = copy.deepcopy(module).to(device)
    for layer in model.modules():
        if isinstance(layer, SPARSE_TYPES) and _sparse_gradient_allowed(layer):
            layer.sparse = True  # as the tables are timed alone: what is left over is work no layer does
    moved = _to(batch, device)

    def one_pass() -> None:
        forward(model, moved).backward()
        model.zero_grad(set_to_none=True)

    return one_pass


def time_passes(
    passes: Sequence[Callable[[], None]], device: str, repeats: int, warmup: int
) -> list[tuple[float, float]]:
    """Seconds of one pass of each of ``passes`` on ``device`` (``"cpu"`` or ``"cuda"``), the fastest of
    ``repeats`` rounds of one sample of each, after ``warmup`` untimed passes, and the spread of its samples.

    A sample runs the pass back to back for :data:`MIN_SAMPLE_SECONDS` (on a GPU, queued without
    synchronising: synchronising after every pass would time the launch latency of small kernels, not
    their throughput) and counts its mean. The fastest sample is kept: on an idle machine, noise only
    adds time.
    """
    counts = []
    for one_pass in passes:
        for _ in range(warmup):
            one_pass()
        once = _sample(one_pass, 1, device)
        counts.append(max(1, min(10_000, math.ceil(MIN_SAMPLE_SECONDS / max(once, 1e-9)))))
    samples: list[list[float]] = [[] for _ in passes]
    for _ in range(repeats):
        for one_pass, count, kept in zip(passes, counts, samples):
            kept.append(_sample(one_pass, count, device))
    return [(min(kept), _spread(kept)) for kept in samples]


def _sample(one_pass: Callable[[], None], count: int, device: str) -> float:
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(count):
        one_pass()
    if device == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / count


def _spread(samples: Sequence[float]) -> float:
    """The interquartile range of ``samples`` over their median; 0 for fewer than two."""
    if len(samples) < 2:
        return 0.0
    lower, _, upper = statistics.quantiles(samples, n=4, method="inclusive")
    return (upper - lower) / statistics.median(samples)


def _to(value: Any, device: str) -> Any:
    if isinstance(value, Tensor):
        return value.to(device)
    if isinstance(value, Mapping):
        return {k: _to(v, device) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return type(value)(_to(v, device) for v in value)
    return value
