"""User hooks and per-residual routing."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tapegrad.core.residual_policy import ResidualInfo, as_array, packs_inputs, residual_policy

__all__ = ["Hooks", "hooks", "Route", "route", "saved_tensors_hooks"]


class Hooks:
    """Arbitrary ``pack(array) -> Any`` / ``unpack(Any) -> array`` callables."""

    def __init__(
        self, pack: Callable[[Any], Any], unpack: Callable[[Any], Any], inputs: bool = True
    ):
        if not callable(pack) or not callable(unpack):
            raise TypeError(
                "hooks(pack, unpack): both hooks must be callables, got "
                f"{type(pack).__name__} and {type(unpack).__name__}."
            )
        self.pack_hook, self.unpack_hook = pack, unpack
        self.inputs = bool(inputs)

    def _skips(self, info) -> bool:
        return info.is_input and not self.inputs

    def pack(self, value, info):
        if self._skips(info):
            return value
        # As in PyTorch, a hook always gets an array, also for an input given as a
        # Python or numpy scalar.
        return self.pack_hook(as_array(value, info))

    def unpack(self, packed, info):
        if self._skips(info):
            return packed
        return self.unpack_hook(packed)

    def __repr__(self) -> str:
        names = (getattr(h, "__name__", "?") for h in (self.pack_hook, self.unpack_hook))
        extra = "" if self.inputs else ", inputs=False"
        return f"hooks({', '.join(names)}{extra})"


def hooks(
    pack: Callable[[Any], Any], unpack: Callable[[Any], Any], *, inputs: bool = True
) -> Hooks:
    """A policy from two callables, like PyTorch's saved_tensors_hooks.

    ```python
    seen = []
    policy = tg.policies.hooks(lambda x: (seen.append(x.nbytes), x)[1], lambda x: x)
    ```
    Like PyTorch's, the hooks see every residual, the function's own inputs included:
    a hook that observes (counts, logs, checks) needs them, and it gets no
    `ResidualInfo` to tell them apart. A hook that copies (to host, to disk, into a
    smaller dtype) only adds memory for an input, which the caller holds anyway:
    pass ``inputs=False`` to leave inputs alone.
    """
    return Hooks(pack, unpack, inputs)


class Route:
    """Pick a policy per residual: ``fn(info) -> policy``."""

    # ``fn`` sees every residual (``info.is_input`` says which are inputs); the policy it
    # picks decides what to do with an input (the built-ins leave inputs alone).
    inputs = True

    def __init__(self, fn: Callable[[ResidualInfo], Any]):
        self.fn = fn

    @property
    def prefetch(self) -> int:
        return 1

    def _policy(self, info):
        policy = self.fn(info)
        if policy is None:
            raise TypeError(
                f"route: the routing function returned None for {info}; "
                "return a policy (e.g. tg.policies.save())."
            )
        return policy

    # The packed value is the chosen policy's alone (a pytree of arrays, which a loop can
    # stack per step); unpack asks ``fn`` again, so ``fn`` must decide from ``info`` only.
    def pack(self, value, info):
        policy = self._policy(info)
        if info.is_input and not packs_inputs(policy):
            return value  # as the interpreter does for a policy used alone
        return policy.pack(value, info)

    def unpack(self, packed, info):
        policy = self._policy(info)
        if info.is_input and not packs_inputs(policy):
            return packed
        return policy.unpack(packed, info)

    def __repr__(self) -> str:
        return f"route({getattr(self.fn, '__name__', '?')})"


def route(fn: Callable[[ResidualInfo], Any]) -> Route:
    """A policy that delegates each residual to ``fn(info)``'s policy. ``fn`` is called
    when the residual is packed and again when it is unpacked, and must pick the same
    policy both times (decide from ``info``: shape, dtype, record, source line, loops).

    ```python
    big = tg.policies.route(lambda info: tg.policies.offload() if info.nbytes > 1 << 20
                                          else tg.policies.save())
    ```
    """
    return Route(fn)


def saved_tensors_hooks(
    pack_hook: Callable[[Any], Any], unpack_hook: Callable[[Any], Any], *, inputs: bool = True
):
    """PyTorch's ``torch.autograd.graph.saved_tensors_hooks``: ``pack_hook(array) -> Any``,
    ``unpack_hook(Any) -> array``, applied to every residual saved in the scope.

    As in PyTorch, the hooks also see residuals that are the function's own inputs
    (``inputs=False`` leaves those alone: the caller holds them anyway, so a hook that
    copies them only adds memory). Under `jax.jit` the hooks run once, at trace time,
    on tracers.

    ``unpack_hook(pack_hook(x))`` must have ``x``'s shape and dtype (else
    `tg.ResidualError`). Differentiated again (``jax.grad(tg.grad(f))``), the unpacked
    value stands for ``x``, as in PyTorch: the outer derivative flows to ``x`` and the
    hooks are not differentiated (except inside a ``lax.scan`` body).
    """
    return residual_policy(hooks(pack_hook, unpack_hook, inputs=inputs))
