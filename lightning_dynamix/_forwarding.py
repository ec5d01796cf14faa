"""One descriptor for an attribute a front end shows but one of its parts holds (``strategy.min_batch_size`` is
``strategy.batch_core.min_batch_size``): the value lives in one place, whichever object is asked."""

from __future__ import annotations

from typing import Any


class Forwarded:
    """An attribute of the part ``self.<holder>`` shown on its owner under the same name.

    Args:
        holder: the owner's attribute that holds the part (``"batch_core"``, ``"embedding_offload"``).
        doc: the attribute's docstring; default: which part's attribute it is.
        settable: setting it on the owner sets it on the part; otherwise the owner's attribute is read-only.
    """

    def __init__(self, holder: str, doc: str | None = None, settable: bool = False) -> None:
        self.holder = holder
        self.doc = doc
        self.settable = settable
        self.name = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name
        self.__doc__ = self.doc or f"``{self.holder}.{name}``."

    def __get__(self, obj: Any, objtype: type | None = None) -> Any:
        if obj is None:
            return self
        return getattr(getattr(obj, self.holder), self.name)

    def __set__(self, obj: Any, value: Any) -> None:
        if not self.settable:
            raise AttributeError(f"`{self.name}` is read-only; give it to {type(obj).__name__}'s constructor")
        setattr(getattr(obj, self.holder), self.name, value)
