"""Planning time of `tg.policies.budget` with every mechanism allowed, on MLP chains.

    python bench/chain_plan_time.py [--layers 32 60 330 500]

Chains are where the exact programs run (`planner.chain` for save/recompute up to
`planner.candidates.CHAIN_DP_RECORDS` records, `planner.chain_joint` for the joint plan up to its
`MAX_RECORDS`); longer chains get the bounded searches. Prints, per chain and budget (90%
and 40% of save()'s peak), the wall time of one plan, the plan family and its predicted
step time (fixed cost figures: 5e10 flop/s, 5e9 B/s each way, compress 2e9 B/s).
"""

from __future__ import annotations

import argparse
import time

import _results
import jax.numpy as jnp

import tapegrad as tg
from tapegrad.planner import estimate
from tapegrad.planner.cost import CostModel

COSTS = CostModel(5e10, 5e9, 5e9, 2e9)
ALL = ("save", "recompute", "offload", "compress")


def mlp(ws, x):
    h = x
    for w in ws:
        h = jnp.tanh(h @ w)
    return jnp.sum(h**2)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, nargs="+", default=[32, 60, 330, 500])
    _results.add_arguments(ap)
    a = ap.parse_args()
    _results.start(a)
    print(f"{'layers':>6} {'records':>7} {'budget':>6} {'plan s':>7}  plan (predicted step)")
    for n in a.layers:
        ws, x = [jnp.ones((64, 64)) / 64 for _ in range(n)], jnp.ones((32, 64))
        tape = tg.trace(mlp, argnums=0)(ws, x)
        full = estimate(tape)[0]
        for frac in (0.9, 0.4):
            pol = tg.policies.budget(int(full * frac), allow=ALL, costs=COSTS)
            t = time.perf_counter()
            pol.plan(tape, [None] * len(tape.records))
            dt = time.perf_counter() - t
            print(
                f"{n:>6} {len(tape.records):>7} {frac:>6.0%} {dt:>7.2f}  "
                f"{pol.last['plan']} ({pol.last['time_s'] * 1e6:.1f} µs)"
            )
    _results.finish(a, "chain_plan_time")


if __name__ == "__main__":
    main()
