"""The state a `tg.Function` carries from forward to backward: `FunctionCtx` (the ``ctx``
``forward``/``setup_context`` fill and ``backward`` reads) and `_Residuals` (the saved
arrays and the ctx as one pytree, the custom_vjp's residuals); and the value tests the
Function modules share (`_is_array`, `_is_jax_value`, `_is_no_cotangent`)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import tree_util

__all__ = ["FunctionCtx"]


def _is_array(x: Any) -> bool:
    return isinstance(x, (jax.Array, np.ndarray, np.generic, jax.core.Tracer)) or hasattr(
        x, "__jax_array__"
    )


def _is_jax_value(x: Any) -> bool:
    """A jax array or tracer (numpy arrays are plain constants)."""
    return isinstance(x, (jax.Array, jax.core.Tracer)) or hasattr(x, "__jax_array__")


def _is_no_cotangent(ct: Any) -> bool:
    """A symbolic zero, or the float0 cotangent of an integer output."""
    if ct is None or isinstance(ct, jax.custom_derivatives.SymbolicZero):
        return True
    return getattr(ct, "dtype", None) == jax.dtypes.float0


class FunctionCtx:
    """The ``ctx`` a `Function`'s ``forward``/``setup_context`` fill and ``backward`` reads.

    * ``ctx.save_for_backward(*arrays)`` / ``ctx.saved_tensors``: arrays kept for
      backward (None entries allowed); they go through the residual policy.
    * ``ctx.needs_input_grad``: one bool per forward input (see `Function`).
    * ``ctx.mark_non_differentiable(*outputs)``: those outputs get no cotangent.
    * ``ctx.set_materialize_grads(False)``: backward receives None, not zeros,
      for outputs that got no cotangent.
    * any other attribute (``ctx.scale = 2.0``): static, non-array state.
    """

    def __init__(self, name: str, needs_input_grad: tuple[bool, ...]):
        self._tg_name = name
        self.needs_input_grad = needs_input_grad
        self._tg_saved: tuple = ()
        self._tg_in_backward = False
        self._tg_non_diff: list = []
        self._tg_materialize = True

    # Set by _finish_ctx once forward has run (declared here for the type checker only).
    _tg_out_tree: Any  # jax PyTreeDef
    _tg_dyn: tuple[int, ...]  # the output leaves that are arrays (the custom_vjp's outputs)
    _tg_statics: tuple[Any, ...]  # per output leaf: the value that passed through, or None
    _tg_marked: frozenset[int]  # indices into the array outputs
    _tg_out_dtypes: tuple[Any, ...]
    _tg_spread: bool

    def save_for_backward(self, *tensors: Any) -> None:
        """Keep ``tensors`` (arrays or None) for ``backward``; a later call replaces them."""
        for i, t in enumerate(tensors):
            if t is not None and not _is_array(t):
                raise TypeError(
                    f"{self._tg_name}: ctx.save_for_backward accepts arrays or None, but "
                    f"argument {i} is a {type(t).__name__} ({t!r:.60}). Store non-array state "
                    f"as an attribute instead (e.g. ctx.value = ...)."
                )
        self._tg_saved = tuple(None if t is None else jnp.asarray(t) for t in tensors)

    @property
    def saved_tensors(self) -> tuple:
        """The arrays given to `save_for_backward`, in order (available in ``backward``)."""
        if not self._tg_in_backward:
            raise RuntimeError(
                f"{self._tg_name}: ctx.saved_tensors is available in backward only; in "
                "forward/setup_context use the arrays themselves."
            )
        return self._tg_saved

    def mark_non_differentiable(self, *outputs: Any) -> None:
        """Mark outputs of ``forward`` (the very objects it returns) as not differentiable:
        they get no cotangent, and ``backward`` receives zeros (or None) for them."""
        self._tg_non_diff.extend(outputs)

    def set_materialize_grads(self, value: bool) -> None:
        """With False, ``backward`` receives None instead of zeros for outputs that got no
        cotangent (unused outputs, non-differentiable ones)."""
        self._tg_materialize = bool(value)

    def mark_dirty(self, *args: Any) -> None:
        raise TypeError(
            f"{self._tg_name}: ctx.mark_dirty has no meaning in jax: arrays are immutable, so "
            "forward cannot modify an input in place. Return the new value instead."
        )

    def save_for_forward(self, *args: Any) -> None:
        raise TypeError(
            f"{self._tg_name}: ctx.save_for_forward (forward-mode AD) is not supported: a "
            "tg.Function is a jax.custom_vjp, which jax cannot differentiate in forward mode."
        )

    def __repr__(self) -> str:
        return f"<FunctionCtx of {self._tg_name} needs_input_grad={self.needs_input_grad}>"


class _Residuals:
    """What a Function's custom_vjp keeps for backward: the saved arrays (pytree
    children, so jax and the residual policy see them) and the ctx (static aux data)."""

    __slots__ = ("arrays", "ctx")

    def __init__(self, arrays: tuple, ctx: FunctionCtx):
        self.arrays, self.ctx = arrays, ctx


tree_util.register_pytree_node(
    _Residuals, lambda r: (r.arrays, r.ctx), lambda ctx, arrays: _Residuals(tuple(arrays), ctx)
)
