"""What can be rented: resource types, their prices and limits, read from a YAML catalogue.

A catalogue lists resource types under ``resources``::

    resources:
      - name: c6i.4xlarge        # any name, unique in the catalogue
        device: cpu              # cpu or gpu
        price_per_hour: 0.68     # per unit, any currency, >= 0
        units: 32                # how many can be rented
        memory: 32GiB            # per unit: bytes, or a number with B, KB, MB, GB, KiB, MiB, GiB, TiB
        link_bandwidth: 12.5Gbit/s   # per unit: bytes/s, or a number with B/s, ... or bit/s, Gbit/s ...
        relative_speed: 1.0      # optional (default 1): see ResourceType
      - name: a10g
        device: gpu
        price_per_hour: 1.01
        units: 8
        memory: 24GiB
        link_bandwidth: 25Gbit/s
        relative_speed: {dense: 1.0, sparse: 1.0}
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

DEVICES = ("cpu", "gpu")
KINDS = ("dense", "sparse")
_BYTES = {"": 1, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12}
_BYTES |= {"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_BITS = {"bit": 1 / 8, "kbit": 1e3 / 8, "mbit": 1e6 / 8, "gbit": 1e9 / 8, "tbit": 1e12 / 8}


@dataclass(frozen=True)
class ResourceType:
    """One kind of machine (or device) that can be rented, per unit.

    Attributes:
        name: unique in its catalogue.
        device: ``"cpu"`` or ``"gpu"``.
        price_per_hour: price of one unit for one hour (>= 0).
        units: units that can be rented (>= 1).
        memory_bytes: memory of one unit, bytes.
        link_bandwidth: network bandwidth of one unit, bytes/s.
        relative_speed: per layer kind (``"dense"``, ``"sparse"``), how many times faster one unit
            runs a layer than the device this machine profiled it on: the ``cuda`` profile for a
            ``gpu`` type where this machine has one, the ``cpu`` profile otherwise. A layer's time
            on this type is its profiled time divided by this.
    """

    name: str
    device: str
    price_per_hour: float
    units: int
    memory_bytes: int
    link_bandwidth: float
    relative_speed: Mapping[str, float]

    def __post_init__(self) -> None:
        where = f"resource {self.name!r}"
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"a resource needs a `name` (a non-empty string), got {self.name!r}")
        if self.device not in DEVICES:
            raise ValueError(f"{where}: `device` must be one of {list(DEVICES)}, got {self.device!r}")
        _positive(where, "price_per_hour", self.price_per_hour, allow_zero=True)
        if isinstance(self.units, bool) or not isinstance(self.units, int) or self.units < 1:
            raise ValueError(f"{where}: `units` must be an int >= 1, got {self.units!r}")
        _positive(where, "memory", self.memory_bytes)
        _positive(where, "link_bandwidth", self.link_bandwidth)
        if set(self.relative_speed) != set(KINDS):
            raise ValueError(f"{where}: `relative_speed` needs {list(KINDS)}, got {dict(self.relative_speed)!r}")
        for kind in KINDS:
            _positive(where, f"relative_speed.{kind}", self.relative_speed[kind])

    def speed(self, kind: str) -> float:
        """:attr:`relative_speed` of layers of ``kind`` (``"dense"`` or ``"sparse"``)."""
        return self.relative_speed[kind]

    @classmethod
    def from_dict(cls, entry: Mapping[str, Any]) -> ResourceType:
        """A resource type from one catalogue entry (sizes may carry units, see the module's docs)."""
        name = entry.get("name")
        where = f"resource {name!r}"
        known = {"name", "device", "price_per_hour", "units", "memory", "link_bandwidth", "relative_speed"}
        unknown = sorted(set(entry) - known)
        if unknown:
            raise ValueError(f"{where}: unknown fields {unknown}; a resource has {sorted(known)}")
        missing = sorted(known - {"relative_speed"} - set(entry))
        if missing:
            raise ValueError(f"{where}: missing {missing}")
        speed = entry.get("relative_speed", 1.0)
        if not isinstance(speed, Mapping):
            speed = {kind: speed for kind in KINDS}
        return cls(
            name=name,
            device=entry["device"],
            price_per_hour=_number(where, "price_per_hour", entry["price_per_hour"]),
            units=entry["units"],
            memory_bytes=int(parse_size(entry["memory"], where, "memory")),
            link_bandwidth=parse_bandwidth(entry["link_bandwidth"], where),
            relative_speed={kind: _number(where, f"relative_speed.{kind}", v) for kind, v in speed.items()},
        )


def load_catalogue(source: str | Path | Mapping[str, Any]) -> tuple[ResourceType, ...]:
    """The resource types of a YAML catalogue file (or of its parsed contents).

    Raises:
        ValueError: for a catalogue with no resources, a duplicated name, or a bad entry (naming the
            resource, the field, the value and what would be valid).
    """
    data = source if isinstance(source, Mapping) else yaml.safe_load(Path(source).read_text())
    entries = data.get("resources") if isinstance(data, Mapping) else None
    if not isinstance(entries, list) or not entries:
        raise ValueError(f"a catalogue needs a non-empty list under `resources`, got {data!r}")
    resources = tuple(ResourceType.from_dict(entry) for entry in entries)
    names = [r.name for r in resources]
    duplicated = sorted({n for n in names if names.count(n) > 1})
    if duplicated:
        raise ValueError(f"resource names must be unique in a catalogue; {duplicated} appear more than once")
    return resources


def parse_size(value: object, where: str = "", field: str = "size") -> float:
    """Bytes from a number or a string such as ``"24GiB"`` or ``"512 MB"``."""
    return _parse(value, _BYTES, where, field, "a number of bytes or e.g. '24GiB'")


def parse_bandwidth(value: object, where: str = "") -> float:
    """Bytes/s from a number or a string such as ``"25Gbit/s"`` or ``"1.25GB/s"``."""
    if isinstance(value, str) and value.strip().lower().endswith("/s"):
        text = value.strip()[:-2]
        units = {**_BYTES, **_BITS}
        return _parse(text, units, where, "link_bandwidth", "bytes/s or e.g. '25Gbit/s', '1.25GB/s'")
    return _parse(value, {"": 1}, where, "link_bandwidth", "bytes/s or e.g. '25Gbit/s', '1.25GB/s'")


def _parse(value: object, units: Mapping[str, float], where: str, field: str, valid: str) -> float:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        number, unit = float(value), ""
    else:
        match = re.fullmatch(r"\s*([0-9.eE+-]+)\s*([A-Za-z]*)\s*", str(value))
        if match is None or match.group(2).lower() not in units:
            raise ValueError(f"{where}: `{field}` must be {valid}, got {value!r}")
        try:
            number = float(match.group(1))
        except ValueError:
            raise ValueError(f"{where}: `{field}` must be {valid}, got {value!r}") from None
        unit = match.group(2).lower()
    return number * units[unit]


def _number(where: str, field: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{where}: `{field}` must be a number, got {value!r}")
    return float(value)


def _positive(where: str, field: str, value: float, allow_zero: bool = False) -> None:
    bad = not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero)
    if bad:
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{where}: `{field}` must be a finite number {bound}, got {value!r}")
