"""`tg.hook`: see (and replace) the cotangent of a value, like PyTorch's
``tensor.register_hook``.

```python
h = tg.hook(h, lambda g: jnp.clip(g, -1.0, 1.0))       # clip h's gradient
h = tg.hook(h, lambda g: print("dh", g), observe=True)  # log it, also under jit
```

A hook is an identity `jax.custom_vjp` whose backward calls ``fn`` on the
incoming cotangent, so it works under `tg.grad`, `jax.grad`, `jax.jit` and
`jax.vmap`, and shows up on the tape as a ``custom_vjp_call`` record (named
``hook(<fn>)``) that saves nothing.

Two kinds of hook, because jax traces:

* ``observe=False`` (default): ``fn(ct)`` runs inside backward and may return a
  replacement (None keeps ``ct``). Eagerly (`tg.grad`/`jax.grad` outside
  `jax.jit`) it is called with concrete arrays, every backward. Under `jax.jit`
  (or any trace) it is called *once, at trace time, with tracers*: write it
  with jax ops, like a backward rule (clipping, scaling, masking).
* ``observe=True``: ``fn(ct)`` only looks. It runs through `jax.debug.callback`,
  so it sees concrete arrays on every backward, eagerly and under `jax.jit`
  alike (printing, logging, collecting norms). Its return value is ignored; jax
  may run it asynchronously (`jax.effects_barrier()` waits for it), and under
  `jax.vmap` it follows `jax.debug.callback`'s batching (once per example).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np
from jax import tree_util

from tapegrad.errors import HookError

__all__ = ["hook"]


def hook(y: Any, fn: Callable[[Any], Any], *, observe: bool = False) -> Any:
    """Return ``y`` unchanged; in backward, call ``fn`` on ``y``'s cotangent.

    ``y`` may be an array or a pytree of arrays; ``fn`` receives a cotangent of
    the same structure. With ``observe=False`` it may return a replacement of
    the same structure and shapes (cast to the cotangent's dtype), or None to
    keep the cotangent; anything else raises `tg.HookError` (a RuntimeError, as
    PyTorch raises when a hook changes a gradient's size). With ``observe=True``
    it runs via `jax.debug.callback` (concrete values under `jax.jit` too) and
    its result is ignored. See the module docstring for when ``fn`` sees tracers.

    ```python
    def loss(w, x):
        h = tg.hook(jnp.tanh(x @ w), lambda g: jnp.clip(g, -0.1, 0.1))
        return jnp.sum(h ** 2)
    ```
    """
    if not callable(fn):
        raise TypeError(f"tg.hook(y, fn): fn must be callable, got {type(fn).__name__}.")
    fn_name = getattr(fn, "__name__", type(fn).__name__)

    def identity(y):
        return y

    def fwd(y):
        return y, None

    def bwd(_, ct):
        if all(
            np.dtype(getattr(c, "dtype", np.float32)) == jax.dtypes.float0
            for c in tree_util.tree_leaves(ct)
        ):
            return (ct,)  # integer values carry no cotangent: nothing to show
        if observe:
            jax.debug.callback(_discard_result(fn), ct)
            return (ct,)
        new = fn(ct)
        if new is None:
            return (ct,)
        return (_check_replacement(fn_name, ct, new),)

    identity.__name__ = identity.__qualname__ = f"hook({fn_name})"
    bwd.__name__ = bwd.__qualname__ = f"hook({fn_name}).backward"
    f = jax.custom_vjp(identity)
    f.defvjp(fwd, bwd)
    return f(y)


def _discard_result(fn: Callable) -> Callable:
    def call(*args):
        fn(*args)  # jax.debug.callback wants None back; an observer's result is dropped

    return call


def _check_replacement(fn_name: str, ct: Any, new: Any) -> Any:
    ct_leaves, ct_tree = tree_util.tree_flatten(ct)
    new_leaves, new_tree = tree_util.tree_flatten(new)
    if cast(Any, new_tree) != ct_tree:  # jaxlib's PyTreeDef has no type stubs
        raise HookError(
            f"tg.hook: hook {fn_name} returned a value with structure {new_tree}, but the "
            f"cotangent it received has structure {ct_tree}. Return a replacement of the "
            "same structure, or None to keep the cotangent."
        )
    out = []
    for c, n in zip(ct_leaves, new_leaves):
        n = jnp.asarray(n)
        if n.shape != np.shape(c):
            raise HookError(
                f"tg.hook: hook {fn_name} returned a cotangent of shape {n.shape} for a value "
                f"of shape {np.shape(c)}. Return an array of the cotangent's shape, or None "
                "to keep it."
            )
        out.append(n.astype(c.dtype) if n.dtype != c.dtype else n)
    return tree_util.tree_unflatten(ct_tree, out)
