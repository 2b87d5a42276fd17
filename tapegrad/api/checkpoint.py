"""`tg.checkpoint`, `tg.checkpoint_sequential` and `tg.name`: the user's side of
recomputation (the tape's side, decisions and segments, is `tapegrad.engine.checkpoint`).

`tg.checkpoint` is `jax.checkpoint`, with one difference PyTorch users rely on: values
that are not arrays (None, strings, bools, Python numbers, functions, any object) pass
through untouched, in the arguments and in the result, where `jax.checkpoint` rejects a
string ("not a valid JAX type") and turns a Python number into an array. They ride in a
pytree node's static data (`_Passed`), so jax's trace cache still keys on them.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax import tree_util
from jax.ad_checkpoint import checkpoint_name

from tapegrad.api.function_ctx import _is_array

__all__ = ["checkpoint", "checkpoint_sequential", "name"]


class _Static:
    """The non-array leaves of a pytree and where they go: static data, compared by value
    where the values allow it (strings, numbers, None, functions), else by identity."""

    __slots__ = ("tree", "values", "_key")

    def __init__(self, tree: Any, values: tuple):
        self.tree, self.values = tree, values
        try:
            hash(values)
            self._key: Any = (tree, values)
        except TypeError:
            self._key = None

    def __hash__(self) -> int:
        return hash(self._key) if self._key is not None else id(self)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, _Static):
            return NotImplemented
        if self._key is None or other._key is None:
            return self is other
        try:
            return bool(self._key == other._key)
        except Exception:  # a value whose == is not a bool
            return self is other


class _Passed:
    """Arrays (pytree children, traced by jax) and the values that pass through (static)."""

    __slots__ = ("arrays", "static")

    def __init__(self, arrays: tuple, static: _Static):
        self.arrays, self.static = arrays, static


tree_util.register_pytree_node(
    _Passed, lambda p: (p.arrays, p.static), lambda s, arrays: _Passed(tuple(arrays), s)
)


class _Whole:
    """An argument named in ``static_argnums``: one static leaf, whatever it holds."""

    __slots__ = ("value",)

    def __init__(self, value: Any):
        self.value = value

    def __hash__(self) -> int:
        try:
            return hash(self.value)
        except TypeError:
            return id(self)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Whole) and (self.value is other.value or _same(self, other))


def _same(a: _Whole, b: _Whole) -> bool:
    try:
        return bool(a.value == b.value)
    except Exception:
        return False


def _split(tree: Any) -> _Passed:
    """``tree`` as its arrays plus static data. (None is never a pytree leaf, so it marks
    an array's slot among the static values.)"""
    leaves, treedef = tree_util.tree_flatten(tree)
    arrays = tuple(x for x in leaves if _is_array(x))
    values = tuple(None if _is_array(x) else x for x in leaves)
    return _Passed(arrays, _Static(treedef, values))


def _join(p: _Passed) -> Any:
    it = iter(p.arrays)
    leaves = [next(it) if v is None else v for v in p.static.values]
    return tree_util.tree_unflatten(p.static.tree, leaves)


def checkpoint(
    fun: Callable,
    policy: Any = None,
    *,
    prevent_cse: bool = True,
    static_argnums: int | tuple[int, ...] = (),
) -> Callable:
    """Recompute ``fun``'s residuals in backward instead of keeping them (PyTorch's
    ``torch.utils.checkpoint.checkpoint(fun, *args, use_reentrant=False)``).

    Built on `jax.checkpoint`, so the same code runs under `jax.grad`. ``policy`` is a
    `tg.selective` policy or any `jax.checkpoint_policies` policy.

    As in PyTorch, arguments and results that are not arrays (None, strings, bools,
    Python numbers, callables) pass through untouched: they are static, never traced,
    and get no gradient.

    ```python
    def block(x, act, scale):                 # act: a function, scale: a Python float
        return act(x) * scale, "block done"
    y, note = tg.checkpoint(block)(x, jnp.tanh, 2.0)
    ```
    """
    nums = (static_argnums,) if isinstance(static_argnums, int) else tuple(static_argnums)
    if isinstance(prevent_cse, tuple):  # a per-argument prefix: jax's own spelling only
        return jax.checkpoint(fun, policy=policy, prevent_cse=prevent_cse, static_argnums=nums)

    def body(passed: _Passed) -> _Passed:
        args, kwargs = _join(passed)
        args = tuple(a.value if isinstance(a, _Whole) else a for a in args)
        return _split(fun(*args, **kwargs))

    ck = jax.checkpoint(body, policy=policy, prevent_cse=prevent_cse)

    @functools.wraps(fun)
    def checkpointed(*args: Any, **kwargs: Any) -> Any:
        n = len(args)
        whole = {i % n for i in nums if -n <= i < n}
        args = tuple(_Whole(a) if i in whole else a for i, a in enumerate(args))
        return _join(ck(_split((args, kwargs))))

    return checkpointed


def name(x: Any, name: str) -> Any:
    """Tag a value for policies (`jax.ad_checkpoint.checkpoint_name`)."""
    return checkpoint_name(x, name)


def checkpoint_sequential(
    functions: Sequence[Callable], segments: int | str, input: Any, *more: Any, policy: Any = None
) -> Any:
    """PyTorch's ``checkpoint_sequential``: run ``functions`` in order, checkpointing
    ``segments`` equal-length chunks; the last chunk is not checkpointed.

    ``segments="sqrt"`` uses ``round(sqrt(len(functions)))`` chunks. ``policy`` (a
    `tg.selective` or `jax.checkpoint_policies` policy for each chunk) is keyword-only.
    """
    if more:
        raise TypeError(
            f"checkpoint_sequential() takes 3 positional arguments (functions, segments, "
            f"input) but {3 + len(more)} were given. The chain takes one input: pass several "
            "values as one tuple (the first function receives it), and policy= by keyword."
        )
    n = len(functions)
    if n == 0:
        return input
    if segments == "sqrt":
        segments = max(1, round(math.sqrt(n)))
    if not isinstance(segments, int) or segments < 1:
        raise ValueError(
            f"checkpoint_sequential: segments must be a positive int or 'sqrt', got {segments!r}."
        )
    segments = min(segments, n)
    size = n // segments

    def run(fs, x):
        for f in fs:
            x = f(x)
        return x

    x = input
    start = 0
    for _ in range(segments - 1):
        chunk = tuple(functions[start : start + size])
        x = checkpoint(functools.partial(run, chunk), policy=policy)(x)
        start += size
    return run(functions[start:], x)
