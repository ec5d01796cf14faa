"""Per-layer profiles of a model, from real timed runs: what the placement planner prices.

:func:`profile_model` runs the model once on an example batch with hooks on every leaf module, which
finds the layers in the order they execute and records each one's inputs; it then replays every
layer alone, forward and backward, on every device type asked for, and times it. A layer's profile
holds its forward+backward seconds per sample on each device type, its parameter bytes, the bytes
of its output per sample (what crosses to the next stage if the model is cut after it), and
whether it is sparse (an embedding lookup) or dense.

Work done outside modules (``torch.cat``, a ``bmm`` written in ``forward``) belongs to no layer;
:attr:`ModelProfile.unattributed_seconds` says how much of the whole step that is.
"""

from __future__ import annotations

import copy
import json
import statistics
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from lightning_dynamix._checks import require_int

SPARSE_TYPES = (nn.Embedding, nn.EmbeddingBag)
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
    """

    name: str
    kind: str
    seconds: Mapping[str, float]
    parameter_bytes: int
    activation_bytes: int
    calls: int = 1


@dataclass(frozen=True)
class ModelProfile:
    """A model's layers in execution order, with the batch they were measured on.

    Attributes:
        layers: the layers, first executed first.
        batch_size: samples of the example batch.
        step_seconds: per device type, one whole forward+backward pass per sample, timed as a whole.
    """

    layers: tuple[LayerProfile, ...]
    batch_size: int
    step_seconds: Mapping[str, float] = field(default_factory=dict)

    @property
    def devices(self) -> tuple[str, ...]:
        """The device types every layer was timed on."""
        return tuple(self.layers[0].seconds) if self.layers else ()

    def unattributed_seconds(self, device: str) -> float:
        """Seconds per sample of a whole pass on ``device`` that no layer accounts for (may be < 0 from noise)."""
        return self.step_seconds[device] - sum(layer.seconds[device] for layer in self.layers)

    def to_dict(self) -> dict[str, Any]:
        return {"batch_size": self.batch_size, "step_seconds": dict(self.step_seconds), "layers": [
            {**asdict(layer), "seconds": dict(layer.seconds)} for layer in self.layers
        ]}  # fmt: skip

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ModelProfile:
        layers = tuple(LayerProfile(**layer) for layer in data["layers"])
        return cls(layers, int(data["batch_size"]), dict(data.get("step_seconds", {})))

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
class _Call:
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
    repeats: int = 10,
    warmup: int = 2,
) -> ModelProfile:
    """Profile every layer of ``module`` on ``example_batch``, on each device type in ``devices``.

    Args:
        module: the model (left as it was: layers are timed on copies).
        example_batch: one batch, as the training step takes it; its first tensor's length is the
            batch size.
        devices: device types to time on; default :func:`available_devices`.
        forward: ``forward(module, batch) -> loss``; default :func:`default_forward`.
        repeats: timed forward+backward passes per layer and device (the median is kept).
        warmup: untimed passes before them.

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
    batch_size = _batch_size(example_batch)
    calls = _record_calls(module, example_batch, forward)
    if not calls:
        raise ValueError(f"{type(module).__name__} called no leaf module on the example batch: nothing to profile")
    layers = []
    for call in calls:
        seconds = {device: call.calls * _time_layer(call, device, repeats, warmup) / batch_size for device in devices}
        layers.append(
            LayerProfile(
                name=call.name,
                kind="sparse" if isinstance(call.module, SPARSE_TYPES) else "dense",
                seconds=seconds,
                parameter_bytes=sum(p.numel() * p.element_size() for p in call.module.parameters()),
                activation_bytes=call.output.numel() * call.output.element_size() // batch_size,
                calls=call.calls,
            )
        )
    step = {d: _time_step(module, example_batch, forward, d, repeats, warmup) / batch_size for d in devices}
    return ModelProfile(tuple(layers), batch_size, step)


def layer_names(module: nn.Module, example_batch: Any, forward: Forward | None = None) -> tuple[str, ...]:
    """The layers :func:`profile_model` would time, in execution order (one forward and backward pass, untimed):
    what a saved profile must list to be planned for ``module``."""
    return tuple(call.name for call in _record_calls(module, example_batch, forward or default_forward))


def _batch_size(batch: Any) -> int:
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


def _record_calls(module: nn.Module, batch: Any, forward: Forward) -> list[_Call]:
    calls: dict[int, _Call] = {}
    names = {id(m): name for name, m in module.named_modules()}

    def record(leaf: nn.Module, inputs: tuple[Any, ...], output: Any) -> None:
        if not isinstance(output, Tensor):
            return  # a layer whose output is not one tensor cannot be cut after; its time stays unattributed
        key = id(leaf)
        if key in calls:
            calls[key].calls += 1
        else:
            kept = tuple(_kept(x) for x in inputs)
            calls[key] = _Call(names[key], leaf, kept, output.detach())

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


def _time_layer(call: _Call, device: str, repeats: int, warmup: int) -> float:
    layer = copy.deepcopy(call.module).to(device)
    inputs = tuple(
        x.detach().to(device).requires_grad_(x.requires_grad) if isinstance(x, Tensor) else x for x in call.inputs
    )
    grad = torch.ones_like(call.output, device=device)

    def one_pass() -> None:
        output = layer(*inputs)
        if output.requires_grad:
            output.backward(grad)
        layer.zero_grad(set_to_none=True)

    return _timed(one_pass, device, repeats, warmup)


def _timed(one_pass: Callable[[], None], device: str, repeats: int, warmup: int) -> float:
    """Seconds of one pass: the median of single passes on the CPU; on a GPU, the mean of ``repeats``
    passes queued back to back (synchronising after every pass would time the launch latency of
    small kernels, not their throughput)."""
    for _ in range(warmup):
        one_pass()
    if device == "cuda":
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(repeats):
            one_pass()
        torch.cuda.synchronize()
        return (time.perf_counter() - start) / repeats
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        one_pass()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _time_step(module: nn.Module, batch: Any, forward: Forward, device: str, repeats: int, warmup: int) -> float:
    model = copy.deepcopy(module).to(device)
    moved = _to(batch, device)

    def one_pass() -> None:
        forward(model, moved).backward()
        model.zero_grad(set_to_none=True)

    return _timed(one_pass, device, repeats, warmup)


def _to(value: Any, device: str) -> Any:
    if isinstance(value, Tensor):
        return value.to(device)
    if isinstance(value, Mapping):
        return {k: _to(v, device) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return type(value)(_to(v, device) for v in value)
    return value
