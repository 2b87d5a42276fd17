"""Recompute vs save on a 32-layer MLP and a 6-block transformer, in one run.

    python bench/checkpoint_bench.py [--quick]

For each policy: peak live activation-residual bytes (tg.memory_report: residuals
that are not the inputs themselves, including recomputed values while backward
holds them) as a ratio of save()'s, recompute flops the plan adds, and jit step
time relative to save() (calls interleaved with save()'s, fastest of each); then,
per model, whether every planner point is on or below the Pareto front of the
hand-written policies (a point is dominated if a hand-written policy has no more
bytes and fewer flops). An infeasible budget prints the smallest peak found.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
from _models import mlp_params, split_static, transformer_block, transformer_params
from _timing import interleaved

import tapegrad as tg
from tapegrad.planner import estimate

P = tg.CheckpointPolicy


def paired(fn, base, reps: int) -> float:
    """``fn``'s step time over ``base``'s: calls interleaved, fastest of ``reps`` each
    (after 2 warm-up calls), so load on a shared machine hits both alike."""
    t = interleaved({"fn": fn, "base": base}, reps, warmup=2)
    return min(t["fn"]) / min(t["base"])


def mlp_layer(h, w):
    return jnp.tanh(h @ w)


def mlp(params, x, wrap=lambda f: f):
    h = x
    for w in params:
        h = wrap(mlp_layer)(h, w)
    return jnp.mean(h**2)


def mlp_seq(params, x):
    fs = [lambda h, w=w: mlp_layer(h, w) for w in params]
    return jnp.mean(tg.checkpoint_sequential(fs, "sqrt", x) ** 2)


def make_transformer(blocks, heads):
    def block(p, x):
        return transformer_block({**p, "heads": heads}, x)

    def model(ps, x, wrap=lambda f: f):
        for p in ps:
            x = wrap(block)(p, x)
        return jnp.mean(x**2)

    def model_seq(ps, x):
        fs = [lambda h, p=p: block(p, h) for p in ps]
        return jnp.mean(tg.checkpoint_sequential(fs, "sqrt", x) ** 2)

    return model, model_seq


def rows(name, f, f_seq, params, x, reps):
    """Print one model's table; return True when every planner point is on or below
    the Pareto front of the hand-written policies."""
    dots = jax.checkpoint_policies.dots_saveable
    sac_dots = tg.selective(lambda r: P.ALWAYS if r.primitive == "dot_general" else P.NEVER)
    base_rep = tg.memory_report(f)(params, x)
    base = base_rep.peak_bytes - base_rep.input_bytes
    hand = [
        ("save()", f, None),
        ("full recompute", f, tg.selective(lambda r: P.NEVER)),
        ("checkpoint_sequential sqrt", f_seq, None),
        (
            "jax.checkpoint(dots_saveable)/layer",
            lambda p, x: f(p, x, lambda g: jax.checkpoint(g, policy=dots)),
            None,
        ),
        ("tg.checkpoint/layer", lambda p, x: f(p, x, tg.checkpoint), None),
        ("tg.selective(dots ALWAYS)", f, sac_dots),
    ]
    planner = [
        (f"planner {int(frac * 100)}% of save", f, tg.policies.budget(int(base * frac)))
        for frac in (0.75, 0.5, 0.25)
    ]
    j_base = jax.jit(tg.grad(f))
    print(f"\n{name}: save() peak {base:,} B (activation residuals)")
    print(
        f"{'policy':<38} {'peak B':>11} {'vs save':>8} {'recompute MFLOP':>16} "
        f"{'jit step':>9}  plan"
    )
    points = {}
    for label, fn, pol in hand + planner:
        t0 = time.perf_counter()
        try:
            rep = tg.memory_report(fn, policy=pol)(params, x)
        except tg.policies.BudgetError as e:
            print(f"{label:<38} infeasible: {str(e)[:80]}...")
            continue
        plan_s = time.perf_counter() - t0
        peak = rep.peak_bytes - rep.input_bytes
        _, flops = estimate(rep.tape)  # the planned tape the report ran
        jf = jax.jit(tg.grad(fn, policy=pol))
        ratio = paired(lambda: jf(params, x), lambda: j_base(params, x), reps)
        how = (
            f"{pol.last['plan']} ({plan_s:.1f}s to trace+plan)"
            if label.startswith("planner")
            else ""
        )
        print(
            f"{label:<38} {peak:>11,} {peak / base:>7.2f}x {flops / 1e6:>16.2f} "
            f"{ratio:>8.2f}x  {how}"
        )
        points[label] = (peak, flops)
    ok = True
    for label, _, _ in planner:
        if label not in points:
            continue
        pb, pf = points[label]
        dominated = [
            h[0] for h in hand if h[0] in points and points[h[0]][0] <= pb and points[h[0]][1] < pf
        ]
        if dominated:
            ok = False
            print(f"  {label} is dominated by {', '.join(dominated)}")
    model = name.split(" ")[0].rstrip(",")
    print(
        f"{model}: every planner point on/below the hand-written Pareto front: "
        f"{'YES' if ok else 'NO'}"
    )
    return ok


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    reps = 5 if ap.parse_args().quick else 30
    k = jax.random.split(jax.random.key(0), 4)
    rows(
        "mlp32 (64 wide, batch 64)",
        mlp,
        mlp_seq,
        mlp_params(k[0], 32, 64),
        jax.random.normal(k[1], (64, 64)),
        reps,
    )
    ps, heads = zip(
        *[
            split_static(transformer_params(kk, d=64, heads=4, ff=256))
            for kk in jax.random.split(k[2], 6)
        ]
    )
    model, model_seq = make_transformer(6, heads[0])
    rows(
        "transformer, 6 blocks (d=64, 4 heads, seq 32, batch 4)",
        model,
        model_seq,
        list(ps),
        jax.random.normal(k[3], (4, 32, 64)),
        reps,
    )


if __name__ == "__main__":
    main()
