"""Loop checkpoint schedules (issue 12): a long RNN under each `scan_checkpoint` schedule.

    python bench/schedule_bench.py            # T=10,000 steps, batch 8, width 32
    python bench/schedule_bench.py --quick    # T=2,000

For keep-every-step (`save()`), ``scan_checkpoint("sqrt")``, two- and three-level
nested schedules (``levels=2``/``3``), the halving schedule (``every="log"``) and
binomial checkpointing (revolve, ``snapshots=10``/``30``/``100``):

* ``after fwd``: bytes ``tg.vjp`` leaves alive while ``vjp_fn`` is held, beyond the
  inputs and the output, measured from ``jax.live_arrays()`` (after ``gc.collect()``);
  ``predicted``: the schedule's own count (`loop_bytes`: carries kept + remainder steps).
* ``bwd peak``: ``tg.memory_report``'s peak beyond the inputs (the schedule's peak:
  inner levels' carries + one innermost segment, on top of what forward kept);
  ``meas@1k``: measured on a 1,000-step run of the parameters' gradient, eagerly, with a
  policy that samples ``jax.live_arrays()`` at every unpack: bytes beyond what forward
  kept (it includes the innermost segment's input slice, cotangents and temporaries).
* ``re-run``: forward steps backward runs again (`schedule_costs`), ``grad time``: a
  jitted ``tg.grad`` (forward + backward) as a ratio of keep-every-step's, median of
  interleaved rounds (`_timing.interleaved`).
"""

from __future__ import annotations

import argparse
import gc
import platform
import statistics

import jax
import jax.numpy as jnp
from _models import rnn_params
from _timing import interleaved

import tapegrad as tg
from tapegrad.engine.loops.saves import loop_bytes, schedule_costs

B, W = 8, 32

SCHEDULES = {
    "save (every step)": None,
    "sqrt": dict(every="sqrt"),
    "levels=2": dict(every="sqrt", levels=2),
    "levels=3": dict(every="sqrt", levels=3),
    "log": dict(every="log"),
    "snapshots=10": dict(snapshots=10),
    "snapshots=30": dict(snapshots=30),
    "snapshots=100": dict(snapshots=100),
}


def rnn_loss(p, xs):
    """``h = tanh(h @ w + x @ u)`` over ``xs`` with ``lax.scan``; per-step outputs are
    ``sum(h)`` (a small ys, so its cotangent does not dwarf the residuals)."""
    w, u = p["w"], p["u"]

    def step(h, x):
        h = jnp.tanh(h @ w + x @ u)
        return h, jnp.sum(h, -1)

    h0 = jnp.zeros((xs.shape[1], w.shape[0]), xs.dtype)
    h, ys = jax.lax.scan(step, h0, xs)
    return jnp.mean(h**2) + jnp.mean(ys)


def live() -> int:
    gc.collect()
    return sum(a.nbytes for a in jax.live_arrays() if not a.is_deleted())


def inputs(T: int):
    p = rnn_params(jax.random.key(0), W, W)
    xs = jax.random.normal(jax.random.key(1), (T, B, W))
    return p, xs


def policy(kw, base=None):
    if kw is None:
        return tg.policies.scan_checkpoint(min_length=10**9, base=base)  # keeps every step
    return tg.policies.scan_checkpoint(base=base, **kw)


def scan_record(p, xs, pol):
    (rec,) = [r for r in tg.trace(rnn_loss, policy=pol)(p, xs).records if r.primitive == "scan"]
    return rec


def after_forward(p, xs, pol) -> int:
    before = live()
    out, vjp_fn = tg.vjp(rnn_loss, p, xs, policy=pol)
    held = live() - before - out.nbytes
    del out, vjp_fn
    return held


class PeakSpy:
    """Samples live device bytes whenever backward unpacks a residual."""

    def __init__(self):
        self.peak = 0

    def pack(self, value, info):
        return value

    def unpack(self, packed, info):
        self.peak = max(self.peak, live())
        return packed


def measured_peak(kw, T: int = 1000) -> int:
    p, xs = inputs(T)
    spy = PeakSpy()
    pol = policy(kw, spy)
    gc.collect()
    gc.freeze()  # collections then only scan what the run makes
    try:  # the parameters' gradient only: xs' cotangent would be T steps by itself
        out, vjp_fn = tg.vjp(lambda p: rnn_loss(p, xs), p, policy=pol)
        after = live()
        vjp_fn(jnp.float32(1.0))
    finally:
        gc.unfreeze()
    return spy.peak - after


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    T = 2000 if args.quick else 10_000
    p, xs = inputs(T)
    print(f"# RNN T={T:,}, batch {B}, width {W}; {platform.machine()}, jax {jax.__version__}")
    grads = {}
    rows = []
    want = jax.jit(jax.grad(rnn_loss))(p, xs)
    for name, kw in SCHEDULES.items():
        pol = policy(kw)
        rec = scan_record(p, xs, pol)
        c = schedule_costs(rec)
        lb = loop_bytes(rec)
        held = after_forward(p, xs, pol)
        rep = tg.memory_report(rnn_loss, policy=pol)(p, xs)
        peak = rep.peak_bytes - rep.input_bytes
        meas = measured_peak(kw) if kw is not None and kw.get("every") != "log" else None
        g = jax.jit(tg.grad(rnn_loss, policy=pol))
        err = max(
            float(jnp.max(jnp.abs(a - b)))
            for a, b in zip(jax.tree.leaves(g(p, xs)), jax.tree.leaves(want))
        )
        grads[name] = lambda g=g: g(p, xs)
        levels = "/".join(map(str, c.levels)) if c else "-"
        levels = levels if len(levels) < 16 else f"{c.levels[0]}/…/{c.levels[-1]}"
        if c and c.snapshots:
            levels = f"revolve s={c.snapshots}"
        rows.append((name, levels, held, lb.total, peak, meas, c.recomputed if c else 0, err))
    times = interleaved(grads, rounds=args.rounds, warmup=2)
    base = times["save (every step)"]
    ratio = {k: statistics.median([a / b for a, b in zip(v, base)]) for k, v in times.items()}
    print(
        f"{'schedule':<18} {'segments':<16} {'after fwd':>11} {'predicted':>11} "
        f"{'bwd peak':>11} {'meas@1k':>9} {'re-run':>8} {'grad time':>10} {'max err':>8}"
    )
    for name, levels, held, pred, peak, meas, rerun, err in rows:
        m = f"{meas:>9,}" if meas is not None else f"{'-':>9}"
        print(
            f"{name:<18} {levels:<16} {held:>11,} {pred:>11,} {peak:>11,} {m} {rerun:>8,} "
            f"{ratio[name]:>9.2f}x {err:>8.1e}"
        )
    print(f"keep-every-step grad: {statistics.median(base) * 1e3:.1f} ms (jit)")


if __name__ == "__main__":
    main()
