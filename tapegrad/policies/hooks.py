"""User hooks and per-residual routing."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tapegrad.policies._base import ResidualInfo

__all__ = ["Hooks", "hooks", "Route", "route"]


class Hooks:
    """Arbitrary ``pack(array) -> Any`` / ``unpack(Any) -> array`` callables."""

    def __init__(self, pack: Callable[[Any], Any], unpack: Callable[[Any], Any]):
        if not callable(pack) or not callable(unpack):
            raise TypeError(
                "hooks(pack, unpack): both hooks must be callables, got "
                f"{type(pack).__name__} and {type(unpack).__name__}."
            )
        self.pack_hook, self.unpack_hook = pack, unpack

    def pack(self, value, info):
        return self.pack_hook(value)

    def unpack(self, packed, info):
        return self.unpack_hook(packed)

    def __repr__(self) -> str:
        names = (getattr(h, "__name__", "?") for h in (self.pack_hook, self.unpack_hook))
        return f"hooks({', '.join(names)})"


def hooks(pack: Callable[[Any], Any], unpack: Callable[[Any], Any]) -> Hooks:
    """A policy from two callables, like PyTorch's saved_tensors_hooks.

    ```python
    seen = []
    policy = tg.policies.hooks(lambda x: (seen.append(x.nbytes), x)[1], lambda x: x)
    ```
    """
    return Hooks(pack, unpack)


class Route:
    """Pick a policy per residual: ``fn(info) -> policy``."""

    def __init__(self, fn: Callable[[ResidualInfo], Any]):
        self.fn = fn

    @property
    def prefetch(self) -> int:
        return 1

    def pack(self, value, info):
        policy = self.fn(info)
        if policy is None:
            raise TypeError(
                f"route: the routing function returned None for {info}; "
                "return a policy (e.g. tg.policies.save())."
            )
        return (policy, policy.pack(value, info))

    def unpack(self, packed, info):
        policy, inner = packed
        return policy.unpack(inner, info)

    def __repr__(self) -> str:
        return f"route({getattr(self.fn, '__name__', '?')})"


def route(fn: Callable[[ResidualInfo], Any]) -> Route:
    """A policy that delegates each residual to ``fn(info)``'s policy.

    ```python
    big = tg.policies.route(lambda info: tg.policies.offload() if info.nbytes > 1 << 20
                                          else tg.policies.save())
    ```
    """
    return Route(fn)
