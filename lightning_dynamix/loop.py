"""Deprecated: :mod:`lightning_dynamix.decisions`, under the name it had before (``from lightning_dynamix.loop import
DecisionMaker`` works for this release, with a ``DeprecationWarning``)."""

from __future__ import annotations

import warnings
from typing import Any


def __getattr__(name: str) -> Any:
    from lightning_dynamix import decisions

    value = getattr(decisions, name)  # an AttributeError names what decisions lacks
    warnings.warn(
        f"lightning_dynamix.loop is now lightning_dynamix.decisions: import {name} from there (the old name goes"
        " in the next release)",
        DeprecationWarning,
        stacklevel=2,
    )
    return value
