"""Tracing a user's function for the transforms, the report and the planner.

A user function takes pytrees and `argnums`; the engine takes flat leaves. `Traced`
flattens the arguments, traces the function into a `Tape` (its outputs and aux flattened
too), and plans the tape for a policy; `argnums_tuple` and `leaf_owners` map jax's
`argnums` onto flat leaves. `grad`/`vjp` (api.transforms), `memory_report`,
`jax_residuals` and the planner's measurements all trace through here.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax import tree_util

from tapegrad import passes as _passes
from tapegrad.anomaly import detect as _anomaly
from tapegrad.core.tape import Tape
from tapegrad.engine.checkpoint import plan_recompute
from tapegrad.engine.loops import kinds  # noqa: F401  (registers the scan and cond record kinds)
from tapegrad.engine.trace import trace_flat

__all__ = [
    "Traced",
    "argnums_tuple",
    "check_leaves",
    "is_array_leaf",
    "leaf_owners",
    "user_function",
]


def is_array_leaf(x: Any) -> bool:
    return (
        isinstance(x, (jax.Array, np.ndarray, np.generic, int, float, complex, bool))
        or hasattr(x, "__jax_array__")
        or isinstance(x, jax.core.Tracer)
    )


def check_leaves(leaves, fun_name: str) -> None:
    for x in leaves:
        if not is_array_leaf(x):
            raise TypeError(
                f"Argument {x!r} of type {type(x)} passed to {fun_name} is not a valid JAX type. "
                "Pass arrays (or pytrees of arrays); mark other arguments static with "
                "functools.partial or a closure."
            )


def argnums_tuple(argnums: int | Sequence[int], n_args: int, fun_name: str) -> tuple[int, ...]:
    nums = (argnums,) if isinstance(argnums, int) else tuple(argnums)
    if not nums:
        raise ValueError(f"{fun_name}: argnums must not be empty.")
    for a in nums:
        if not isinstance(a, (int, np.integer)):
            raise TypeError(f"{fun_name}: argnums must be ints, got {a!r}.")
        if a >= n_args:  # TypeError, like jax: the caller passed too few arguments
            raise TypeError(
                f"{fun_name}: differentiating with respect to argnums={argnums} requires at "
                f"least {a + 1} positional arguments to be passed by the caller, but got only "
                f"{n_args}. Pass the differentiated arguments positionally (not by keyword), "
                f"or use argnums within range(0, {n_args})."
            )
        if a < -n_args:
            raise ValueError(
                f"{fun_name}: argnums={argnums} is out of range for a function called with "
                f"{n_args} positional argument(s). Pass argnums within range({-n_args}, "
                f"{n_args})."
            )
    out = tuple(int(a) % n_args for a in nums)
    if len(set(out)) != len(out):
        raise ValueError(
            f"{fun_name}: argnums={argnums} names an argument twice. Pass each argument index once."
        )
    return out


class Traced:
    """A traced function: its tape and how to map flat values back to pytrees."""

    def __init__(
        self,
        fun: Callable,
        args: tuple,
        active_leaf: Callable[[int], bool],
        has_aux: bool,
        fun_name: str,
        policy: Any = None,
        passes: Any = None,
        anomaly: Any = None,
    ):
        flat, in_tree = tree_util.tree_flatten(args)
        check_leaves(flat, fun_name)
        self.in_tree = in_tree
        self.flat = flat
        trees: dict[str, Any] = {}

        def flat_fun(*leaves):
            out = fun(*tree_util.tree_unflatten(in_tree, leaves))
            if has_aux:
                if not (isinstance(out, (tuple, list)) and len(out) == 2):
                    raise TypeError(
                        f"{fun_name} with has_aux=True requires the function to return a pair "
                        f"(output, aux), but it returned {type(out).__name__}"
                        f"{length_note(out)}."
                    )
                out, aux = out
            else:
                aux = None
            out_flat, trees["out"] = tree_util.tree_flatten(out)
            aux_flat, trees["aux"] = tree_util.tree_flatten(aux)
            trees["n_out"] = len(out_flat)
            # Like jax.vjp / jax.grad(has_aux=True), a leaf that is not traced (a Python
            # int, a closed-over array) comes back as the very object the function returned,
            # not as the typed literal or constant that make_jaxpr turns it into.
            trees["untraced"] = {
                k: x
                for k, x in enumerate(out_flat + aux_flat)
                if not isinstance(x, jax.core.Tracer)
            }
            return out_flat + aux_flat

        # jax names the traced function in its errors (a leaked tracer, a value needed
        # concretely): name the user's function, keep the flat signature for arg names.
        flat_fun.__signature__ = inspect.signature(flat_fun)  # type: ignore[attr-defined]
        flat_fun.__wrapped__ = user_function(fun)  # type: ignore[attr-defined]
        active = [active_leaf(i) for i in range(len(flat))]
        with _anomaly.leak_check(anomaly, user_function(fun)):
            tape = trace_flat(
                flat_fun,
                flat,
                active,
                diff_outputs=lambda n: [True] * trees["n_out"] + [False] * (n - trees["n_out"]),
                in_tree=in_tree,
                out_tree_fn=lambda: trees["out"],
                owner=user_function(fun),
            )
        self.unplanned: Tape = _passes.run(_passes.check_rules(tape), passes)
        self.policy = policy
        self.out_tree = trees["out"]
        self.aux_tree = trees["aux"]
        self.n_out = trees["n_out"]
        self.untraced = trees["untraced"]

    @functools.cached_property
    def tape(self) -> Tape:
        """The tape planned for the policy: what is recomputed, and from which values."""
        return _passes.check_effects(plan_recompute(self.unplanned, self.policy))

    def restore(self, flat_out: list) -> list:
        """The flat outputs, with untraced leaves replaced by the objects returned."""
        if not self.untraced:
            return flat_out
        return [self.untraced.get(k, v) for k, v in enumerate(flat_out)]


def length_note(out: Any) -> str:
    return f" of length {len(out)}" if isinstance(out, (tuple, list)) else ""


def user_function(fun: Callable) -> Callable:
    """The function the user wrote, under partials and wrappers (for jax's error messages)."""
    for _ in range(16):
        if isinstance(fun, functools.partial):
            fun = fun.func
        elif getattr(fun, "__wrapped__", None) is not None:
            fun = fun.__wrapped__  # type: ignore[attr-defined]
        else:
            break
    return fun


def leaf_owners(args: tuple) -> list[int]:
    owners = []
    for i, a in enumerate(args):
        owners += [i] * len(tree_util.tree_leaves(a))
    return owners
