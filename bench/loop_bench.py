"""Loops (``lax.scan``) vs jax: jit time, eager time, residual bytes — in one run.

    python bench/loop_bench.py             # full sizes (RNN T=1000, 24-layer stacks)
    python bench/loop_bench.py --quick     # RNN T=200, 8-layer stacks, fewer repetitions
    python bench/loop_bench.py --profile rnn   # cProfile one warm eager call of each library

Models: an RNN (``h = tanh(h @ w + x @ u)`` as a ``lax.scan``), a stack of residual
blocks scanned over stacked weights (tanh and ``jax.nn.relu``), and, straight-line, an
8-layer ReLU MLP and a pre-LN transformer block with a ReLU MLP.

Times are medians; each ratio is the median of per-round ratios, tapegrad and jax timed
alternately (`_timing.interleaved`). Eager calls are warm: every function is called a few
times first (tapegrad compiles a repeated eager structure at its third sighting).

Residual bytes are measured from live arrays (``jax.live_arrays()``, after
``gc.collect()``): the bytes that appear when ``vjp`` returns and stay alive while
``vjp_fn`` is held, minus the output, split by ``sharding.memory_kind``. Inputs that were
alive before the call are not counted, for either library. ``tape`` is
``tg.trace(f)(...).saved_bytes``, printed next to the bench's own count (outer records'
residuals plus each scan body's per-step residuals times its trip count), since what
``saved_bytes`` covers for loops was changing when this was written. Both include the
function's inputs that records keep, which the live-array figures do not.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import os
import platform
import pstats
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import _results
import jax
import jax.numpy as jnp
from _models import (
    mlp_params,
    relu_mlp_loss,
    rnn_loss,
    rnn_params,
    split_static,
    stack_params,
    stack_relu_loss,
    stack_tanh_loss,
    transformer_params,
    transformer_relu_loss,
)
from _timing import interleaved

import tapegrad as tg
from tapegrad import policies as P


@dataclass
class Model:
    key: str
    name: str
    f: Callable
    params: object
    x: object
    policies: tuple[str, ...] = ("save", "offload", "offload-in")


POLICIES = {
    "save": P.save,
    "offload": lambda: P.offload(inputs=True),  # the inputs too
    "offload-in": P.offload,  # activations only (the default)
    "bf16": lambda: P.compress(jnp.bfloat16),
}


def models(quick: bool) -> list[Model]:
    k = jax.random.split(jax.random.key(0), 8)
    steps, layers = (200, 8) if quick else (1000, 24)
    arrays, heads = split_static(transformer_params(k[6]))
    tf_loss = lambda p, x: transformer_relu_loss({**p, "heads": heads}, x)  # noqa: E731
    return [
        Model(
            "rnn",
            f"RNN scan T={steps} (batch 32, width 128)",
            rnn_loss,
            rnn_params(k[0]),
            jax.random.normal(k[1], (steps, 32, 128)),
            ("save", "offload", "offload-in", "bf16"),
        ),
        Model(
            "stack",
            f"scan over {layers} tanh blocks (256 wide, batch 64)",
            stack_tanh_loss,
            stack_params(k[2], layers, 256),
            jax.random.normal(k[3], (64, 256)),
        ),
        Model(
            "stack_relu",
            f"scan over {layers} relu blocks (256 wide, batch 64)",
            stack_relu_loss,
            stack_params(k[2], layers, 256),
            jax.random.normal(k[3], (64, 256)),
        ),
        Model(
            "mlp_relu",
            "relu MLP, 8 layers (128 wide, batch 256), no loop",
            relu_mlp_loss,
            mlp_params(k[4], 8, 128),
            jax.random.normal(k[5], (256, 128)),
        ),
        Model(
            "tf_relu",
            "pre-LN transformer block, relu MLP (d=128, seq 64, batch 8), no loop",
            tf_loss,
            arrays,
            jax.random.normal(k[7], (8, 64, 128)),
        ),
    ]


# ------------------------------------------------------------------------ timing


def paired(fa, fb, rounds: int, warmup: int) -> tuple[float, float, float]:
    """Median ms of ``fa`` and ``fb`` and the median of their per-round ratio."""
    t = interleaved({"a": fa, "b": fb}, rounds, warmup=warmup)
    ratio = statistics.median(a / b for a, b in zip(t["a"], t["b"]))
    return statistics.median(t["a"]) * 1e3, statistics.median(t["b"]) * 1e3, ratio


def max_err(ga, gb) -> float:
    return max(
        float(jnp.max(jnp.abs(u - v)) / (1e-6 + jnp.max(jnp.abs(v))))
        for u, v in zip(jax.tree.leaves(ga), jax.tree.leaves(gb))
    )


# ------------------------------------------------------------------------- bytes


def live_by_kind() -> dict[str, int]:
    out: dict[str, int] = {}
    for a in jax.live_arrays():
        kind = getattr(a.sharding, "memory_kind", None) or "device"
        kind = "host" if "host" in kind else "device"
        out[kind] = out.get(kind, 0) + a.nbytes
    return out


def held_bytes(vjp, f, *args) -> dict[str, int]:
    """Bytes (device / host) alive while ``vjp_fn`` is held, beyond what was alive before
    and the output."""
    gc.collect()
    before = live_by_kind()
    out, vjp_fn = vjp(f, *args)
    jax.block_until_ready(out)
    gc.collect()
    after = live_by_kind()
    held = {k: after.get(k, 0) - before.get(k, 0) for k in ("device", "host")}
    held["device"] -= out.nbytes
    del out, vjp_fn
    gc.collect()
    return held


def tape_bytes(tape) -> tuple[int, int]:
    """``(tape.saved_bytes, own count)``. The own count, independent of how
    ``saved_bytes`` treats loops: every distinct value the top-level records keep, plus,
    for each loop/branch record, its body's residuals times the trip count (nested loops
    multiplied), less the body inputs the outer record keeps once (a scan's consts and
    scanned slices, a cond's operands)."""

    def own(t, skip=frozenset()) -> int:
        const_ids = {v.id for v, _ in t.consts}
        kept, _ = t.residual_keys()
        n = sum(v.nbytes for k, v in kept.items() if k not in const_ids and k not in skip)
        for rec in t.records:
            if not rec.bodies or rec.rule == "none":
                continue
            if rec.primitive == "scan":
                nc, nk = rec.params["num_consts"], rec.params["num_carry"]
                ins = rec.bodies[0].inputs
                fwd = frozenset(v.id for j, v in enumerate(ins) if j < nc or j >= nc + nk)
            else:
                fwd = frozenset(v.id for body in rec.bodies for v in body.inputs)
            n += sum(own(body, fwd) for body in rec.bodies) * rec.trip_count
        return n

    return tape.saved_bytes, own(tape)


# -------------------------------------------------------------------------- main


def machine_line() -> str:
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return (
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} cpus, "
        f"jax {jax.__version__}, device {jax.devices()[0].device_kind} "
        f"({jax.devices()[0].platform}), Python {platform.python_version()}, "
        f"load average {load:.1f}"
    )


def run_model(m: Model, quick: bool) -> tuple[list[str], dict]:
    """Detail lines and the summary figures of one model."""
    f, params, x = m.f, m.params, m.x
    jit_rounds, eager_rounds = (20, 3) if quick else (100, 9)
    rows = []

    # jit
    jt, jj = jax.jit(tg.grad(f)), jax.jit(jax.grad(f))
    err = max_err(jt(params, x), jj(params, x))
    assert err < 1e-4, f"{m.name}: jit tapegrad and jax disagree by {err}"
    t0 = time.perf_counter()
    j_tg, j_jax, j_ratio = paired(lambda: jt(params, x), lambda: jj(params, x), jit_rounds, 3)
    j_s = time.perf_counter() - t0

    # eager, warm: 4 calls each first, so tapegrad's fused path has compiled where it applies
    eg_tg, eg_jax = tg.grad(f), jax.grad(f)
    t0 = time.perf_counter()
    e_tg, e_jax, e_ratio = paired(
        lambda: eg_tg(params, x), lambda: eg_jax(params, x), eager_rounds, 4
    )
    e_s = time.perf_counter() - t0
    err = max_err(eg_tg(params, x), eg_jax(params, x))
    assert err < 1e-4, f"{m.name}: eager tapegrad and jax disagree by {err}"
    rows.append(
        f"  jit   tg/jax {j_tg:9.3f} / {j_jax:9.3f} ms = {j_ratio:5.2f}x   "
        f"({jit_rounds} rounds, {j_s:.0f} s)"
    )
    rows.append(
        f"  eager tg/jax {e_tg:9.2f} / {e_jax:9.2f} ms = {e_ratio:5.2f}x   "
        f"({eager_rounds} rounds, {e_s:.0f} s)"
    )

    # bytes
    saved, with_steps = tape_bytes(tg.trace(f)(params, x))
    b_jax = held_bytes(jax.vjp, f, params, x)
    rows.append(
        f"  bytes jax.vjp        {b_jax['device']:>12,} B device {b_jax['host']:>10,} B host"
        f"   (tg.trace saved_bytes {saved:,} B; outer + per-step x T {with_steps:,} B)"
    )
    summary = {
        "model": m.name,
        "jit": f"{j_ratio:.2f}× ({j_tg:.2f} / {j_jax:.2f} ms)",
        "eager": f"{e_ratio:.2f}× ({e_tg:.1f} / {e_jax:.1f} ms)",
        "jax": f"{b_jax['device']:,}",
        "tape": f"{saved:,} / {with_steps:,}",
    }
    for pol in m.policies:
        t0 = time.perf_counter()
        b = held_bytes(lambda f, *a: tg.vjp(f, *a, policy=POLICIES[pol]()), f, params, x)
        dt = time.perf_counter() - t0
        r = b["device"] / b_jax["device"]
        rows.append(
            f"  bytes tg {pol:11} {b['device']:>12,} B device {b['host']:>10,} B host"
            f"   device tg/jax {r:5.2f}x   (eager vjp {dt:.2f} s)"
        )
        summary[pol] = (
            f"{b['device']:,} ({r:.2f}×)"
            if pol in ("save", "bf16")
            else f"{r:.2f}× dev, {b['host']:,} host"
        )
    return rows, summary


SUMMARY_COLUMNS = [
    ("model", "model"),
    ("jit", "jit tg/jax"),
    ("eager", "eager tg/jax"),
    ("jax", "jax.vjp B"),
    ("save", "tg save() B"),
    ("offload", "offload(inputs=True)"),
    ("offload-in", "offload()"),
    ("bf16", "compress(bf16) B"),
    ("tape", "tg.trace saved_bytes / own count"),
]


def summary_table(summaries: list[dict]) -> str:
    lines = [
        "| " + " | ".join(h for _, h in SUMMARY_COLUMNS) + " |",
        "|" + "---|" * len(SUMMARY_COLUMNS),
    ]
    for s in summaries:
        lines.append("| " + " | ".join(s.get(k, "–") for k, _ in SUMMARY_COLUMNS) + " |")
    return "\n".join(lines)


def profile(m: Model, top: int = 18) -> None:
    """cProfile one warm eager grad call of each library."""
    for name, g in (("tapegrad", tg.grad(m.f)), ("jax", jax.grad(m.f))):
        for _ in range(4):
            jax.block_until_ready(g(m.params, m.x))
        pr = cProfile.Profile()
        pr.enable()
        jax.block_until_ready(g(m.params, m.x))
        pr.disable()
        print(f"--- {name}: eager grad of {m.name}")
        pstats.Stats(pr).sort_stats("cumulative").print_stats(top)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--only", nargs="*", help="model keys: rnn stack stack_relu mlp_relu tf_relu")
    ap.add_argument("--profile", metavar="MODEL", help="cProfile one eager call and exit")
    _results.add_arguments(ap)
    a = ap.parse_args()
    ms = models(a.quick)
    if a.profile:
        profile(next(m for m in ms if m.key == a.profile))
        return
    _results.start(a)
    print(machine_line())
    t_start = time.perf_counter()
    summaries = []
    for m in ms:
        if a.only and m.key not in a.only:
            continue
        print(m.name)
        rows, summary = run_model(m, a.quick)
        for row in rows:
            print(row, flush=True)
        summaries.append(summary)
    print()
    print(machine_line())
    print(summary_table(summaries))
    print(f"total {time.perf_counter() - t_start:.0f} s")
    _results.finish(a, "loop_bench")


if __name__ == "__main__":
    main()
