"""Low-bit residual compression vs save(): activation bytes held and jitted step time.

    python bench/lowbit_bench.py [--quick] [--only relu CNN ...]

Models: an 8-layer MLP (256 wide, batch 256) with tanh, the same with ReLU written as
``jnp.where(z > 0, z, 0)`` (backward keeps a boolean mask and the dot inputs, so every
float residual is used linearly), the same with ``jax.nn.relu`` (its mask read off its
output: under ``bits=`` off the output's zero-exact codes), and a small NHWC CNN
(conv-ReLU x2, 32x32x3 images, batch 64, 16 and 32 channels, dense head). Policies:
save(), bf16, int8, bits=8/4/2, and ``bits="auto"`` at 3 and 4 bits a value (``auto=3``,
``auto=4``: fitted on the model's own loss and arguments first, `Compress.fit`, 4
samples; its time is printed apart).

* held: bytes that `tg.vjp`'s forward leaves alive beyond the inputs and the output,
  from `jax.live_arrays()` (what backward adds to the caller's memory); ratio = save's / it.
* step: median wall time of `jax.jit(tg.grad(loss, policy=...))`; ratio = it / save's.
* err: relative gradient error vs `jax.grad` (one key).
"""

from __future__ import annotations

import argparse
import functools
import gc
import statistics
import time

import jax
import jax.numpy as jnp

import tapegrad as tg
from tapegrad import policies as P

POLICIES = {
    "save": P.save(),
    "bf16": P.compress(jnp.bfloat16),
    "int8": P.compress("int8"),
    "bits=8": P.compress(bits=8),
    "bits=4": P.compress(bits=4),
    "bits=2": P.compress(bits=2),
    "auto=4": P.compress(bits="auto", budget_bits=4),
    "auto=3": P.compress(bits="auto", budget_bits=3),
}


def mlp(act):
    def loss(ws, x):
        for w in ws[:-1]:
            x = act(x @ w)
        return jnp.mean((x @ ws[-1]) ** 2)

    return loss


def mlp_args(width=256, layers=8, batch=256):
    ks = jax.random.split(jax.random.key(0), layers + 1)
    ws = [jax.random.normal(k, (width, width)) / jnp.sqrt(width) for k in ks[:-1]]
    return ws, jax.random.normal(ks[-1], (batch, width))


def relu_where(z):
    return jnp.where(z > 0, z, 0.0)


def cnn_loss(p, x):
    dn = ("NHWC", "HWIO", "NHWC")
    h = jax.lax.conv_general_dilated(x, p["c1"], (1, 1), "SAME", dimension_numbers=dn)
    h = relu_where(h)
    h = jax.lax.conv_general_dilated(h, p["c2"], (2, 2), "SAME", dimension_numbers=dn)
    h = relu_where(h)
    return jnp.mean((h.reshape(h.shape[0], -1) @ p["w"]) ** 2)


def cnn_args(batch=64):
    ks = jax.random.split(jax.random.key(1), 4)
    p = {
        "c1": jax.random.normal(ks[0], (3, 3, 3, 16)) / 5,
        "c2": jax.random.normal(ks[1], (3, 3, 16, 32)) / 12,
        "w": jax.random.normal(ks[2], (16 * 16 * 32, 10)) / 90,
    }
    return p, jax.random.normal(ks[3], (batch, 32, 32, 3))


def live_bytes() -> int:
    gc.collect()
    return sum(a.nbytes for a in jax.live_arrays())


def held(loss, args, policy) -> int:
    before = live_bytes()
    out, vjp_fn = tg.vjp(loss, *args, policy=policy)
    jax.block_until_ready(out)
    n = live_bytes() - before - out.nbytes
    del vjp_fn, out
    return n


def step_ms(fn, args, reps) -> float:
    for _ in range(3):
        jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t)
    return 1e3 * statistics.median(ts)


def rel_err(g, ref) -> float:
    gl, rl = jax.tree.leaves(g), jax.tree.leaves(ref)
    num = sum(float(jnp.sum((a - b) ** 2)) for a, b in zip(gl, rl))
    return (num / sum(float(jnp.sum(b**2)) for b in rl)) ** 0.5


def _run(name, loss, args, reps, only=None):
    if only and not any(o in name for o in only):
        return
    print(f"\n{name}")
    print(f"  {'policy':8} {'held B':>10} {'save/held':>9} {'step ms':>8} {'x save':>7} {'err':>8}")
    ref = jax.jit(jax.grad(loss, argnums=(0, 1)))(*args)
    base_b = base_t = None
    for pname, policy in POLICIES.items():
        if getattr(policy, "bits", None) == "auto":
            t0 = time.perf_counter()
            policy = policy.fit(loss, *args, argnums=(0, 1))
            fit_s = time.perf_counter() - t0
            a = policy.allocation
            widths = " ".join(str(r.bits) for r in a.rows)
            print(f"  ({pname}: fit {fit_s:.1f} s, {a.average_bits:.2f} bits a value: {widths})")
        b = held(loss, args, policy)
        f = jax.jit(tg.grad(loss, argnums=(0, 1), policy=policy))
        t = step_ms(f, args, reps)
        if base_b is None:
            base_b, base_t = b, t
        err = rel_err(f(*args), ref)
        print(f"  {pname:8} {b:>10,} {base_b / b:>8.1f}x {t:>8.2f} {t / base_t:>6.2f}x {err:>8.1e}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--only", nargs="*", help="models whose name contains one of these")
    a = ap.parse_args()
    reps = 5 if a.quick else 30
    run = functools.partial(_run, only=a.only)
    run("MLP 8x256, batch 256, tanh", mlp(jnp.tanh), mlp_args(), reps)
    run("MLP 8x256, batch 256, ReLU (where)", mlp(relu_where), mlp_args(), reps)
    run("MLP 8x256, batch 256, jax.nn.relu", mlp(jax.nn.relu), mlp_args(), reps)
    run("CNN conv16-relu-conv32/2-relu-dense, 64x32x32x3", cnn_loss, cnn_args(), reps)


if __name__ == "__main__":
    main()
