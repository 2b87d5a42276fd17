"""``compress(bits="auto", budget_bits=...)``: a bit width per residual, spent where the
gradient is most sensitive to rounding (GACT, Liu et al., ICML 2022).

The model. Stochastic rounding at ``b`` bits adds to the gradient an error whose mean
square is, for residual ``r``, about ``c_r * S(b)`` with ``S(b) = (2**b - 1) ** -2``:
the step of a group is its range over ``2**b - 1`` levels, and the rounding variance of
one value is at most a quarter of the step squared. (GACT writes ``4**-b``, the same
for large ``b``; at 2 bits the levels are 3, not 4, and ``S(2) / S(4)`` is 25, not 16.)
Errors of different residuals are independent and add. ``c_r`` is measured: with
residual ``r`` alone rounded at ``probe_bits`` under ``samples`` keys, the mean squared
distance of the gradient from the exact one (`save()`'s), over ``S(probe_bits)``. A
residual whose backward is nonlinear in it (``tanh`` reads ``1 - y**2``) adds a bias
too; it is in the measured distance, so such residuals look as sensitive as they are.

The allocation minimises ``sum_r c_r * S(b_r)`` subject to ``sum_r b_r * n_r <=
budget_bits * sum_r n_r`` (``n_r``: values packed per forward, a loop body's times its
trip count), ``b_r`` in 2, 4, 8 or the residual's own width (kept as it is). It is a
multiple-choice knapsack, solved exactly by dynamic programming over the bit budget
(ActNN's way; GACT's greedy, the upgrade removing the most error per bit first, was 2-4x
off the optimum on 9% of random 2-5 residual problems, whose last upgrades do not fit).

Residuals are named by `_lowbit.residual_path` (loop records, record, which value):
the names that seed their noise, the same in every trace of the function.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from tapegrad.api.transforms import grad
from tapegrad.core.residual_policy import as_array
from tapegrad.policies._lowbit import (
    lowbit_layout,
    pack_lowbit,
    packed_nbytes,
    reads_positive,
    residual_id,
    residual_name,
    stays_exact,
    unpack_lowbit,
)

__all__ = ["Allocated", "BitAllocation", "allocate", "fit_allocation", "rounding_variance"]

LADDER = (2, 4, 8)


def rounding_variance(bits: int, keep_bits: int = 32) -> float:
    """``S(b)``: the rounding error's mean square, in units of a group's range squared
    (0 for a residual kept as it is)."""
    return 0.0 if bits >= keep_bits else float(2**bits - 1) ** -2


@dataclass(frozen=True)
class Allocated:
    """One residual's bit width and what it was chosen from."""

    name: str  # `_lowbit.residual_name`: "#3 out0", "#5/#2 in1" (record #2 in loop #5)
    primitive: str
    shape: tuple[int, ...]
    dtype: str
    values: int  # values packed per forward: its size times the enclosing trip counts
    sensitivity: float  # c_r: squared gradient error per unit of S(bits)
    bits: int  # 2, 4, 8, or the dtype's own width (kept as it is)
    keep_bits: int  # the dtype's own width
    source: str = ""
    # Packing it at 2 bits would not shrink it (a handful of values: the group's min and
    # scale cost more): kept as it is, outside the budget.
    fixed: bool = False


@dataclass(frozen=True)
class BitAllocation:
    """The bit width of each residual a `compress(bits="auto")` policy packs, as chosen
    by `Compress.fit`. ``bits`` maps residual names to widths; ``print`` shows a table."""

    budget_bits: float
    rows: tuple[Allocated, ...]
    probe_bits: int = 2
    samples: int = 4
    bits: dict[str, int] = field(init=False, repr=False, compare=False, hash=False)

    def __post_init__(self):
        object.__setattr__(self, "bits", {r.name: r.bits for r in self.rows})

    @property
    def values(self) -> int:
        """Values under the budget (per forward)."""
        return sum(r.values for r in self.rows if not r.fixed)

    @property
    def average_bits(self) -> float:
        """Bits a value, averaged over the residuals under the budget (codes only: each
        group's bfloat16 min and scale come on top)."""
        n = self.values
        return sum(r.bits * r.values for r in self.rows if not r.fixed) / n if n else 0.0

    @property
    def predicted_error(self) -> float:
        """The model's mean squared gradient error, ``sum_r c_r * S(b_r)``."""
        return sum(r.sensitivity * rounding_variance(r.bits, r.keep_bits) for r in self.rows)

    def __str__(self) -> str:
        lines = [
            f"bit allocation: {self.average_bits:.2f} bits a value on average over "
            f"{self.values:,} values (budget {self.budget_bits:g}); sensitivities from "
            f"{self.samples} samples at {self.probe_bits} bits",
            f"{'residual':<14} {'primitive':<20} {'shape':<22} {'values':>10} "
            f"{'sensitivity':>11} {'bits':>5}  source",
        ]
        for r in self.rows:
            bits = f"{r.bits}" + ("*" if r.fixed else "")
            shape = f"{r.dtype}{list(r.shape)}".replace(" ", "")
            lines.append(
                f"{r.name:<14} {r.primitive:<20} {shape:<22} {r.values:>10,} "
                f"{r.sensitivity:>11.3g} {bits:>5}  {r.source}"
            )
        if any(r.fixed for r in self.rows):
            lines.append("* kept as it is: too few values for a group's min and scale to pay")
        return "\n".join(lines)


# Widths of the dynamic program's bit budget: weights are counted in units of at least
# gcd(2 n_r) bits, coarser when the budget would need more units than this.
_UNITS = 1 << 15


def allocate(
    sensitivity: Sequence[float],
    values: Sequence[int],
    budget_bits: float,
    keep_bits: Sequence[int],
) -> list[int]:
    """Bits per residual minimising ``sum_r c_r S(b_r)`` under ``sum_r b_r n_r <=
    budget_bits * sum_r n_r``: a multiple-choice knapsack, solved exactly by dynamic
    programming over the bit budget (see the module notes). Ties go to fewer bits."""
    ladders = [[*LADDER, k] if k > LADDER[-1] else list(LADDER) for k in keep_bits]
    if not ladders:
        return []
    cap_bits = budget_bits * sum(values)
    # Every width is even, so 2 n_r bits divide every weight; a coarser unit rounds the
    # weights up (never the budget), so a plan that fits in units fits in bits.
    unit = 2 * math.gcd(*(int(n) for n in values))
    unit = max(unit, math.ceil(cap_bits / _UNITS))
    cap = int(cap_bits // unit)
    best = np.zeros(cap + 1)  # least error of the residuals so far within w units
    picks = np.zeros((len(ladders), cap + 1), np.int8)
    for r, lad in enumerate(ladders):
        new = np.full(cap + 1, np.inf)
        for j, b in enumerate(lad):
            w = math.ceil(b * values[r] / unit)
            if w > cap:
                continue
            cand = best[: cap + 1 - w] + sensitivity[r] * rounding_variance(b, keep_bits[r])
            better = cand < new[w:]
            new[w:] = np.where(better, cand, new[w:])
            picks[r, w:][better] = j
        best = new
    if not np.isfinite(best[cap]):
        raise ValueError(
            f"compress(bits='auto'): budget_bits={budget_bits:g} cannot hold every "
            "residual at 2 bits"
        )
    out, w = [], cap
    for r in reversed(range(len(ladders))):
        b = ladders[r][picks[r, w]]
        out.append(b)
        w -= math.ceil(b * values[r] / unit)
    return out[::-1]


class _Recorder:
    """Packs nothing; notes every residual ``applies`` says the policy would pack."""

    def __init__(self, policy: Any):
        self.policy, self.applies = policy, policy._applies
        self.group, self.inputs = policy.group, policy.inputs
        self.seen: dict[str, tuple[Any, bool]] = {}

    def pack(self, value, info):
        if self.applies(info):
            value = as_array(value, info)
            lay = lowbit_layout(value, LADDER[0], self.group)
            # kept as it is (compress's pack): too small to shrink, or `stays_exact`
            fixed = packed_nbytes(lay, LADDER[0], value.dtype) >= info.nbytes or stays_exact(info)
            self.seen.setdefault(residual_name(info), (info, fixed))
        return value

    def unpack(self, packed, info):
        return packed

    def keeps_exact(self, info) -> bool:
        # the switches `compress` allows (relu's mask off its output), so that the
        # residuals seen here are the ones the fitted policy packs
        return self.policy.keeps_exact(info)


class _Probe:
    """Rounds residual number ``active`` (of ``index``) at ``bits`` under key ``words``
    and leaves the others exact: one compiled program probes every residual."""

    def __init__(self, active, words, index: dict, bits: int, policy: Any):
        self.active, self.words, self.index = active, words, index
        self.bits, self.policy = bits, policy
        self.group, self.inputs = policy.group, policy.inputs

    def pack(self, value, info):
        i = self.index.get(residual_name(info))
        if i is None:
            return value
        value = as_array(value, info)
        lay = lowbit_layout(value, self.bits, self.group)
        rid = residual_id(info)

        positive = reads_positive(info)

        def rounded(v):
            packed = pack_lowbit(v, self.words, rid, bits=self.bits, lay=lay, positive=positive)
            return unpack_lowbit(packed, v.dtype)

        # A cond, not a select: each gradient rounds one residual, not all of them.
        return jax.lax.cond(self.active == i, rounded, lambda v: v, value)

    def unpack(self, packed, info):
        return packed

    def keeps_exact(self, info) -> bool:
        return self.policy.keeps_exact(info)


def fit_allocation(
    policy: Any,
    fun: Callable,
    args: tuple,
    argnums: int | Sequence[int],
    budget_bits: float,
    samples: int,
    probe_bits: int,
    seed: int,
) -> BitAllocation:
    """Measure each residual's sensitivity on ``fun(*args)`` and allocate (see `Compress.fit`)."""
    rec = _Recorder(policy)
    jax.eval_shape(grad(fun, argnums, policy=rec), *args)
    names = list(rec.seen)
    probed = [n for n in names if not rec.seen[n][1]]
    index = {n: i for i, n in enumerate(probed)}
    sens = dict.fromkeys(names, 0.0)
    if probed:
        ref = jax.jit(grad(fun, argnums))(*args)
        words = np.random.default_rng(seed).integers(0, 2**32, (samples, 2), dtype=np.uint32)

        def sq_err(active, w, args, ref):
            pol = _Probe(active, w, index, probe_bits, policy)
            g = grad(fun, argnums, policy=pol)(*args)
            diffs = jax.tree_util.tree_map(lambda a, b: jnp.sum(jnp.square(a - b)), g, ref)
            return sum(jax.tree_util.tree_leaves(diffs))

        @jax.jit
        def measure(args, ref, words):
            # One residual at a time (memory of one gradient per sample), samples batched.
            per = jax.vmap(sq_err, (None, 0, None, None))
            return jax.lax.map(lambda r: per(r, words, args, ref), jnp.arange(len(probed)))

        err = np.asarray(measure(args, ref, jnp.asarray(words)), np.float64)
        s = rounding_variance(probe_bits)
        for n, e in zip(probed, err.mean(axis=1)):
            sens[n] = float(e) / s
    infos = [rec.seen[n][0] for n in names]
    values = [int(np.prod(i.shape, dtype=np.int64)) * i.trip_count for i in infos]
    keep = [np.dtype(i.dtype).itemsize * 8 for i in infos]
    fixed = [rec.seen[n][1] for n in names]
    free = [i for i, f in enumerate(fixed) if not f]
    chosen = allocate(
        [sens[names[i]] for i in free],
        [values[i] for i in free],
        budget_bits,
        [keep[i] for i in free],
    )
    bits = list(keep)
    for i, b in zip(free, chosen):
        bits[i] = b
    rows = tuple(
        Allocated(
            n,
            i.primitive,
            tuple(i.shape),
            np.dtype(i.dtype).name,
            v,
            sens[n],
            b,
            k,
            i.record.short_source,
            f,
        )
        for n, i, v, b, k, f in zip(names, infos, values, bits, keep, fixed)
    )
    return BitAllocation(float(budget_bits), rows, probe_bits, samples)
