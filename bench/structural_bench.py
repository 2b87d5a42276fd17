"""Lossless structural residuals (issue 16, item 1): bytes kept and jit step time.

    python bench/structural_bench.py [--quick] [--part {masks,memory,all}] [--op-by-op]

Three models: an 8-layer ReLU MLP (batch 256, width 128: 256x128 activations), a small
CNN (conv-relu-maxpool x2, dense; batch 32, 28x28x1) and the same MLP with dropout
(``jax.random.bernoulli`` + ``jnp.where`` after each relu). Per model:

* bytes alive after forward beyond the inputs and the output (``jax.live_arrays``), for
  ``tg.vjp`` (packed masks, the default), ``tg.vjp`` with packing off, and ``jax.vjp``;
* the mask residuals alone: what tapegrad's mask-keeping records (relu, where, max,
  reduce_max, max-pool) keep, against the float32 bytes of the activations they stand for;
* jitted ``tg.grad`` step time vs ``jax.grad``'s, packing on and off (interleaved rounds);
* the largest |tg.grad - jax.grad| (exact: masks are lossless).

The dropout masks are not kept: each is rebuilt in backward from its key (a few bytes),
so the dropout rows' mask columns read 0 and ``tg.vjp``'s bytes are the MLP's.

``--part memory`` prints, per model, what an eager training step holds and costs: the
bytes held between ``tg.vjp``'s forward and backward (``jax.live_arrays``), the backward
peak beyond the inputs (``tg.memory_report``'s ``peak_beyond_inputs_bytes``, and the
same peak measured from live arrays over an eager forward and backward), and the step
time of ``tg.grad`` against ``jax.grad``, eager and jitted. Run it with ``PYTHONPATH``
on two checkouts to compare them; ``--op-by-op`` runs rebuilt draws record by record
instead of as one compiled call (`Segment.compiled`), to show the transient that call
removes.

Two variants of the MLP and dropout MLP: weights differentiated (the usual training step;
relu reads its mask off its output, which the next matmul keeps anyway) and weights
constant (input gradient only: nothing else keeps relu's output, the mask is its residual).
"""

from __future__ import annotations

import argparse
import functools
import gc
import statistics

import jax
import jax.numpy as jnp
import numpy as np
from _timing import interleaved
from jax import lax

import tapegrad as tg
from tapegrad.rules import _bits

MASK_RECORDS = ("custom_jvp_rule", "select_n", "max", "min", "reduce_max", "clamp")


def mlp_params(key, depth=8, width=128):
    ks = jax.random.split(key, depth)
    return [jax.random.normal(k, (width, width)) / jnp.sqrt(width) for k in ks]


def relu_mlp(ws, x):
    h = x
    for w in ws:
        h = jax.nn.relu(h @ w)
    return jnp.mean(h**2)


def dropout_mlp(ws, x, rate=0.1):
    key = jax.random.PRNGKey(42)
    h = x
    for i, w in enumerate(ws):
        h = jax.nn.relu(h @ w)
        keep = jax.random.bernoulli(jax.random.fold_in(key, i), 1 - rate, h.shape)
        h = jnp.where(keep, h / (1 - rate), 0.0)
    return jnp.mean(h**2)


def cnn_params(key):
    k1, k2, k3 = jax.random.split(key, 3)
    return {
        "c1": jax.random.normal(k1, (3, 3, 1, 16)) / 3,
        "c2": jax.random.normal(k2, (3, 3, 16, 32)) / 12,
        "d": jax.random.normal(k3, (7 * 7 * 32, 10)) / 40,
    }


def _conv(x, w):
    dn = ("NHWC", "HWIO", "NHWC")
    return lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=dn)


def _pool(x):
    return lax.reduce_window(x, -jnp.inf, lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID")


def cnn(p, x):
    h = _pool(jax.nn.relu(_conv(x, p["c1"])))
    h = _pool(jax.nn.relu(_conv(h, p["c2"])))
    logits = h.reshape(h.shape[0], -1) @ p["d"]
    return jnp.mean(jax.nn.logsumexp(logits, axis=-1) - logits[:, 0])


def live_bytes() -> int:
    gc.collect()
    return sum(a.nbytes for a in jax.live_arrays())


def held(vjp, f, args) -> int:
    """Bytes a vjp's forward leaves alive beyond the arguments and the output."""
    before = live_bytes()
    out, fn = vjp(f, *args)
    jax.block_until_ready(out)
    n = live_bytes() - before - out.nbytes
    del out, fn
    return n


def mask_bytes(f, args, argnums) -> tuple[int, int]:
    """(bytes the mask-keeping records keep of their own, float32 bytes of the values
    those masks stand for)."""
    tape = tg.trace(f, argnums=argnums)(*args)
    kept = stands = 0
    for rec in tape.records:
        if rec.primitive == "reduce_window_max":
            for s in rec.saves:
                kept += s.nbytes
                stands += int(np.prod(rec.inputs[0].shape)) * 4  # jax keeps the input
        if rec.primitive not in MASK_RECORDS:
            continue
        for s in rec.saves:
            if s.kind == "aux":
                kept += s.nbytes
                stands += int(np.prod(rec.outputs[0].shape)) * 4
    return kept, stands


def packing(on: bool) -> None:
    _bits.MIN_ELEMENTS = 256 if on else 1 << 62
    tg.clear_caches()


def run(name, f, args, argnums, rounds, out):
    tg_grad = jax.jit(tg.grad(f, argnums=argnums))
    jax_grad = jax.jit(jax.grad(f, argnums=argnums))
    packing(True)
    g_tg, g_jax = tg_grad(*args), jax_grad(*args)
    err = max(
        float(jnp.max(jnp.abs(a - b)))
        for a, b in zip(jax.tree.leaves(g_tg), jax.tree.leaves(g_jax))
    )
    tg_on = held(tg.vjp, f, args)
    kept, stands = mask_bytes(f, args, argnums)
    jx = held(jax.vjp, f, args)
    packing(False)
    tg_off = held(tg.vjp, f, args)
    kept_off, _ = mask_bytes(f, args, argnums)
    tg_grad_off = jax.jit(tg.grad(f, argnums=argnums))
    jax.block_until_ready(tg_grad_off(*args))
    packing(True)
    tg_grad_on = jax.jit(tg.grad(f, argnums=argnums))
    jax.block_until_ready(tg_grad_on(*args))
    times = interleaved(
        {
            "on": lambda: tg_grad_on(*args),
            "off": lambda: tg_grad_off(*args),
            "jax": lambda: jax_grad(*args),
        },
        rounds=rounds,
        warmup=3,
    )
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    out.append((name, tg_on, tg_off, jx, kept, kept_off, stands, med, err))


def memory_row(name, f, args, argnums, rounds) -> str:
    from tapegrad.planner.measure import measured_peak

    held_b = held(tg.vjp, f, args)
    rep = tg.memory_report(f, argnums=argnums)(*args)
    peak = measured_peak(f, args, None, argnums=argnums)
    fns = {
        "tg": lambda: tg.grad(f, argnums=argnums)(*args),
        "jax": lambda: jax.grad(f, argnums=argnums)(*args),
        "tg jit": jax.jit(tg.grad(f, argnums=argnums)),
        "jax jit": jax.jit(jax.grad(f, argnums=argnums)),
    }
    for k in ("tg jit", "jax jit"):
        fns[k] = functools.partial(fns[k], *args)
    med = {
        k: statistics.median(v) * 1e3 for k, v in interleaved(fns, rounds=rounds, warmup=3).items()
    }
    eager, jit = med["tg"] / med["jax"], med["tg jit"] / med["jax jit"]
    return (
        f"| {name} | {held_b:,} | {rep.peak_beyond_inputs_bytes:,} | {peak:,} |"
        f" {med['tg']:.2f} / {med['jax']:.2f} ms **{eager:.2f}x** |"
        f" {med['tg jit']:.2f} / {med['jax jit']:.2f} ms **{jit:.2f}x** |"
    )


def memory_table(models, rounds: int) -> None:
    print(
        "| model | held after forward (B) | memory_report backward peak (B) |"
        " measured backward peak (B) | eager tg.grad / jax.grad | jit tg.grad / jax.grad |"
    )
    print("|---|---|---|---|---|---|")
    for name, f, args, argnums in models:
        print(memory_row(name, f, args, argnums, rounds), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--part", choices=("masks", "memory", "all"), default="all")
    ap.add_argument("--op-by-op", action="store_true")
    a = ap.parse_args()
    rounds = 10 if a.quick else 40
    key = jax.random.PRNGKey(0)
    ws = mlp_params(key)
    x = jax.random.normal(jax.random.PRNGKey(1), (256, 128))
    p = cnn_params(key)
    img = jax.random.normal(jax.random.PRNGKey(2), (32, 28, 28, 1))
    if a.op_by_op:
        from tapegrad.engine import interpret as _interpret

        _interpret.run_compiled_segment = lambda *_: None  # the per-record path instead
    print(f"tapegrad from {tg.__file__}" + (" (rebuilt draws op by op)" if a.op_by_op else ""))
    if a.part in ("memory", "all"):
        memory_table(
            [
                ("relu MLP 8x128, batch 256 (w, x)", relu_mlp, (ws, x), (0, 1)),
                ("CNN conv-relu-pool x2, dense (p, x)", cnn, (p, img), (0, 1)),
                ("dropout MLP 8x128 (w, x)", dropout_mlp, (ws, x), (0, 1)),
                ("dropout MLP, weights constant (x)", lambda x: dropout_mlp(ws, x), (x,), 0),
            ],
            rounds,
        )
    if a.part == "memory":
        return
    rows: list = []
    run("relu MLP 8x128, batch 256 (w, x)", relu_mlp, (ws, x), (0, 1), rounds, rows)
    run("relu MLP, weights constant (x)", lambda x: relu_mlp(ws, x), (x,), 0, rounds, rows)
    run("CNN conv-relu-pool x2, dense (p, x)", cnn, (p, img), (0, 1), rounds, rows)
    run("dropout MLP 8x128 (w, x)", dropout_mlp, (ws, x), (0, 1), rounds, rows)
    run("dropout MLP, weights constant (x)", lambda x: dropout_mlp(ws, x), (x,), 0, rounds, rows)
    print(
        "| model | tg bytes (packed) | tg, packing off | jax.vjp | tg / jax | mask residuals:"
        " packed / bool / float32 | jit tg / jax.grad (packed) | (packing off) | max |dg| |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for name, on, off, jx, kept, kept_off, stands, med, err in rows:
        ratio = f"{stands / kept:.0f}x fewer" if kept else "-"
        print(
            f"| {name} | {on:,} | {off:,} | {jx:,} | {on / jx:.2f}x | {kept:,} / {kept_off:,} /"
            f" {stands:,} ({ratio}) | {med['on']:.2f} / {med['jax']:.2f} ms"
            f" **{med['on'] / med['jax']:.2f}x** | {med['off'] / med['jax']:.2f}x | {err:.1e} |"
        )


if __name__ == "__main__":
    main()
