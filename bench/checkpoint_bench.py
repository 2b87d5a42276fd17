"""Recompute vs save on a 32-layer MLP and a 6-block transformer, in one run.

    python bench/checkpoint_bench.py [--quick]

For each policy: peak live activation-residual bytes (tg.memory_report: residuals
that are not the inputs themselves, including recomputed values while backward
holds them), recompute flops the plan adds, and jit step time relative to save().
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

import tapegrad as tg
from tapegrad.policies.budget import estimate

from _models import mlp_params, split_static, transformer_block, transformer_params
from grad_bench import timeit

P = tg.CheckpointPolicy


def mlp_layer(h, w):
    return jnp.tanh(h @ w)


def mlp(params, x, wrap=lambda f: f):
    h = x
    for w in params:
        h = wrap(mlp_layer)(h, w)
    return jnp.mean(h ** 2)


def mlp_seq(params, x):
    fs = [lambda h, w=w: mlp_layer(h, w) for w in params]
    return jnp.mean(tg.checkpoint_sequential(fs, "sqrt", x) ** 2)


def make_transformer(blocks, heads):
    def block(p, x):
        return transformer_block({**p, "heads": heads}, x)

    def model(ps, x, wrap=lambda f: f):
        for p in ps:
            x = wrap(block)(p, x)
        return jnp.mean(x ** 2)

    def model_seq(ps, x):
        fs = [lambda h, p=p: block(p, h) for p in ps]
        return jnp.mean(tg.checkpoint_sequential(fs, "sqrt", x) ** 2)

    return model, model_seq


def rows(name, f, f_seq, params, x, reps):
    dots = jax.checkpoint_policies.dots_saveable
    sac_dots = tg.selective(lambda r: P.ALWAYS if r.primitive == "dot_general" else P.NEVER)
    base_rep = tg.memory_report(f)(params, x)
    base = base_rep.peak_bytes - base_rep.input_bytes
    cases = [
        ("save()", f, None),
        ("recompute all", f, tg.selective(lambda r: P.NEVER)),
        ("checkpoint_sequential sqrt", f_seq, None),
        ("jax.checkpoint(dots_saveable)/layer", lambda p, x: f(p, x, lambda g: jax.checkpoint(g, policy=dots)), None),
        ("tg.checkpoint/layer", lambda p, x: f(p, x, tg.checkpoint), None),
        ("selective(dots ALWAYS)", f, sac_dots),
    ] + [(f"budget {int(frac * 100)}% of save", f, tg.policies.budget(int(base * frac)))
         for frac in (0.75, 0.5, 0.25)]
    t_base = None
    print(f"\n{name}: save() peak {base:,} B")
    print(f"{'policy':<38} {'peak B':>12} {'vs save':>8} {'recompute MFLOP':>16} {'jit step':>9}")
    for label, fn, pol in cases:
        try:
            tape = tg.trace(fn, argnums=0, policy=pol)(params, x)
            rep = tg.memory_report(fn, policy=pol)(params, x)
        except tg.policies.BudgetError as e:
            print(f"{label:<38} infeasible: {str(e)[:60]}...")
            continue
        peak = rep.peak_bytes - rep.input_bytes
        _, flops = estimate(tape)
        jf = jax.jit(tg.grad(fn, policy=pol))
        t = timeit(lambda: jf(params, x), reps)
        t_base = t_base or t
        print(f"{label:<38} {peak:>12,} {peak / base:>7.2f}x {flops / 1e6:>16.1f} {t / t_base:>8.2f}x")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    reps = 10 if ap.parse_args().quick else 50
    k = jax.random.split(jax.random.key(0), 4)
    rows("mlp32 (64 wide, batch 64)", mlp, mlp_seq, mlp_params(k[0], 32, 64),
         jax.random.normal(k[1], (64, 64)), reps)
    ps, heads = zip(*[split_static(transformer_params(kk, d=64, heads=4, ff=256))
                      for kk in jax.random.split(k[2], 6)])
    model, model_seq = make_transformer(6, heads[0])
    rows("transformer, 6 blocks (d=64, 4 heads, seq 32, batch 4)", model, model_seq, list(ps),
         jax.random.normal(k[3], (4, 32, 64)), reps)


if __name__ == "__main__":
    main()
