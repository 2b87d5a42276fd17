"""Eager tg.grad of functions with Python control flow on values, against jax.grad eager.

    python bench/control_flow_bench.py [--rounds N]

Such a function cannot be traced abstractly, so tapegrad records its tape from a run
(`tapegrad/engine/concrete_trace.py`) and then runs forward and backward on it; jax.grad
runs its JVP and partial evaluation eagerly. Times are medians of interleaved calls; the
ratio is the median of per-round ratios (tapegrad / jax).
"""

from __future__ import annotations

import argparse
import platform
import statistics

import _results
import jax
import jax.numpy as jnp
from _timing import interleaved

import tapegrad as tg


def newton_sqrt(a):
    y = a
    for _ in range(50):
        y = y - (y * y - a) / (2 * y)
        if jnp.abs(y * y - a) < 1e-6:
            break
    return y


def mlp_with_branches(x):
    for _ in range(8):
        x = jnp.tanh(x * 1.1 + 0.1)
        if x.sum() > 100:
            x = x * 0.5
    return jnp.sum(x**2)


def halving(x):
    while jnp.sum(x * x) > 1.0:
        x = x * 0.5
    return jnp.sum(jnp.tanh(x))


CASES = {
    "newton sqrt (value-dependent steps)": (newton_sqrt, (jnp.float32(2.0),)),
    "8-layer tanh, an if per layer (16x64)": (mlp_with_branches, (jnp.ones((16, 64)),)),
    "while loop halving (64)": (halving, (jnp.full((64,), 3.0),)),
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=50)
    _results.add_arguments(ap)
    args = ap.parse_args()
    _results.start(args)
    print(f"jax {jax.__version__} on {jax.devices()[0].platform}, {platform.processor() or '?'}")
    print(f"{'function':42s} {'tg.grad ms':>10s} {'jax.grad ms':>11s} {'ratio':>6s}")
    for name, (f, a) in CASES.items():
        t = interleaved(
            {"tg": lambda: tg.grad(f)(*a), "jax": lambda: jax.grad(f)(*a)}, args.rounds, 3
        )
        ratio = statistics.median(x / y for x, y in zip(t["tg"], t["jax"]))
        tg_ms, jax_ms = statistics.median(t["tg"]) * 1e3, statistics.median(t["jax"]) * 1e3
        print(f"{name:42s} {tg_ms:10.2f} {jax_ms:11.2f} {ratio:5.2f}x")
    _results.finish(args, "control_flow_bench")


if __name__ == "__main__":
    main()
