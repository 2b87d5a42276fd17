"""gradcheck / gradgradcheck: tapegrad's derivatives against central finite differences.

```python
x, w = np.random.randn(3, 4), np.random.randn(4, 2)   # float64 numpy: no global x64 needed
assert tg.gradcheck(lambda x, w: jnp.tanh(x @ w), (x, w))
assert tg.gradgradcheck(lambda x: jnp.sum(jnp.sin(x) ** 2), (x,))
```

The analytical Jacobian is built row by row from `tg.vjp` (one cotangent per
output element); the numerical one column by column from
``(f(x + eps e_j) - f(x - eps e_j)) / (2 eps)``. Both run in float64, with
``jax_enable_x64`` switched on for the check only (a thread-local scope: the
caller's setting is untouched). Why float64 (PyTorch's gradcheck says the
same): the central difference has truncation error ~eps² and rounding error
~machine_eps / eps; in float32 (machine eps 1.2e-7) with eps=1e-6 the rounding
term alone is ~0.1, so a correct gradient fails and a wrong one can pass.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import tree_util

from tapegrad.api.transforms import vjp as tg_vjp
from tapegrad.errors import DtypeError, GradcheckError

__all__ = ["gradcheck", "gradgradcheck"]

_LOW_PRECISION_WHY = (
    "Central finite differences need float64: their rounding error is about "
    "machine_eps / eps, i.e. 1.2e-7 / {eps:g} = {err:.1g} in float32, far above atol={atol:g}, "
    "so a correct gradient would fail (and a wrong one could pass). Pass float64 inputs "
    "(np.asarray(x, np.float64) works without enabling x64: gradcheck enables it for the "
    "check only), or pass allow_low_precision=True to have gradcheck cast them to float64."
)


def _as_tuple(args) -> tuple:
    return tuple(args) if isinstance(args, (tuple, list)) else (args,)


def _leaf_dtype(x) -> np.dtype:
    if isinstance(x, float):
        return np.dtype(np.float64)  # a Python float is a double
    return np.dtype(jnp.result_type(x)) if not hasattr(x, "dtype") else np.dtype(x.dtype)


class _Problem:
    """``f`` as a function of its floating leaves (float64); other leaves stay as given."""

    def __init__(
        self,
        f: Callable,
        args: tuple,
        allow_low_precision: bool,
        eps: float,
        atol: float,
        what: str,
        n_args: int | None = None,
    ):
        leaves, self.in_tree = tree_util.tree_flatten(args)
        paths = tree_util.tree_flatten_with_path(args)[0]
        labels = [f"args{tree_util.keystr(p)}" for p, _ in paths]
        if n_args is not None:  # gradgradcheck: the arguments after n_args are cotangents
            labels = [
                lab
                if p[0].idx < n_args
                else f"grad_outputs[{p[0].idx - n_args}]{tree_util.keystr(p[1:])}"
                for lab, (p, _) in zip(labels, paths)
            ]
        self.diff: list[int] = []  # leaf positions of the checked inputs
        x0 = []
        for k, x in enumerate(leaves):
            dt = _leaf_dtype(x)
            if jnp.issubdtype(dt, jnp.complexfloating):
                raise DtypeError(
                    f"{what}: input {k} ({labels[k]}) is complex ({dt.name}); "
                    "gradcheck supports real inputs. Pass the real and imaginary "
                    "parts as separate float64 inputs."
                )
            if jnp.issubdtype(dt, jnp.floating):
                if dt != np.float64 and not allow_low_precision:
                    raise DtypeError(
                        f"{what}: input {k} ({labels[k]}) is {dt.name}. "
                        + _LOW_PRECISION_WHY.format(eps=eps, err=1.2e-7 / eps, atol=atol)
                    )
                self.diff.append(k)
                x0.append(jnp.asarray(np.asarray(x, np.float64)))
        if not self.diff:
            raise DtypeError(
                f"{what}: no floating-point input to check; the inputs are "
                f"{[_leaf_dtype(x).name for x in leaves]}."
            )
        self.f, self.leaves, self.x0 = f, leaves, x0
        self.labels = [labels[k] for k in self.diff]

    def args_with(self, xs) -> tuple:
        leaves = list(self.leaves)
        for k, x in zip(self.diff, xs):
            leaves[k] = x
        return tuple(tree_util.tree_unflatten(self.in_tree, leaves))

    def call(self, xs):
        return self.f(*self.args_with(xs))


def _float_outputs(leaves, what: str) -> list[int]:
    """The floating outputs' positions (possibly none: see `_no_differentiable_outputs`)."""
    idx = []
    for k, o in enumerate(leaves):
        dt = np.dtype(jnp.result_type(o))
        if jnp.issubdtype(dt, jnp.complexfloating):
            raise DtypeError(
                f"{what}: output {k} is complex ({dt.name}); gradcheck supports real "
                "outputs. Return the real and imaginary parts separately."
            )
        if jnp.issubdtype(dt, jnp.floating):
            idx.append(k)
    return idx


def _no_differentiable_outputs(p: _Problem, fn, eps, raise_exception, what) -> bool:
    """PyTorch's check when no output is differentiable (``f`` returns ``()`` or only
    integers): there is nothing to compare, and the outputs must not move under eps."""
    for j, x0 in enumerate(p.x0):
        x = np.asarray(x0, np.float64).reshape(-1)
        for e in range(x.size):
            plus, minus = x.copy(), x.copy()
            plus[e] += eps
            minus[e] -= eps
            xp, xm = list(p.x0), list(p.x0)
            xp[j] = jnp.asarray(plus.reshape(np.shape(x0)))
            xm[j] = jnp.asarray(minus.reshape(np.shape(x0)))
            for o, (a, b) in enumerate(zip(fn(xp), fn(xm))):
                if not np.array_equal(np.asarray(a), np.asarray(b)):
                    return _fail(
                        f"{what}: Numerical gradient for function expected to be zero: the "
                        f"function has no floating-point output, but output {o} changes when "
                        f"input {p.diff[j]} ({p.labels[j]}) moves by eps={eps:g}. Return it "
                        "as a float if it is differentiable.",
                        raise_exception,
                    )
    return True


def _check_backward_mul_by_grad_output(
    p: _Problem, out_leaves, out_tree, vjp_fn, what, raise_exception
) -> bool:
    """PyTorch's ``_test_backward_mul_by_grad_output``: with a zero cotangent for every
    output, every input's gradient must be zero. A backward that adds something to the
    cotangent instead of scaling it can pass a loose Jacobian check; this one it fails."""
    in_cts = vjp_fn(tree_util.tree_unflatten(out_tree, [_zero_ct(o) for o in out_leaves]))
    for j in range(len(p.x0)):
        g = np.asarray(in_cts[j], np.float64)
        if g.size and np.any(g != 0):
            k = int(np.argmax(np.abs(g).reshape(-1) != 0))
            return _fail(
                f"{what}: backward not multiplied by grad_output: with a zero cotangent for "
                f"every output, the gradient of input {p.diff[j]} ({p.labels[j]}) is "
                f"{float(g.reshape(-1)[k])!r} at element {_fmt_idx(g.shape, k)}, not 0. A "
                "backward (a tg.Function's backward, a tg.hook) must scale with the cotangent "
                "it receives (return g * ..., not g + c or a constant).",
                raise_exception,
            )
    return True


def _zero_ct(o):
    dt = np.dtype(jnp.result_type(o))
    if jnp.issubdtype(dt, jnp.inexact):
        return np.zeros(np.shape(o), dt)
    return np.zeros(np.shape(o), jax.dtypes.float0)


def _fmt_idx(shape, flat: int) -> str:
    return str(tuple(int(i) for i in np.unravel_index(flat, shape))) if shape else "()"


def _small(a: np.ndarray) -> str:
    return np.array2string(a, precision=6, max_line_width=100, threshold=64)


def _fail(msg: str, raise_exception: bool) -> bool:
    if raise_exception:
        raise GradcheckError(msg)
    return False


def _analytical(p: _Problem, policy):
    """tapegrad's vjp over the checked inputs: (flat outputs, output tree, vjp_fn)."""
    out, vjp_fn = tg_vjp(lambda *xs: p.call(xs), *p.x0, policy=policy)
    leaves, tree = tree_util.tree_flatten(out)
    return leaves, tree, vjp_fn


def _diff(fp, fm, o: int, eps: float) -> np.ndarray:
    return (np.asarray(fp[o], np.float64) - np.asarray(fm[o], np.float64)) / (2 * eps)


def _numerical_columns(
    p: _Problem, fn, j: int, eps: float, out_idx
) -> dict[int, np.ndarray | None]:
    """d outputs / d (checked input j) by central differences: {output: (n_out, n_in)},
    None for every output when input j is empty."""
    x = np.asarray(p.x0[j], np.float64).reshape(-1)
    cols: dict[int, list] = {o: [] for o in out_idx}
    for e in range(x.size):
        plus, minus = x.copy(), x.copy()
        plus[e] += eps
        minus[e] -= eps
        xp, xm = list(p.x0), list(p.x0)
        xp[j] = jnp.asarray(plus.reshape(np.shape(p.x0[j])))
        xm[j] = jnp.asarray(minus.reshape(np.shape(p.x0[j])))
        fp, fm = fn(xp), fn(xm)
        for o in out_idx:
            cols[o].append(_diff(fp, fm, o, eps).reshape(-1))
    return {o: np.stack(c, axis=1) if c else None for o, c in cols.items()}


def _check_full(p: _Problem, fn, eps, atol, rtol, raise_exception, policy, what) -> bool:
    out_leaves, out_tree, vjp_fn = _analytical(p, policy)
    out_idx = _float_outputs(out_leaves, what)
    if not out_idx:
        return _no_differentiable_outputs(p, fn, eps, raise_exception, what)
    # One vjp per output element gives that row of every input's Jacobian.
    rows: dict[tuple[int, int], list] = {(o, j): [] for o in out_idx for j in range(len(p.x0))}
    for o in out_idx:
        size = int(np.size(out_leaves[o]))
        for e in range(size):
            cts = [_zero_ct(x) for x in out_leaves]
            onehot = np.zeros(size, np.float64)
            onehot[e] = 1.0
            cts[o] = jnp.asarray(
                onehot.reshape(np.shape(out_leaves[o])), jnp.result_type(out_leaves[o])
            )
            in_cts = vjp_fn(tree_util.tree_unflatten(out_tree, cts))
            for j in range(len(p.x0)):
                rows[(o, j)].append(np.asarray(in_cts[j], np.float64).reshape(-1))
    for j in range(len(p.x0)):
        n_in = int(np.size(p.x0[j]))
        if n_in == 0:
            continue
        num = _numerical_columns(p, fn, j, eps, out_idx)
        for o in out_idx:
            if not rows[(o, j)]:
                continue  # an empty output
            a, n = np.stack(rows[(o, j)]), num[o]
            assert n is not None  # input j is not empty (n_in > 0)
            ok = (np.abs(a - n) <= atol + rtol * np.abs(n)) | ((a == n) & ~np.isnan(a))
            if ok.all():
                continue
            r, c = np.argwhere(~ok)[0]
            diffs = np.abs(a - n)
            msg = [
                f"{what}: Jacobian mismatch for output {o} with respect to input {p.diff[j]} "
                f"({p.labels[j]}), at element {_fmt_idx(np.shape(p.x0[j]), c)} of the input "
                f"and element {_fmt_idx(np.shape(out_leaves[o]), r)} of the output:",
                f"    analytical (tapegrad): {float(a[r, c])!r}",
                f"    numerical  (central differences, eps={eps:g}): {float(n[r, c])!r}",
                f"    |difference| = {diffs[r, c]:.3g} > atol + rtol * |numerical| = "
                f"{atol + rtol * abs(n[r, c]):.3g}",
                f"{int((~ok).sum())} of {ok.size} elements differ; the largest difference is "
                f"{np.nanmax(diffs) if np.isfinite(diffs).any() else np.nan:.3g}.",
            ]
            if a.size <= 64:
                msg += [
                    "analytical Jacobian (rows: output elements, columns: input elements):",
                    _small(a),
                    "numerical Jacobian:",
                    _small(n),
                ]
            return _fail("\n".join(msg), raise_exception)
    return _check_backward_mul_by_grad_output(
        p, out_leaves, out_tree, vjp_fn, what, raise_exception
    )


def _unit(rng, shape) -> np.ndarray:
    v = rng.uniform(0.0, 1.0, size=shape)
    norm = np.linalg.norm(v)
    return v / norm if norm > 0 else v


def _check_fast(p: _Problem, fn, eps, atol, rtol, raise_exception, policy, what, seed) -> bool:
    """PyTorch's fast mode: for each output o and input j, compare u_o^T J_oj v_j (one
    vjp per output) with u_o^T (J_oj v_j by central differences)."""
    rng = np.random.default_rng(seed)
    out_leaves, out_tree, vjp_fn = _analytical(p, policy)
    out_idx = _float_outputs(out_leaves, what)
    if not out_idx:
        return _no_differentiable_outputs(p, fn, eps, raise_exception, what)
    u = {o: _unit(rng, np.shape(out_leaves[o])) for o in out_idx}
    v = [_unit(rng, np.shape(x)) for x in p.x0]
    fd = []  # per input: (f(x + eps v), f(x - eps v))
    for j, x0 in enumerate(p.x0):
        x = np.asarray(x0, np.float64)
        xp, xm = list(p.x0), list(p.x0)
        xp[j], xm[j] = jnp.asarray(x + eps * v[j]), jnp.asarray(x - eps * v[j])
        fd.append((fn(xp), fn(xm)))
    for o in out_idx:
        cts = [_zero_ct(x) for x in out_leaves]
        cts[o] = jnp.asarray(u[o], jnp.result_type(out_leaves[o]))
        in_cts = vjp_fn(tree_util.tree_unflatten(out_tree, cts))
        for j in range(len(p.x0)):
            analytical = float(np.sum(np.asarray(in_cts[j], np.float64) * v[j]))
            numerical = float(np.sum(u[o] * _diff(*fd[j], o, eps)))
            # As in PyTorch, atol scales with the sums of the projection vectors.
            tol = atol * float(np.sum(u[o])) * float(np.sum(v[j])) + rtol * abs(numerical)
            if not abs(analytical - numerical) <= tol:
                return _fail(
                    f"{what} (fast_mode): Jacobian mismatch for output {o} with respect to "
                    f"input {p.diff[j]} ({p.labels[j]}): the projection u^T J v is "
                    f"{analytical!r} analytically (tapegrad) and {numerical!r} numerically, "
                    f"|difference| {abs(analytical - numerical):.3g} > tolerance {tol:.3g}. "
                    "Rerun with fast_mode=False to find the element.",
                    raise_exception,
                )
    return _check_backward_mul_by_grad_output(
        p, out_leaves, out_tree, vjp_fn, what, raise_exception
    )


def gradcheck(
    f: Callable,
    args: Any,
    eps: float = 1e-6,
    atol: float = 1e-5,
    rtol: float = 1e-3,
    raise_exception: bool = True,
    fast_mode: bool = False,
    *,
    allow_low_precision: bool = False,
    policy: Any = None,
    seed: int = 0,
) -> bool:
    """Check tapegrad's reverse-mode Jacobian of ``f(*args)`` against central differences.

    ```python
    x = np.random.randn(3, 4); w = np.random.randn(5, 4)
    tg.gradcheck(lambda x, w: jnp.tanh(x @ w.T), (x, w))      # True, or raises
    ```

    Args:
      f: a function of ``*args`` returning an array or a pytree of arrays.
      args: a tuple of arguments (pytrees allowed; a single array is taken as ``(x,)``).
        Every floating leaf is checked; integer and boolean leaves are passed as they are.
      eps: the finite-difference step.
      atol, rtol: an element passes when ``|analytical - numerical| <= atol + rtol * |numerical|``.
      raise_exception: raise `tg.GradcheckError` on a mismatch (else return False).
      fast_mode: compare one random projection ``u^T J v`` per input (one vjp and two
        function calls per input) instead of the full Jacobian.
      allow_low_precision: cast float32/float16/bfloat16 inputs to float64 instead of
        refusing them (`tg.DtypeError`, with the reason).
      policy: the residual policy the analytical side runs under (check a policy's gradient).
      seed: the random projection's seed (fast mode).

    Runs with ``jax_enable_x64`` on, in a scope that restores the caller's setting.
    """
    return _gradcheck(
        f,
        args,
        eps,
        atol,
        rtol,
        raise_exception,
        fast_mode,
        allow_low_precision,
        policy,
        seed,
        "gradcheck",
    )


def _gradcheck(
    f,
    args,
    eps,
    atol,
    rtol,
    raise_exception,
    fast_mode,
    allow_low_precision,
    policy,
    seed,
    what,
    n_args=None,
) -> bool:
    with jax.enable_x64(True):
        p = _Problem(f, _as_tuple(args), allow_low_precision, eps, atol, what, n_args)
        fn = jax.jit(lambda xs: tree_util.tree_leaves(p.call(xs)))
        if fast_mode:
            return _check_fast(p, fn, eps, atol, rtol, raise_exception, policy, what, seed)
        return _check_full(p, fn, eps, atol, rtol, raise_exception, policy, what)


def gradgradcheck(
    f: Callable,
    args: Any,
    grad_outputs: Any = None,
    eps: float = 1e-6,
    atol: float = 1e-5,
    rtol: float = 1e-3,
    raise_exception: bool = True,
    fast_mode: bool = False,
    *,
    allow_low_precision: bool = False,
    policy: Any = None,
    seed: int = 0,
) -> bool:
    """Check second derivatives: `gradcheck` of ``(args, v) -> vjp(f, *args)(v)``.

    As PyTorch's ``gradgradcheck``, the cotangent ``v`` (``grad_outputs``, random
    float64 values by default) is an input of the checked function too, so both
    halves of the second-order vjp are checked. The analytical side differentiates
    tapegrad's own backward with tapegrad (``tg.vjp`` of ``tg.vjp``).
    """
    what = "gradgradcheck"
    args = _as_tuple(args)
    with jax.enable_x64(True):
        p = _Problem(f, args, allow_low_precision, eps, atol, what)
        host_args = p.args_with(p.x0)
        out = f(*host_args)
        out_leaves, out_tree = tree_util.tree_flatten(out)
        _float_outputs(out_leaves, what)
        if any(not jnp.issubdtype(jnp.result_type(o), jnp.floating) for o in out_leaves):
            raise DtypeError(
                f"{what}: every output must be floating (their cotangents are "
                "inputs of the checked function)."
            )
        if grad_outputs is None:
            rng = np.random.default_rng(seed)
            v = [rng.standard_normal(np.shape(o)) for o in out_leaves]
        else:
            v = [np.asarray(c, np.float64) for c in tree_util.tree_leaves(grad_outputs)]
            if len(v) != len(out_leaves):
                raise ValueError(
                    f"{what}: grad_outputs has {len(v)} leaves; the function's "
                    f"output has {len(out_leaves)}."
                )
        n = len(args)

        def first_order(*xs):
            primals, cts = xs[:n], xs[n:]
            _, vjp_fn = tg_vjp(f, *primals, policy=policy)
            return vjp_fn(tree_util.tree_unflatten(out_tree, list(cts)))

        return _gradcheck(
            first_order,
            tuple(host_args) + tuple(v),
            eps,
            atol,
            rtol,
            raise_exception,
            fast_mode,
            allow_low_precision,
            policy,
            seed,
            what,
            n_args=n,
        )
