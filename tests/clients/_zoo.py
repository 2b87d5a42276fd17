"""What every client-library case checks: tapegrad's gradient against jax's, eagerly and
under `jax.jit`, under `offload()` and a `budget(...)`, and `tg.memory_report`'s headline
bytes against the arrays `tg.vjp`'s forward really leaves alive.

A case is a loss over float pytrees; the library's static parts (an equinox module's
non-array fields, a solver) are closed over. jax's gradient (jitted) is computed once per
case and shared by its modes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
from conftest import assert_trees_close, live_bytes_by_kind

import tapegrad as tg
from tapegrad import policies as P

MODES = ("eager", "jit", "offload", "budget", "memory")  # and "at_save" (see `matrix`)

# Why a case's at_save mode is an expected failure, where it is one.
PLANNER_ABOVE_SAVE = (
    "the planner's least peak exceeds the peak save() itself reaches (memory_report)"
)


@dataclasses.dataclass
class Case:
    loss: Callable
    args: tuple
    argnums: int | tuple[int, ...] = 0
    rtol: float = 1e-5
    atol: float = 1e-6
    # The budget, as a fraction of the peak that backward holds beyond the inputs under
    # save(); `allow` the mechanisms the planner may use for it.
    budget_fraction: float = 0.5
    allow: tuple[str, ...] = ("save", "recompute")
    _ref: Any = dataclasses.field(default=None, repr=False)

    def reference(self):
        if self._ref is None:
            self._ref = jax.jit(jax.grad(self.loss, argnums=self.argnums))(*self.args)
        return self._ref

    def assert_close(self, got) -> None:
        assert_trees_close(got, self.reference(), rtol=self.rtol, atol=self.atol)


def budget_of(case: Case, fraction: float | None = None) -> Any:
    rep = tg.memory_report(case.loss, case.argnums)(*case.args)
    frac = case.budget_fraction if fraction is None else fraction
    return P.budget(bytes=max(int(rep.peak_beyond_inputs_bytes * frac), 1), allow=case.allow)


def assert_report_matches_live_arrays(case: Case, policy: Any) -> None:
    """`memory_report`'s residual bytes beyond the inputs, by memory kind, against the
    live jax arrays that `tg.vjp`'s ``vjp_fn`` holds: what `del vjp_fn` frees (a
    library's first call may also fill caches of its own; those stay alive).

    The report counts every residual; `jax.live_arrays()` misses two kinds that a
    library's tape keeps: numpy-backed constants (jax's ``TypedNdArray`` literals in a
    custom_vjp's residuals) and closed-over arrays that were alive before the call. The
    report may exceed what is freed by those bytes, read off ``vjp_fn``'s leaves (a
    `jax.tree_util.Partial` whose leaves are the residuals), and by no more.
    """
    every = tuple(range(len(case.args)))  # tg.vjp differentiates every argument
    rep = tg.memory_report(case.loss, every, policy=policy)(*case.args)
    before = {id(a) for a in jax.live_arrays()}
    out, vjp_fn = tg.vjp(case.loss, *case.args, policy=policy)
    jax.block_until_ready(out)
    held = live_bytes_by_kind()
    inputs = {id(x) for x in jax.tree_util.tree_leaves(case.args)}
    unseen, seen_ids = 0, set()
    for leaf in jax.tree_util.tree_leaves(vjp_fn):
        if id(leaf) in seen_ids or id(leaf) in inputs:
            continue
        seen_ids.add(id(leaf))
        if not isinstance(leaf, jax.Array) or id(leaf) in before:
            unseen += getattr(leaf, "nbytes", 0)
    del vjp_fn, leaf
    freed_to = live_bytes_by_kind()
    freed = {k: held.get(k, 0) - freed_to.get(k, 0) for k in set(held) | set(freed_to)}
    reported = {"device": rep.device_bytes - rep.input_bytes, "pinned_host": rep.host_bytes}
    msg = f"del vjp_fn freed {freed}, unseen by live_arrays {unseen} B\n{rep}"
    for kind, b in reported.items():
        assert 0 <= freed.get(kind, 0) <= b, msg
    assert sum(reported.values()) - sum(freed.values()) <= unseen, msg


def check(case: Case, mode: str) -> None:
    """Run one mode of a case (see `MODES`)."""
    loss, args, argnums = case.loss, case.args, case.argnums
    if mode == "eager":
        case.assert_close(tg.grad(loss, argnums=argnums)(*args))
    elif mode == "jit":
        case.assert_close(jax.jit(tg.grad(loss, argnums=argnums))(*args))
    elif mode == "offload":
        case.assert_close(tg.grad(loss, argnums=argnums, policy=P.offload())(*args))
    elif mode == "budget":
        case.assert_close(tg.grad(loss, argnums=argnums, policy=budget_of(case))(*args))
    elif mode == "at_save":
        # A budget of exactly save()'s own peak is met (saving everything meets it), and
        # the plan it runs holds no more than that.
        pol = budget_of(case, 1.0)
        case.assert_close(tg.grad(loss, argnums=argnums, policy=pol)(*args))
        rep = tg.memory_report(loss, argnums, policy=pol)(*args)
        assert rep.peak_beyond_inputs_bytes <= pol.bytes
    elif mode == "memory":
        for policy in (P.save(), P.offload()):
            assert_report_matches_live_arrays(case, policy)
    else:
        raise ValueError(mode)


def matrix(
    names: tuple[str, ...],
    xfail: dict[tuple[str, str], str] | None = None,
    slow: frozenset[tuple[str, str]] | set[tuple[str, str]] = frozenset(),
    modes: tuple[str, ...] = MODES,
    at_save: str | None = None,
) -> list:
    """``pytest.param(name, mode)`` for every case and mode, with ``xfail(strict=True)``
    on the pairs in ``xfail`` (``(name, "*")`` for every mode of a case) and ``slow`` on
    those in ``slow``. With ``at_save`` (for cases whose budget is below save()'s peak),
    also mode ``"at_save"``, a budget of exactly save()'s peak: in the slow tier
    (``at_save="slow"``) or the quick one (``"quick"``)."""
    import pytest

    xfail = xfail or {}
    out = []
    for name in names:
        for mode in modes + (("at_save",) if at_save else ()):
            marks = []
            reason = xfail.get((name, mode), xfail.get((name, "*")))
            if reason is not None:
                marks.append(pytest.mark.xfail(strict=True, reason=reason))
            slow_at_save = mode == "at_save" and at_save == "slow"
            if (name, mode) in slow or (name, "*") in slow or slow_at_save:
                marks.append(pytest.mark.slow)
            out.append(pytest.param(name, mode, marks=marks, id=f"{name}-{mode}"))
    return out
