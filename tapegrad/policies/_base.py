"""The residual-policy protocol and the active-policy context.

Every residual a record saves goes through ``policy.pack(value, info)`` in
forward and ``policy.unpack(packed, info)`` in backward. The default,
`save()`, keeps the array as it is, and the interpreter skips the calls
entirely for it, so the default costs nothing.
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass
from typing import Any, Iterator, Protocol, runtime_checkable

import numpy as np

__all__ = ["ResidualPolicy", "ResidualInfo", "Save", "save", "residual_policy",
           "current_policy"]


@dataclass(frozen=True, slots=True)
class ResidualInfo:
    """What a policy knows about one residual."""

    record: Any  # tapegrad Record
    saved: Any  # tapegrad Saved: which input/output/derived value
    shape: tuple[int, ...]
    dtype: np.dtype

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * np.dtype(self.dtype).itemsize

    @property
    def primitive(self) -> str:
        return self.record.primitive

    @property
    def source(self) -> str:
        return self.record.source


@runtime_checkable
class ResidualPolicy(Protocol):
    def pack(self, value: Any, info: ResidualInfo) -> Any: ...

    def unpack(self, packed: Any, info: ResidualInfo) -> Any: ...


class Save:
    """Keep residuals on device as they are: no copy, no extra op."""

    def pack(self, value, info):
        return value

    def unpack(self, packed, info):
        return packed

    def __repr__(self) -> str:
        return "save()"


SAVE = Save()


def save() -> Save:
    """The default policy: keep every residual on device, unchanged."""
    return SAVE


_POLICY: contextvars.ContextVar[Any] = contextvars.ContextVar("tapegrad_policy", default=None)


def current_policy() -> Any:
    p = _POLICY.get()
    return SAVE if p is None else p


@contextlib.contextmanager
def residual_policy(policy: Any) -> Iterator[Any]:
    """Use ``policy`` for every residual saved inside the ``with`` block."""
    token = _POLICY.set(policy)
    try:
        yield policy
    finally:
        _POLICY.reset(token)
