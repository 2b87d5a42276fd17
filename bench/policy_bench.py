"""Residual policies on the 8-layer MLP and the transformer block, in one run.

    python bench/policy_bench.py [--quick]

For each built-in policy: device residual bytes vs save(), bytes held beyond the function's
inputs vs save()'s (what backward adds to the caller's memory), step time vs save()
(eager and jit), relative gradient error vs float64 jax.grad, and (MLP) the
training loss after 200 Adam steps vs save().
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from _models import mlp_loss, mlp_params, split_static, transformer_loss, transformer_params

import tapegrad as tg
from tapegrad import policies as P

POLICIES = {
    "save": P.save(),
    "offload": P.offload(),
    "bf16": P.compress(jnp.bfloat16),
    "f16": P.compress(jnp.float16),
    "f8e4m3": P.compress(jnp.float8_e4m3fn),
    "int8": P.compress("int8"),
    "int8/ch": P.compress("int8", axis=-1),
    "hooks(id)": P.hooks(lambda a: a, lambda a: a),
}


def timeit(fn, reps: int) -> float:
    """Median wall time in ms over ``reps`` calls (after 3 warm-up calls)."""
    for _ in range(3):
        jax.block_until_ready(fn())
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def paired_ratio(fn, base, rounds: int, reps: int) -> float:
    """Median over rounds of time(fn) / time(base), the two timed back to back."""
    return statistics.median(timeit(fn, reps) / timeit(base, reps) for _ in range(rounds))


def rel_err(g, ref) -> float:
    num = sum(
        float(np.sum((np.asarray(a, np.float64) - b) ** 2))
        for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(ref))
    )
    den = sum(float(np.sum(b**2)) for b in jax.tree.leaves(ref))
    return (num / den) ** 0.5


def adam_final_loss(loss, params, x, y, policy, steps=200, lr=1e-3):
    @jax.jit
    def step(p, m, v, t, x, y):
        val, g = tg.value_and_grad(loss, policy=policy)(p, x, y)
        m = jax.tree.map(lambda m, g: 0.9 * m + 0.1 * g, m, g)
        v = jax.tree.map(lambda v, g: 0.999 * v + 0.001 * g * g, v, g)
        mh = jax.tree.map(lambda m: m / (1 - 0.9**t), m)
        vh = jax.tree.map(lambda v: v / (1 - 0.999**t), v)
        p = jax.tree.map(lambda p, m, v: p - lr * m / (jnp.sqrt(v) + 1e-8), p, mh, vh)
        return p, m, v, val

    m = jax.tree.map(jnp.zeros_like, params)
    v = jax.tree.map(jnp.zeros_like, params)
    p = params
    for t in range(1, steps + 1):
        p, m, v, val = step(p, m, v, t, x, y)
    return float(loss(p, x, y))


def regression_loss(params, x, y):
    h = x
    for w in params[:-1]:
        h = jnp.tanh(h @ w)
    return jnp.mean((h @ params[-1] - y) ** 2)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args()
    reps_e, reps_j = (3, 10) if a.quick else (5, 30)
    rounds = 3 if a.quick else 5
    k = jax.random.split(jax.random.key(0), 4)
    arrays, heads = split_static(transformer_params(k[0]))
    tloss = lambda p, x: transformer_loss({**p, "heads": heads}, x)  # noqa: E731
    cases = [
        ("mlp8", mlp_loss, mlp_params(k[1], 8, 256), jax.random.normal(k[2], (64, 256))),
        ("transformer", tloss, arrays, jax.random.normal(k[3], (8, 64, 128))),
    ]
    print(f"jax {jax.__version__} on {jax.devices()[0].platform}")
    for name, f, params, x in cases:
        with jax.enable_x64(True):
            p64 = jax.tree.map(lambda a: a.astype(jnp.float64), params)
            ref = jax.grad(f)(p64, x.astype(jnp.float64))
            ref = jax.tree.map(np.asarray, ref)
        base = tg.memory_report(f, policy=P.save())(params, x)
        e_base = timeit(lambda: tg.grad(f)(params, x), reps_e)
        j_base_f = jax.jit(tg.grad(f))
        j_base = timeit(lambda: j_base_f(params, x), reps_j)
        print(
            f"\n{name}: save() keeps {base.device_bytes:,} B on device "
            f"(eager step {e_base:.2f} ms, jit step {j_base:.3f} ms)"
        )
        print(
            f"{'policy':<10} {'device B':>12} {'vs save':>8} {'host B':>12} {'beyond in':>9} "
            f"{'eager':>7} {'jit':>7} {'grad rel err':>13}"
        )
        for pname, pol in POLICIES.items():
            rep = tg.memory_report(f, policy=pol)(params, x)
            jf = jax.jit(tg.grad(f, policy=pol))
            # Interleave with save() and take the median of per-round ratios: a shared
            # machine drifts, and back-to-back medians of separate runs do not cancel it.
            e = paired_ratio(
                lambda: tg.grad(f, policy=pol)(params, x),
                lambda: tg.grad(f)(params, x),
                rounds,
                reps_e,
            )
            j = paired_ratio(lambda: jf(params, x), lambda: j_base_f(params, x), rounds, reps_j)
            err = rel_err(jf(params, x), ref)
            beyond = rep.beyond_inputs_bytes / base.beyond_inputs_bytes
            print(
                f"{pname:<10} {rep.device_bytes:>12,} "
                f"{rep.device_bytes / base.device_bytes:>7.2f}x "
                f"{rep.host_bytes:>12,} {beyond:>8.2f}x {e:>6.2f}x {j:>6.2f}x {err:>13.2e}"
            )

    print(
        "\nTraining: 200 Adam steps (lr 1e-3) on an 8-layer tanh regression MLP "
        "(256 wide, 1024 examples, target sin(x @ R)), jit"
    )
    kp, kx, kr = jax.random.split(jax.random.key(1), 3)
    params = mlp_params(kp, 8, 256)
    x = jax.random.normal(kx, (1024, 256))
    y = jnp.sin(x @ jax.random.normal(kr, (256, 256)) / 4)
    base = adam_final_loss(regression_loss, params, x, y, P.save())
    print(f"initial loss {float(regression_loss(params, x, y)):.5f}")
    print(f"{'policy':<10} {'final loss':>11} {'vs save':>8}")
    for pname in ["save", "offload", "bf16", "int8", "int8/ch", "f8e4m3"]:
        final = adam_final_loss(regression_loss, params, x, y, POLICIES[pname])
        print(f"{pname:<10} {final:>11.5f} {final / base:>7.3f}x")


if __name__ == "__main__":
    main()
