"""The budget planner with low-bit formats (``max_error="4-bit"`` / ``"2-bit"``), in one
run:

    python bench/budget_lowbit_bench.py [--rounds 30]

Per model (the 8-layer tanh MLP, width 512, batch 256; the transformer block, 4x128
tokens) and error class (lossless, bf16, int8, 4-bit, 2-bit), with ``allow=("save",
"compress")`` and with every mechanism:

1. the least device peak of activations the planner reaches (bisection on the budget;
   `BudgetError` below it), as a fraction of save()'s (`planner.problem.estimate`), and the
   measured peak of that plan (live arrays, eager): how far each class moves the floor;
2. at a budget below bf16's floor (30% of save()'s activation peak on the MLP, 75% on
   the transformer): the plan's mechanisms, its
   predicted step-time cost, and the jitted step time against save()'s, timed
   interleaved on this machine (`bench/_timing.py`).

Bytes are exact; times depend on the machine and its load (printed).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

import jax

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _models import mlp_loss, mlp_params, split_static, transformer_loss, transformer_params  # noqa: E402
from _timing import interleaved  # noqa: E402

import tapegrad as tg  # noqa: E402
from tapegrad.planner import estimate  # noqa: E402
from tapegrad.planner.measure import measured_peak  # noqa: E402

P = tg.policies
CLASSES = (None, "bf16", "int8", "4-bit", "2-bit")
AT = {"mlp": 0.3, "transformer": 0.75}  # a budget below what bf16 alone reaches
ALLOWS = {"compress": ("save", "compress"), "all": ("save", "recompute", "offload", "compress")}


def models():
    k = jax.random.key(0)
    ws = mlp_params(k, 8, 512)
    x = jax.random.normal(jax.random.key(1), (256, 512))
    p, heads = split_static(transformer_params(k))
    xt = jax.random.normal(jax.random.key(2), (4, 128, 128))
    return {
        "mlp": (mlp_loss, (ws, x)),
        "transformer": (lambda p, x: transformer_loss({**p, "heads": heads}, x), (p, xt)),
    }


def floor(f, args, allow, max_error, full) -> int:
    """The least budget the planner fits, to 1% of save()'s bytes."""
    lo, hi = 0, full
    while hi - lo > full // 100:
        mid = (lo + hi) // 2
        try:
            tg.trace(f, argnums=0, policy=P.budget(mid, allow=allow, max_error=max_error))(*args)
            hi = mid
        except P.BudgetError:
            lo = mid
    return hi


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=30)
    args_ = ap.parse_args()
    c = P.calibrate()
    print(
        f"jax {jax.__version__}, {jax.default_backend()}, {os.cpu_count()} cpus, "
        f"load {os.getloadavg()[0]:.2f}; calibrated: compress {c.compress_bytes_per_s:.2e} B/s, "
        f"low-bit {c.lowbit_bytes_per_s:.2e} B/s, {c.flops_per_s:.2e} flop/s"
    )
    for name, (f, args) in models().items():
        full = estimate(tg.trace(f, argnums=0)(*args))[0]
        print(f"\n## {name}: save()'s peak of activations {full:,} B")
        print("allow     max_error  floor (of save)  measured at floor")
        for a, allow in ALLOWS.items():
            for me in CLASSES:
                b = floor(f, args, allow, me, full)
                pol = P.budget(b, allow=allow, max_error=me, key=0)
                m = measured_peak(f, args, pol)
                print(f"{a:9} {me or 'lossless':10} {b / full:14.1%} {m / full:15.1%}")
        b = int(AT[name] * full)
        print(f"\nat {AT[name]:.0%} of save() ({b:,} B), allow=compress, jitted step vs save():")
        fns = {"save": jax.jit(tg.value_and_grad(f))}
        plans = {}
        for me in CLASSES[1:]:
            pol = P.budget(b, allow=ALLOWS["compress"], max_error=me, key=0)
            try:
                tg.trace(f, argnums=0, policy=pol)(*args)
            except P.BudgetError:
                print(f"  {me:8} no plan fits")
                continue
            plans[me] = pol
            fns[me] = jax.jit(tg.value_and_grad(f, policy=pol))
        times = interleaved({k: (lambda g=g: g(*args)) for k, g in fns.items()}, args_.rounds, 3)
        base = statistics.median(times["save"])
        for me, pol in plans.items():
            t = statistics.median(times[me])
            print(
                f"  {me:8} {pol.last['mechanisms']}  predicted +{pol.last['time_s'] * 1e3:.2f} ms;"
                f" measured {t * 1e3:.2f} ms = {t / base:.2f}x save() ({base * 1e3:.2f} ms)"
            )


if __name__ == "__main__":
    main()
