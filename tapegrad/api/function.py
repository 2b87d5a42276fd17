"""`tg.Function`: PyTorch's ``torch.autograd.Function`` on top of `jax.custom_vjp`.

```python
class LinearFn(tg.Function):
    @staticmethod
    def forward(x, w, b=None):                      # new style: pure forward ...
        return x @ w.T + (0 if b is None else b)

    @staticmethod
    def setup_context(ctx, inputs, output):         # ... plus setup_context
        x, w, b = inputs
        ctx.save_for_backward(x, w)

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        gx = g @ w if ctx.needs_input_grad[0] else None
        gw = g.T @ x if ctx.needs_input_grad[1] else None
        gb = g.sum(0) if ctx.needs_input_grad[2] else None
        return gx, gw, gb

y = LinearFn.apply(x, w, b)
```

How it maps onto jax:

* ``apply`` builds a `jax.custom_vjp` whose primal is ``forward``, whose ``fwd``
  runs ``forward`` and fills the ``ctx``, and whose ``bwd`` calls ``backward``.
  So a Function works under `tg.grad`, `jax.grad`, `jax.jit`, `jax.vmap`, and
  differentiates twice when ``backward`` is written with jax ops.
* Array arguments (and pytrees whose leaves are all arrays) are the custom_vjp's
  inputs. Everything else (Python numbers, strings, None, callables) is static:
  it reaches ``forward`` through a closure, never as a traced value, and its
  gradient must be None.
* ``ctx.save_for_backward(*arrays)`` arrays are the custom_vjp's residuals. Under
  `tg.grad`/`tg.vjp` they are the ``aux`` residuals of the ``custom_vjp_call``
  record, so the active residual policy (offload, compress,
  `tg.saved_tensors_hooks`) packs and unpacks them. Non-array state goes on
  ``ctx`` as attributes; arrays stored as attributes are an error (under a trace
  they would leak tracers, and no policy would see them).
* ``ctx.needs_input_grad`` comes from custom_vjp's ``symbolic_zeros=True``
  protocol: ``fwd`` is told which inputs are *perturbed*. Under `tg.grad` that is
  tapegrad's own activity analysis (the input depends on a differentiated
  argument and reaches the differentiated output); under `jax.grad` it is "the
  input carries a nonzero tangent" (`jax.vjp` perturbs every float input). A
  False is a guarantee that the gradient is discarded; a True means it may be
  used. Non-array and integer inputs are always False. One caveat: jax keeps a
  single ctx per traced call, so when a cached jaxpr (a `jax.jit`-ed function)
  is differentiated w.r.t. different inputs in turn, the ctx reports the union
  of the inputs differentiated so far. So save the same arrays whatever
  ``needs_input_grad`` says, and branch on it in ``backward``: a saved set that
  depends on it fails in that case (jax requires one residual structure).
* On the tape the Function is one ``custom_vjp_call`` record whose function is
  named after the class: ``jax.make_jaxpr`` prints ``name=LinearFn``, and
  ``tg.rules.control.custom_vjp_name(record.params)`` returns ``"LinearFn"``.
"""

from __future__ import annotations

import inspect
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import tree_util

from tapegrad.api.function_ctx import (
    FunctionCtx,
    _is_array,
    _is_jax_value,
    _is_no_cotangent,
    _Residuals,
)
from tapegrad.api.function_once import _tie_outputs, once_differentiable
from tapegrad.core import jax_compat as compat
from tapegrad.engine.activity import ACTIVE, INACTIVE, forward_activity, tracing_activity
from tapegrad.errors import FunctionBackwardError, FunctionGradShapeError

__all__ = ["Function", "FunctionCtx", "once_differentiable"]


class _Spec:
    """How ``apply``'s arguments split into array inputs (flattened) and static values.

    Keeps only the static values and the arrays' shapes/dtypes: the custom_vjp's
    rules must not hold on to the (possibly traced) input arrays themselves.
    """

    def __init__(self, name: str, arg_names: list[str], args: tuple):
        self.name, self.arg_names = name, arg_names
        self.treedefs: list = []  # per argument: a treedef, or None for a static argument
        self.statics: list = []  # per argument: the value if static, else None
        self.leaves: list = []
        for i, a in enumerate(args):
            leaves, treedef = tree_util.tree_flatten(a)
            arrays = [_is_array(x) for x in leaves]
            if leaves and all(arrays):
                self.treedefs.append(treedef)
                self.statics.append(None)
                self.leaves.extend(leaves)
            elif any(arrays):
                raise TypeError(
                    f"{name}.apply: argument {i} ({arg_names[i]!r}) mixes arrays and non-array "
                    f"values ({treedef}). Pass the arrays as separate arguments, or as a pytree "
                    "whose leaves are all arrays."
                )
            else:
                self.treedefs.append(None)
                self.statics.append(a)
        self.in_avals = [(np.shape(x), jnp.result_type(x)) for x in self.leaves]
        frame = compat.frame_of(compat.current_source_info())  # the user's line, for errors
        self.site = "<unknown>" if frame is None else f"{frame[0]}:{frame[1]} ({frame[2]})"

    def rebuild(self, leaves) -> tuple:
        # jax may hand the custom_vjp's rules a Python-scalar literal (jax.grad(f)(3.0)):
        # forward and ctx.save_for_backward see arrays, as apply's caller passed.
        out, it = [], iter(x if _is_array(x) else jnp.asarray(x) for x in leaves)
        for a, td in zip(self.statics, self.treedefs):
            out.append(
                a
                if td is None
                else tree_util.tree_unflatten(td, [next(it) for _ in range(td.num_leaves)])
            )
        return tuple(out)

    def needs_input_grad(self, perturbed) -> tuple[bool, ...]:
        out, it = [], iter(perturbed)
        for td in self.treedefs:
            out.append(False if td is None else any([next(it) for _ in range(td.num_leaves)]))
        return tuple(out)


class Function:
    """A differentiable operation with a hand-written backward, like PyTorch's
    ``torch.autograd.Function``. Subclass it, write static methods, call ``apply``.

    Two styles, as in PyTorch:

    * old: ``forward(ctx, *args)`` computes the output and fills ``ctx``;
    * new: ``forward(*args)`` is pure and ``setup_context(ctx, inputs, output)``
      fills ``ctx`` (``inputs`` holds every argument, defaults included).

    ``backward(ctx, *grad_outputs)`` gets one cotangent per output (a forward
    that returns a tuple has one per element) and returns one gradient per
    forward input: None for non-array inputs and inputs that need no gradient. A
    gradient whose shape the input broadcasts to is summed down to the input's
    shape and cast to its dtype (as in PyTorch).

    ```python
    class Exp(tg.Function):
        @staticmethod
        def forward(ctx, x):
            y = jnp.exp(x)
            ctx.save_for_backward(y)
            return y

        @staticmethod
        def backward(ctx, g):
            y, = ctx.saved_tensors
            return g * y

    tg.grad(lambda x: Exp.apply(x).sum())(x)
    ```

    It is a `jax.custom_vjp`, so it also works under `jax.grad`, `jax.jit` and
    `jax.vmap`; like any custom_vjp it cannot be differentiated in forward mode
    (`jax.jvp`, `jax.jacfwd`). Arrays ``forward`` closes over (instead of taking
    them as arguments) must not be differentiated: pass them to ``apply``.
    """

    def __init__(self, *args, **kwargs):
        raise TypeError(
            f"{type(self).__name__} is a tg.Function: do not instantiate it; call "
            f"{type(self).__name__}.apply(...) (calling forward directly runs the plain forward "
            "computation, without the custom backward)."
        )

    @staticmethod
    def forward(*args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError("a tg.Function subclass must define a static forward")

    @staticmethod
    def setup_context(ctx: FunctionCtx, inputs: tuple, output: Any) -> None:
        raise NotImplementedError("setup_context is optional: define it for the new style")

    @staticmethod
    def backward(ctx: FunctionCtx, *grad_outputs: Any) -> Any:
        raise NotImplementedError("a tg.Function subclass must define a static backward")

    @classmethod
    def _new_style(cls) -> bool:
        return cls.setup_context is not Function.setup_context

    @classmethod
    def apply(cls, *args: Any, **kwargs: Any) -> Any:
        """Run the Function: ``forward`` now, ``backward`` when differentiated."""
        name = cls.__name__
        if cls.forward is Function.forward:
            raise NotImplementedError(f"{name} must define a static method forward.")
        if cls.backward is Function.backward:
            raise NotImplementedError(
                f"{name} must define a static method backward(ctx, *grad_outputs)."
            )
        new_style = cls._new_style()
        params = list(inspect.signature(cls.forward).parameters.values())
        if not new_style:
            if not params or params[0].kind not in (
                params[0].POSITIONAL_ONLY,
                params[0].POSITIONAL_OR_KEYWORD,
            ):
                raise TypeError(
                    f"{name}.forward takes no ctx: an old-style forward is forward(ctx, *args); "
                    "a new-style forward(*args) needs a setup_context(ctx, inputs, output)."
                )
            params = params[1:]
        sig = inspect.Signature(params)
        try:
            bound = sig.bind(*args, **kwargs)
        except TypeError as e:
            hint = (
                ""
                if new_style
                else (
                    f" ({name} has no setup_context, so its forward is old-style: forward(ctx, "
                    "*args), whose first parameter is the ctx. A new-style forward(*args) needs a "
                    "setup_context(ctx, inputs, output).)"
                )
            )
            raise TypeError(f"{name}.apply{sig}: {e}{hint}") from None
        bound.apply_defaults()
        if bound.kwargs:
            raise TypeError(
                f"{name}.forward has keyword-only parameters {sorted(bound.kwargs)}; make them "
                "positional (every input of a Function gets one gradient in backward)."
            )
        inputs = tuple(bound.args)
        arg_names = _arg_names(params, len(inputs))
        spec = _Spec(name, arg_names, inputs)
        return _call(cls, spec, new_style)


def _arg_names(params, n: int) -> list[str]:
    names: list[str] = []
    for p in params:
        if p.kind == p.VAR_POSITIONAL:
            names += [f"{p.name}[{k}]" for k in range(n - len(names))]
        elif p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            names.append(p.name)
    return names[:n]


def _run_forward(cls, spec: _Spec, ctx: FunctionCtx, args: tuple, new_style: bool):
    if new_style:
        out = cls.forward(*args)
        cls.setup_context(ctx, args, out)
    else:
        out = cls.forward(ctx, *args)
    for k, v in vars(ctx).items():
        if k.startswith("_tg_") or k == "needs_input_grad":
            continue
        if any(_is_jax_value(leaf) for leaf in tree_util.tree_leaves(v)):
            raise TypeError(
                f"{spec.name}: ctx.{k} holds a jax array. Arrays needed in backward must be "
                f"saved with ctx.save_for_backward(...): under a trace an attribute would leak "
                "a tracer, and the residual policy would not see it. Attributes are for "
                "non-array state."
            )
    return out


def _finish_ctx(ctx: FunctionCtx, out: Any) -> list:
    """Record what backward needs to know about the outputs; return the array outputs.

    Only arrays are the custom_vjp's outputs. Everything else ``forward`` returns (None,
    strings, bools, Python numbers, objects) passes through untouched, as in PyTorch, and
    gets a None cotangent in ``backward``.
    """
    leaves, ctx._tg_out_tree = tree_util.tree_flatten(out)
    ctx._tg_dyn = tuple(k for k, x in enumerate(leaves) if _is_array(x))
    ctx._tg_statics = tuple(None if _is_array(x) else x for x in leaves)
    arrays = [leaves[k] for k in ctx._tg_dyn]
    ids = {id(x): j for j, x in enumerate(arrays)}
    marked = set()
    for o in ctx._tg_non_diff:
        if id(o) not in ids:
            raise ValueError(
                f"{ctx._tg_name}: ctx.mark_non_differentiable got a value that is not an output "
                "of forward. Pass the very arrays forward returns."
            )
        marked.add(ids[id(o)])
    ctx._tg_non_diff = []  # the output objects are tracers: do not keep them
    ctx._tg_marked = frozenset(marked)
    ctx._tg_out_dtypes = tuple(jnp.result_type(x) for x in arrays)
    ctx._tg_spread = isinstance(out, tuple)
    return arrays


def _full_output(ctx: FunctionCtx, arrays: Any) -> Any:
    """``forward``'s output: the custom_vjp's ``arrays`` back among the values that
    passed through."""
    leaves = list(ctx._tg_statics)
    for k, a in zip(ctx._tg_dyn, arrays):
        leaves[k] = a
    return tree_util.tree_unflatten(ctx._tg_out_tree, leaves)


def _needs_while_traced(spec: _Spec) -> tuple[bool, ...] | None:
    """``needs_input_grad`` known before ``forward`` runs, when tapegrad is tracing: which
    inputs depend on a differentiated argument (`tapegrad.engine.activity`).

    None outside a tapegrad trace; for an input staged in a body nested in the trace (a
    jit, scan or checkpoint body, whose inputs say nothing yet about what is
    differentiated); and for an inner transformation's tracer (jax.grad's, jax.vmap's).
    The custom_vjp's own rules then tell: jax stages the primal, and tapegrad's fwd
    learns what is differentiated once the body's tape is built, so ``forward`` runs
    twice there, as when a jitted function is differentiated with `jax.grad`. Guessing
    "every float input" instead would run once but compute unneeded gradients on every
    call of the compiled program.
    """
    if not tracing_activity():
        return None
    flags = []
    for x in spec.leaves:
        if not jnp.issubdtype(jnp.result_type(x), jnp.inexact):
            flags.append(False)
            continue
        activity = forward_activity(x)
        if activity not in (ACTIVE, INACTIVE):
            return None
        flags.append(activity == ACTIVE)
    return spec.needs_input_grad(flags)


def _call(cls, spec: _Spec, new_style: bool):
    name = cls.__name__
    n_in = len(spec.treedefs)
    once_diff = getattr(cls.backward, "_tg_once_differentiable", False)

    def run(args: tuple, needs: tuple[bool, ...]) -> tuple[FunctionCtx, Any, list]:
        ctx = FunctionCtx(name, needs)
        out = _run_forward(cls, spec, ctx, args, new_style)
        return ctx, out, _finish_ctx(ctx, out)

    if not spec.leaves:  # nothing to differentiate: no custom_vjp needed
        return run(spec.rebuild(()), (False,) * n_in)[1]

    def bwd(res: _Residuals, ct: Any):
        ctx = res.ctx
        g_leaves: list = [None] * len(ctx._tg_statics)  # None for what passed through
        for j, (g, dt) in enumerate(zip(ct, ctx._tg_out_dtypes)):
            if j in ctx._tg_marked or _is_no_cotangent(g) or not jnp.issubdtype(dt, jnp.inexact):
                g = jnp.zeros(g.shape, dt) if ctx._tg_materialize else None
            g_leaves[ctx._tg_dyn[j]] = g
        grads_out = tree_util.tree_unflatten(ctx._tg_out_tree, g_leaves)
        grads_out = grads_out if ctx._tg_spread else (grads_out,)
        ctx._tg_saved, ctx._tg_in_backward = res.arrays, True
        try:
            grads = cls.backward(ctx, *grads_out)
        finally:
            ctx._tg_saved, ctx._tg_in_backward = (), False
        return tuple(_check_grads(spec, ctx, grads))

    needs = _needs_while_traced(spec)
    if needs is not None:
        primal, fwd, ctx = _traced_once(spec, run, needs, once_diff)
    else:
        primal, fwd, box = _run_per_rule(spec, run, n_in, once_diff)

    primal.__name__ = name
    primal.__qualname__ = cls.__qualname__
    fwd.__name__ = fwd.__qualname__ = f"{name}.forward"
    bwd.__name__ = bwd.__qualname__ = f"{name}.backward"
    bwd._tg_function = name  # type: ignore[attr-defined]  # the anomaly messages' name
    f = jax.custom_vjp(primal)
    f.defvjp(fwd, bwd, symbolic_zeros=True)
    arrays = f(*spec.leaves)
    return _full_output(ctx if needs is not None else box[0], arrays)


def _run_per_rule(spec: _Spec, run, n_in: int, once_diff: bool):
    """The custom_vjp's primal and fwd, each running ``forward``: jax calls one of them
    per call (the primal when nothing is differentiated, fwd under jax.grad). ``box``
    receives the first ctx, for the values that pass through."""
    box: list = []
    # jax keeps one residual treedef (which carries the ctx) per custom_vjp_call equation,
    # and memoizes fwd per perturbed-pattern: when a cached jaxpr (a jitted function) is
    # differentiated with different patterns, backward for one pattern may receive the ctx
    # traced for another. needs_input_grad is therefore the union of the patterns seen for
    # this call, so a reused ctx can only ask for more gradients (which are discarded),
    # never fewer.
    seen = [False] * n_in

    def primal(*leaves):
        ctx, _, arrays = run(spec.rebuild(leaves), (False,) * n_in)  # nothing differentiated
        box.append(ctx)
        return tuple(arrays)

    def fwd(*prims):
        needs = spec.needs_input_grad([p.perturbed for p in prims])
        seen[:] = [a or b for a, b in zip(seen, needs)]
        ctx, _, arrays = run(spec.rebuild([p.value for p in prims]), tuple(seen))
        box.append(ctx)
        if once_diff:
            arrays = _tie_outputs(arrays, ctx, [p.value for p in prims if p.perturbed])
        res = _Residuals(ctx._tg_saved, ctx)
        ctx._tg_saved = ()  # backward gets them from the residuals, not from forward's trace
        return tuple(arrays), res

    return primal, fwd, box


def _traced_once(spec: _Spec, run, needs: tuple[bool, ...], once_diff: bool):
    """Under a tapegrad trace: run ``forward`` once, now, with the ``needs_input_grad``
    the trace knows, into a jaxpr of its outputs and saved arrays, which the custom_vjp's
    primal and fwd replay. Without this, jax traces the primal to stage the call and
    tapegrad then traces fwd for its residuals: ``forward`` would run twice, first
    with every ``needs_input_grad`` False."""
    cell: list = []

    def forward_and_saved(*leaves):
        ctx, _, arrays = run(spec.rebuild(leaves), needs)
        cell.append(ctx)
        return tuple(arrays), ctx._tg_saved

    closed, shapes = jax.make_jaxpr(forward_and_saved, return_shape=True)(*spec.leaves)
    (ctx,) = cell
    ctx._tg_saved = ()  # tracers of the finished trace: backward gets the residuals
    tree = tree_util.tree_structure(shapes)

    def replay(leaves) -> tuple:
        return tree_util.tree_unflatten(tree, compat.eval_closed_jaxpr(closed, *leaves))

    def primal(*leaves):
        return replay(leaves)[0]

    def fwd(*prims):
        arrays, saved = replay([p.value for p in prims])
        if once_diff:
            arrays = _tie_outputs(list(arrays), ctx, [p.value for p in prims if p.perturbed])
        return tuple(arrays), _Residuals(tuple(saved), ctx)

    return primal, fwd, ctx


def _check_grads(spec: _Spec, ctx: FunctionCtx, grads: Any) -> list:
    """``backward``'s result -> one gradient (or None) per flattened array input."""
    name, n = spec.name, len(spec.treedefs)
    if not isinstance(grads, (tuple, list)):
        grads = (grads,)
    grads = tuple(grads)
    if len(grads) > n and all(g is None for g in grads[n:]):
        grads = grads[:n]  # trailing Nones are allowed, as in PyTorch
    if len(grads) != n:
        raise FunctionBackwardError(
            f"function {name}Backward returned an incorrect number of gradients (expected "
            f"{n}, got {len(grads)}): {name}.backward returned {len(grads)} gradient(s), but "
            f"{name}.forward takes {n} input(s) ({', '.join(spec.arg_names)}); it was called "
            f"at {spec.site}. Return one entry per forward input, None for inputs that need no "
            "gradient."
        )
    out: list = []
    it = iter(spec.in_avals)
    for i, (g, td, needs) in enumerate(zip(grads, spec.treedefs, ctx.needs_input_grad)):
        what = f"input {i} ({spec.arg_names[i]!r})"
        if td is None:
            if g is not None:
                raise FunctionBackwardError(
                    f"function {name}Backward returned a gradient different than None at "
                    f"position {i + 1}, but the corresponding forward input was not an array: "
                    f"{name}.backward returned a gradient for {what}, which is not an array "
                    f"(a {type(spec.statics[i]).__name__}); return None for it. {name} was "
                    f"called at {spec.site}."
                )
            continue
        xs = [next(it) for _ in range(td.num_leaves)]
        if g is None or not needs:
            out.extend([None] * len(xs))
            continue
        try:
            gs = td.flatten_up_to(g)
        except (TypeError, ValueError):
            raise FunctionBackwardError(
                f"{name}.backward returned a gradient for {what} with structure "
                f"{tree_util.tree_structure(g)}, but the input has structure {td} (forward "
                f"called at {spec.site}). Return a gradient with the input's structure."
            ) from None
        for x, gl in zip(xs, gs):
            out.append(None if gl is None else _fit_grad(spec, i, what, gl, x))
    return out


def _fit_grad(spec: _Spec, i: int, what: str, g: Any, aval: tuple):
    name = spec.name
    if not _is_array(g) and not isinstance(g, (int, float, complex)):
        raise FunctionBackwardError(
            f"expected an array or None (got {type(g).__name__}): {name}.backward returned a "
            f"{type(g).__name__} as the gradient of {what} (forward called at {spec.site}); "
            "return an array (or None)."
        )
    g = jnp.asarray(g)
    want_shape, want_dtype = aval
    if not jnp.issubdtype(want_dtype, jnp.inexact):
        return None  # an integer input has no gradient (jax's float0)
    if g.shape != want_shape:
        try:
            ok = np.broadcast_shapes(want_shape, g.shape) == g.shape
        except ValueError:
            ok = False
        if not ok:
            raise FunctionGradShapeError(
                f"Function {name}Backward returned an invalid gradient at index {i} - got "
                f"{list(g.shape)} but expected shape compatible with {list(want_shape)}. "
                f"{name}.backward returned a gradient of shape {g.shape} for {what} of shape "
                f"{want_shape} (forward called at {spec.site}). Return a gradient shaped like "
                "the input (or one the input broadcasts to, which is summed down)."
            )
        lead = g.ndim - len(want_shape)
        axes = tuple(range(lead)) + tuple(
            lead + k for k, s in enumerate(want_shape) if s == 1 and g.shape[lead + k] != 1
        )
        g = g.sum(axis=axes).reshape(want_shape)
    if g.dtype != want_dtype:
        g = g.astype(want_dtype)
    return g
