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

from tapegrad.core.tape import Tape, Var, custom_vjp_name
from tapegrad.errors import HookError

__all__ = ["hook", "is_hook_record", "retained_keys"]

# A hook's record is named ``hook(fn1, fn2)``: no Python function has a name with a
# parenthesis, so no other custom_vjp is taken for one.
HOOK_PREFIX = "hook("


def hook(
    y: Any, fn: Callable[[Any], Any], *more: Callable[[Any], Any], observe: bool = False
) -> Any:
    """Return ``y`` unchanged; in backward, call ``fn`` (then each of ``more``) on ``y``'s
    cotangent.

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

    **Several hooks.** ``tg.hook(y, h1, h2)`` runs ``h1`` first and hands its result
    to ``h2``: registration order, as PyTorch runs ``y.register_hook(h1);
    y.register_hook(h2)``. Chained calls compose as functions do:
    ``tg.hook(tg.hook(y, h1), h2)`` wraps ``y`` twice, and backward meets the outer
    wrapper first, so ``h2`` runs before ``h1``.

    **Retained gradients.** `tg.name` on a value inside a chain of ``tg.hook`` calls
    (before, between or after them) retains, in ``tg.grad(..., intermediates=)``, the
    cotangent after *every* hook of the chain, as PyTorch's ``retain_grad`` sees a
    tensor's gradient after all its hooks, whenever it was called.

    A hook changes the cotangent of the uses of the value it returns; uses of ``y``
    itself are not hooked (in PyTorch a tensor's hook sees all of its uses).
    """
    fns = (fn, *more)
    for f in fns:
        if not callable(f):
            raise TypeError(f"tg.hook(y, fn): fn must be callable, got {type(f).__name__}.")
    names = [getattr(f, "__name__", type(f).__name__) for f in fns]

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
        for f, f_name in zip(fns, names):
            if observe:
                jax.debug.callback(_discard_result(f), ct)
                continue
            new = f(ct)
            if new is not None:
                ct = _check_replacement(f_name, ct, new)
        return (ct,)

    label = f"{HOOK_PREFIX}{', '.join(names)})"
    identity.__name__ = identity.__qualname__ = label
    bwd.__name__ = bwd.__qualname__ = f"{label}.backward"
    f = jax.custom_vjp(identity)
    f.defvjp(fwd, bwd)
    return f(y)


def is_hook_record(rec: Any) -> bool:
    """Whether a tape record is a `tg.hook` (an identity whose backward calls hooks)."""
    return rec.primitive == "custom_vjp_call" and custom_vjp_name(rec.params).startswith(
        HOOK_PREFIX
    )


def retained_keys(tape: Tape) -> dict[str, tuple[Any, Var]]:
    """``{name: (capture key, named Var)}`` for the values tagged with `tg.name`.

    The key is the named value's id, whose cotangent backward captures as it reaches
    the value; or, where `tg.hook` calls wrap the value below the name, ``("in",
    record index, input)`` of the lowest of them: the cotangent that hook returns, after
    every hook of the chain. PyTorch's ``retain_grad`` sees a tensor's gradient after all
    of its hooks, also those registered before it; a chain of ``tg.hook`` / `tg.name`
    calls on one value is that value's hooks.
    """
    producer = {o.id: (r, j) for r in tape.records for j, o in enumerate(r.outputs)}
    out: dict[str, tuple[Any, Var]] = {}
    for r in tape.records:
        for n in r.names:
            key: Any = r.outputs[0].id
            v = r.inputs[0] if len(r.inputs) == 1 else None  # walk down the chain
            while isinstance(v, Var) and v.id in producer:
                p, j = producer[v.id]
                if is_hook_record(p) and len(p.inputs) == len(p.outputs):
                    key = ("in", p.index, j)  # an identity: output j is input j
                    v = p.inputs[j]
                elif p.names and len(p.inputs) == 1:  # another name on the same value
                    v = p.inputs[0]
                else:
                    break
            out[n] = (key, r.outputs[0])
    return out


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
