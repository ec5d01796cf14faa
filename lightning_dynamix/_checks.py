"""Argument checks shared by every public constructor: one wording for every bad-argument error.

Each check raises ``ValueError`` naming the argument, the value given and what would be valid,
and returns the value (typed) when it is fine.
"""

from __future__ import annotations

import math


def require_int(name: str, value: object, low: int | None) -> int:
    """``value`` as an int >= ``low`` (any int where ``low`` is None; bools are not ints here)."""
    if isinstance(value, bool) or not isinstance(value, int) or (low is not None and value < low):
        raise ValueError(f"`{name}` must be an int{'' if low is None else f' >= {low}'}, got {value!r}")
    return value


def require_optional_int(name: str, value: object, low: int | None, low_name: str | None = None) -> int | None:
    """``None``, or ``value`` as an int >= ``low`` (any int where ``low`` is None; ``low_name``: the argument
    ``low`` comes from)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or (low is not None and value < low):
        bound = "" if low is None else f" >= {low_name} ({low})" if low_name else f" >= {low}"
        raise ValueError(f"`{name}` must be None or an int{bound}, got {value!r}")
    return value


def require_bool(name: str, value: object) -> bool:
    """``value`` if it is True or False (not 0, 1 or a string)."""
    if not isinstance(value, bool):
        raise ValueError(f"`{name}` must be True or False, got {value!r}")
    return value


def require_number(
    name: str,
    value: object,
    low: float = -math.inf,
    high: float = math.inf,
    *,
    low_open: bool = False,
    high_open: bool = True,
) -> float:
    """``value`` as a finite float between ``low`` and ``high`` (each end open or closed)."""
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    if ok:
        number = float(value)  # type: ignore[arg-type]
        ok = (number > low if low_open else number >= low) and (number < high if high_open else number <= high)
    if not ok:
        if high == math.inf:
            what = f"a finite number {'>' if low_open else '>='} {low}"
        else:
            what = f"a number in {'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"
        raise ValueError(f"`{name}` must be {what}, got {value!r}")
    return float(value)  # type: ignore[arg-type]
