"""Issue 45, item 4 on a CPU: does the program ``jax.jit`` compiles from a tapegrad gradient
follow the plan?

    python bench/compiled_plan.py            # the sizes below
    python bench/compiled_plan.py --quick    # tiny sizes: checks the script

Models: the 8-layer tanh MLP at the benchmarks' size (256 wide, batch 128: its weight
gradients, 2 MiB, outweigh its activations, 1 MiB), the same MLP where activations
dominate (128 wide, batch 1024: 4 MiB of activations, 0.5 MiB of weights), and one pre-LN
transformer block (`_models.transformer_block`: d=128, 4 heads, ff=512, seq 128, batch 4).
Plans: ``jax.grad``, ``save()``, per-layer checkpoints (the MLPs: ``tg.checkpoint``, and
``jax.checkpoint`` under ``jax.grad``), and ``budget(bytes=f * S)`` for f = 0.75, 0.5,
0.25, S being save()'s ``tg.memory_report(...).peak_beyond_inputs_bytes``; a budget no
plan meets prints the least peak the planner found, and the least that plans is a row.

Per row: the peak the plan predicts (``memory_report``: ``planned_peak_bytes`` for a
budget, else ``peak_beyond_inputs_bytes``; both equal the eager peak measured here), the
compiled program's ``memory_analysis().temp_size_in_bytes`` and its ratio to save()'s,
the same for the program compiled with XLA's barrier expander off (``kept``), and the
recomputed ops (dot, tanh, exponential, as ``+dot/tanh/exp`` over save()'s program):
what the plan recomputes (its tape's segments), what the lowered HLO holds, what the
compiled HLO holds, and what the ``kept`` compiled HLO holds. ``max|err|``: both compiled
gradients against ``jax.grad``'s. Argument and output bytes are the same for every plan
of a model and print once.

What it shows (jax 0.10.2, XLA:CPU):

* The lowered program holds the planned recomputation (a per-layer checkpoint's last
  layer is the exception: under ``grad`` the loss is dead, so jit's DCE drops forward's
  copy of that layer and its "recomputation" is its only run), each segment behind an
  ``optimization_barrier`` tied to backward's cotangents. XLA:CPU then drops it: its
  pipeline (``xla/service/cpu/cpu_compiler.cc``) runs ``HloCSE``, then
  ``OptimizationBarrierExpander`` (which deletes every barrier), then fusion, then
  "simplification after layout assignment" (``AlgebraicSimplifier``, ``HloDCE``,
  ``HloCSE`` to a fixed point), whose CSE merges every recomputed op whose fusion equals
  forward's. On the MLPs nothing recomputed survives and every plan compiles to save()'s
  temp bytes; ``jax.checkpoint`` fares no better (its dots merge, tanhs fused into their
  consumers survive, and temp grows). A barrier keeps a recomputation from CSE only where
  barriers are expanded after the last CSE.
* With that pass off (``compile(compiler_options={"xla_disable_hlo_passes":
  "cse_barrier_expander"})``, or ``XLA_FLAGS=--xla_disable_hlo_passes=cse_barrier_expander``)
  the compiled program keeps exactly the lowered recomputation, and where activations
  dominate, temp bytes follow the plan: save()'s temp is its predicted peak, a budget's
  its own predicted peak plus 64 bytes per barrier (the tuple of pointers a barrier's
  output is), so temp falls monotonically with the budget.
* At the benchmarks' MLP size temp is one activation under save(): XLA's buffer
  assignment keeps the saved activations in the output buffers of weight gradients not
  yet written (``maybe-live-out`` allocations, which ``temp_size_in_bytes`` leaves out).
  A recomputed activation is made in backward, when those buffers are taken, so it costs
  temp: with barriers kept, temp rises as the budget falls (not monotonic).
* The transformer block's temp is set by backward's transients beside what backward
  keeps (ten 1 MiB attention- and MLP-sized values at the peak). save() compiles to
  1.25x jax.grad's temp: XLA:CPU's library (YNN) fusions take a broadcast (the score
  scale, softmax's denominator) materialized, and save()'s forward and backward share
  it, so it lives from one to the other; with YNN fusion off
  (``XLA_FLAGS=--xla_cpu_experimental_ynn_fusion_type=``) the two are within 0.2%.
  With barriers kept the budgets' temp falls with the budget. It did not before
  tapegrad's backward read the cotangents through the barriers (`engine.residuals.
  tie_to`): XLA's algebraic simplifier removed barrier operands nothing else used, the
  recomputation lost its tie to backward and ran in forward, and the floor budget
  compiled to 1.15x save()'s temp (0.68x now).
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import Counter
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

_here = __file__.rsplit("/", 1)[0]
sys.path[:0] = [_here, _here + "/.."]  # bench/_models.py, and tapegrad from a checkout
import _results  # noqa: E402
from _models import (  # noqa: E402
    mlp_loss,
    mlp_params,
    split_static,
    transformer_block,
    transformer_params,
)

import tapegrad as tg  # noqa: E402

P = tg.policies
# XLA:CPU's OptimizationBarrierExpander ("cse_barrier_expander") off: barriers survive
# to the post-fusion CSE, and with them the recomputation they guard.
KEEP_BARRIERS = {"xla_disable_hlo_passes": "cse_barrier_expander"}
OPS = ("dot", "tanh", "exponential")  # HLO opcodes of dot_general, tanh, exp
PRIMS = ("dot_general", "tanh", "exp")  # the tape's primitives for them


def op_counts(hlo: str) -> tuple[int, ...]:
    """How many dot, tanh and exponential instructions an HLO module holds (fused
    computations included)."""
    c = Counter(re.findall(r"\s([a-z][\w\-]*)\(", hlo))
    return tuple(c[op] for op in OPS)


def planned_counts(tape) -> tuple[int, ...]:
    """dot_general, tanh and exp records the tape's segments recompute in backward."""
    c = Counter(tape.records[k].primitive for seg in tape.segments for k in seg.records)
    return tuple(c[p] for p in PRIMS)


def floor_of(err: Exception) -> int:
    return int(re.search(r"is ([\d,]+) bytes", str(err)).group(1).replace(",", ""))


def max_err(a, b) -> float:
    return max(
        float(jnp.max(jnp.abs(x - y))) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))
    )


# ---------------------------------------------------------------- models


def mlp_per_layer(ws, x):
    h = x
    for w in ws:
        h = tg.checkpoint(lambda h, w: jnp.tanh(h @ w))(h, w)
    return jnp.mean(h**2)


def per_layer_jax(ws, x):
    h = x
    for w in ws:
        h = jax.checkpoint(lambda h, w: jnp.tanh(h @ w))(h, w)
    return jnp.mean(h**2)


def models(quick: bool):
    width, batch = (32, 64) if quick else (256, 128)
    ws = mlp_params(jax.random.key(0), 8, width)
    x = jax.random.normal(jax.random.key(1), (batch, width))
    yield f"8-layer tanh MLP {width} wide, batch {batch}", mlp_loss, (ws, x), mlp_per_layer
    width, batch = (16, 256) if quick else (128, 1024)
    ws = mlp_params(jax.random.key(0), 8, width)
    x = jax.random.normal(jax.random.key(1), (batch, width))
    yield f"8-layer tanh MLP {width} wide, batch {batch}", mlp_loss, (ws, x), mlp_per_layer
    d, heads, ff, seq, batch = (32, 2, 64, 16, 2) if quick else (128, 4, 512, 128, 4)
    p, heads = split_static(transformer_params(jax.random.key(2), d=d, heads=heads, ff=ff))
    x = jax.random.normal(jax.random.key(3), (batch, seq, d))

    def block(p, x):
        return jnp.mean(transformer_block({**p, "heads": heads}, x) ** 2)

    name = f"transformer block d={d}, {heads} heads, ff={ff}, seq {seq}, batch {batch}"
    yield name, block, (p, x), None


# ---------------------------------------------------------------- rows


@dataclass
class Row:
    plan: str
    predicted: int | None  # the plan's peak (None: jax.grad, which has no plan)
    planned: tuple[int, ...] | None  # dot/tanh/exp records its segments recompute
    lowered: tuple[int, ...]  # dot/tanh/exp in the lowered HLO
    temp: int  # compiled, XLA:CPU's default pipeline
    compiled: tuple[int, ...]
    temp_kept: int  # compiled with barriers kept (KEEP_BARRIERS)
    kept: tuple[int, ...]
    err: float  # max|grad - jax.grad|, over both compiled programs
    io: tuple[int, int]  # argument and output bytes


def measure(plan: str, f, args, g, pol, ref) -> Row:
    predicted = planned = None
    if pol is not None:
        rep = tg.memory_report(f, argnums=(0, 1), policy=pol)(*args)
        predicted = rep.planned_peak_bytes
        if predicted is None:
            predicted = rep.peak_beyond_inputs_bytes
        planned = planned_counts(tg.trace(f, argnums=(0, 1), policy=pol)(*args))
    lowered = jax.jit(g).lower(*args)
    default, kept = lowered.compile(), lowered.compile(compiler_options=KEEP_BARRIERS)
    m, mk = default.memory_analysis(), kept.memory_analysis()
    err = max(max_err(default(*args), ref), max_err(kept(*args), ref))
    return Row(
        plan,
        predicted,
        planned,
        op_counts(lowered.as_text(dialect="hlo")),
        m.temp_size_in_bytes,
        op_counts(default.as_text()),
        mk.temp_size_in_bytes,
        op_counts(kept.as_text()),
        err,
        (m.argument_size_in_bytes, m.output_size_in_bytes),
    )


def plus(counts, base) -> str:
    if counts is None:
        return "-"
    return "+" + "/".join(str(a - b) for a, b in zip(counts, base))


def section(name, f, args, per_layer) -> list[Row]:
    print(f"\n# {name}")
    S = tg.memory_report(f, argnums=(0, 1), policy=P.save())(*args).peak_beyond_inputs_bytes
    ref = jax.jit(jax.grad(f, argnums=(0, 1)))(*args)
    plans: list[tuple[str, Any, Any]] = [("jax.grad", None, f), ("save()", P.save(), f)]
    if per_layer is not None:
        plans.append(("tg.checkpoint per layer", P.save(), per_layer))
        plans.append(("jax.checkpoint per layer", None, per_layer_jax))
    floors, least = [], S
    for frac in (0.75, 0.5, 0.25):
        pol = P.budget(bytes=int(frac * S))
        try:
            tg.trace(f, argnums=(0, 1), policy=pol)(*args)
        except P.BudgetError as e:
            floors.append(floor_of(e))
            print(f"budget {frac:.0%} ({pol.bytes:,} bytes): no plan; least peak {floors[-1]:,}")
            continue
        plans.append((f"budget {frac:.0%}", pol, f))
        least = pol.bytes
    for floor in sorted(f for f in floors if f < least):  # the least that plans
        pol = P.budget(bytes=floor)
        try:
            tg.trace(f, argnums=(0, 1), policy=pol)(*args)
        except P.BudgetError:
            continue
        plans.append((f"budget floor ({floor / S:.0%})", pol, f))
        break
    rows = []
    for plan, pol, fn in plans:
        g = jax.grad(fn, argnums=(0, 1)) if pol is None else tg.grad(fn, argnums=(0, 1), policy=pol)
        rows.append(measure(plan, fn, args, g, pol, ref))
    save = next(r for r in rows if r.plan == "save()")
    io = {r.io for r in rows}
    print(f"save(): peak beyond inputs {S:,} bytes; (arguments, outputs) bytes {io}")
    print(
        f"{'plan':26s} {'predicted':>10s} {'temp':>10s} {'x save':>6s} {'temp kept':>10s} "
        f"{'x save':>6s} | recomputed +dot/tanh/exp: {'planned':>8s} {'lowered':>8s} "
        f"{'compiled':>8s} {'kept':>8s} | max|err|"
    )
    for r in rows:
        p = "-" if r.predicted is None else f"{r.predicted:,}"
        print(
            f"{r.plan:26s} {p:>10s} {r.temp:>10,} {r.temp / save.temp:6.2f} {r.temp_kept:>10,} "
            f"{r.temp_kept / save.temp_kept:6.2f} | {'':25s} {plus(r.planned, save.planned):>8s} "
            f"{plus(r.lowered, save.lowered):>8s} {plus(r.compiled, save.compiled):>8s} "
            f"{plus(r.kept, save.kept):>8s} | {r.err:.1e}"
        )
    print(
        f"(save()'s program: dot/tanh/exp lowered {'/'.join(map(str, save.lowered))}, "
        f"compiled {'/'.join(map(str, save.compiled))}; its tape recomputes "
        f"{'/'.join(map(str, save.planned))})"
    )
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    _results.add_arguments(ap)
    a = ap.parse_args()
    _results.start(a)
    dev = jax.devices()[0]
    print(f"jax {jax.__version__} on {dev.platform} ({dev.device_kind})")
    for name, f, args, per_layer in models(a.quick):
        section(name, f, args, per_layer)
    _results.finish(a, "compiled_plan")


if __name__ == "__main__":
    main()
