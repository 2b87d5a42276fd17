"""What anomaly mode checks, and how one value is checked: `AnomalyMode` (the options),
the probes (one fused ``max |x|`` float32 per value, computed on device) and the codes
the host reads off them, and `Site` (one checked value, or a loop's block of them) with
`locate` / `flat_codes` over those blocks. `tapegrad.anomaly.detect` is the public entry."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from tapegrad.core.tape import Record

__all__ = ["AnomalyMode", "Site", "checkable", "code_of", "first_bad", "flat_codes", "locate"]


@dataclasses.dataclass(frozen=True)
class AnomalyMode:
    """What anomaly detection checks.

    check_nan: report NaN values (PyTorch's default).
    check_inf: report Inf values as well (``sqrt`` at 0 has an infinite derivative).
    forward: check every record's outputs in forward, not only cotangents in
      backward. Turn it off when a ``jnp.where`` discards NaNs on purpose.
    check_leaks: trace under ``jax.checking_leaks()`` and raise `TracerLeakError`
      when a traced value escapes the function (slow: a garbage collection per trace).
    halt: raise at the first failed check (True), or collect every origin into ``log``
      and run to the end (False).
    post_mortem: when halting eagerly, open pdb in the caller's frame, with the error as
      ``anomaly`` (its ``.record`` and ``.operands``).
    """

    check_nan: bool = True
    check_inf: bool = False
    forward: bool = True
    check_leaks: bool = False
    halt: bool = True
    post_mortem: bool = False
    log: Any = dataclasses.field(default=None, compare=False, repr=False)

    def __post_init__(self):
        if not (self.check_nan or self.check_inf):
            raise ValueError(
                "anomaly detection needs check_nan=True or check_inf=True "
                "(otherwise it checks nothing)."
            )

    @property
    def what(self) -> str:
        return " or ".join(w for w, on in (("NaN", self.check_nan), ("Inf", self.check_inf)) if on)


OK, NAN, INF = 0, 1, 2


def _probe(x):
    """``max |x|`` as a float32 scalar, NaN if ``x`` has a NaN: +inf if it has an Inf and
    no NaN, finite otherwise.

    NaN is found by ``any(isnan(x))``, not by the maximum: XLA's CPU reduce-max drops NaNs
    in arrays of a few thousand elements or more (jax 0.10.2: ``jnp.max`` of 4,096 ones
    with one NaN is 1.0, of 262,144 NaNs is -inf), so a maximum alone misses them. Both
    reductions read ``x`` in one jitted call. A finite float64 maximum is reported as 0
    so that the cast to float32 cannot overflow into a false Inf.
    """
    m = jnp.max(jnp.abs(x), initial=0)
    if jnp.dtype(m.dtype).itemsize > 4:
        m = jnp.where(jnp.isfinite(m), jnp.zeros((), m.dtype), m)
    m = m.astype(jnp.float32)
    return jnp.where(jnp.any(jnp.isnan(x)), jnp.float32(jnp.nan), m)


_probe_jit = jax.jit(_probe)  # eagerly: one dispatch per checked value


def checkable(x) -> bool:
    dt = getattr(x, "dtype", None)
    return dt is not None and jnp.issubdtype(dt, jnp.inexact)


def code_of(x, mode: AnomalyMode):
    """The probe of one value (the mode is applied when probes become codes)."""
    if isinstance(x, jax.core.Tracer):
        return _probe(x)
    return _probe_jit(x)


def codes_of(probes, mode: AnomalyMode) -> np.ndarray:
    p = np.asarray(probes, np.float32)
    c = np.zeros(p.shape, np.int8)
    if mode.check_inf:
        c[np.isinf(p)] = INF
    if mode.check_nan:
        c[np.isnan(p)] = NAN
    return c


def first_bad(probes, n: int, mode: AnomalyMode) -> tuple[int, int] | None:
    """(site index, code) of the first failed check; ``probes`` may carry batch dims (vmap)."""
    c = codes_of(probes, mode).reshape(-1, n)
    per_site = np.where((c == NAN).any(axis=0), NAN, c.max(axis=0))
    bad = np.flatnonzero(per_site)
    return None if bad.size == 0 else (int(bad[0]), int(per_site[bad[0]]))


@dataclasses.dataclass(frozen=True)
class Site:
    """One checked value: ``kind`` is "input" (a function input), "forward" (a record's
    output), "cotangent" (a cotangent passed to vjp_fn) or "backward" (the cotangent a
    record's VJP rule returned for one of its inputs)."""

    kind: str
    index: int
    record: Record | None = None
    var: Any = None
    label: str = ""
    # kind "loop": the checks of a loop/branch record's body, once per step; ``body`` are
    # one step's sites, ``steps`` the step indices in the order they ran.
    body: tuple[Site, ...] = ()
    steps: tuple[int, ...] = ()
    producers: Any = None

    @property
    def size(self) -> int:
        """How many probes this site stands for."""
        if self.kind != "loop":
            return 1
        return len(self.steps) * sum(s.size for s in self.body)


def locate(sites: Sequence[Site], k: int) -> tuple[Site, list[tuple[Site, int]]]:
    """The site of flat probe ``k`` and the loops (with their step) it sits in."""
    for s in sites:
        n = s.size
        if k < n:
            if s.kind != "loop":
                return s, []
            t, r = divmod(k, n // len(s.steps))
            sub, path = locate(s.body, r)
            return sub, [(s, s.steps[t])] + path
        k -= n
    raise IndexError(k)


def flat_codes(codes: Sequence[Any]):
    """One vector of probes: a loop's block of probes is flattened in place."""
    if not any(isinstance(c, jax.core.Tracer) for c in codes):
        return np.concatenate([np.ravel(np.asarray(c, np.float32)) for c in jax.device_get(codes)])
    return jnp.concatenate([jnp.ravel(c).astype(jnp.float32) for c in codes])
