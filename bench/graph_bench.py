"""How long ``tape.graph()`` takes to draw, and how big the drawing is.

Targets (issue "Seeing a backward pass"): a 300-record tape's ``.svg()`` in under a second
in Python (Graphviz's layout included), at most ~150 boxes after folding, under 1 MB; each
engine timed (``dot``: Graphviz, where it is installed; ``python``: no dependency).

    python bench/graph_bench.py [--write] [--svg PATH [--engine dot|python]]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(__file__))
import _models as M  # noqa: E402
import _results  # noqa: E402

import tapegrad as tg  # noqa: E402


def _cases():
    ws = M.mlp_params(jax.random.PRNGKey(0), 8, 256)
    yield "8-layer MLP", tg.trace(M.mlp_loss)(ws, jnp.ones((64, 256)))
    arrays, heads = M.split_static(M.transformer_params(jax.random.PRNGKey(1), d=64, ff=128))

    def deep(p, x):
        for _ in range(8):
            x = M.transformer_block({**p, "heads": heads}, x)
        return jnp.mean(x**2)

    yield "8 transformer blocks", tg.trace(deep)(arrays, jnp.ones((2, 16, 64)))

    def chaos(x):  # nothing repeats: a new literal every step
        for i in range(120):
            x = jnp.sin(x * (i + 1.0)) + jnp.cos(x[::-1]) if i % 2 else jnp.tanh(x * i)
        return jnp.sum(x)

    yield "300+ distinct records", tg.trace(chaos)(jnp.ones((8, 8)))
    p = M.rnn_params(jax.random.PRNGKey(2))
    yield "scanned RNN", tg.trace(M.rnn_loss)(p, jnp.ones((32, 8, 128)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--svg", help="also write the README's picture (a 3-layer MLP) here")
    ap.add_argument("--engine", default="auto", help="who lays the picture out: dot, python")
    _results.add_arguments(ap)
    args = ap.parse_args()
    if args.svg:
        readme_picture(args.svg, args.engine)
    _results.start(args)
    engines = ["python"] + (["dot"] if shutil.which("dot") else [])
    head = [("records", 9), ("boxes", 7), ("folded", 8), ("graph s", 9)]
    head += [(f"{e} {what}", 11) for e in engines for what in ("s", "KB")]
    print(f"{'tape':<23}" + "".join(f"{h:>{w}}" for h, w in head))
    for name, tape in _cases():
        n = sum(1 for _ in _walk(tape))
        t0 = time.perf_counter()
        g = tape.graph()
        row = f"{name:<23}{n:>9}{g.nodes:>7}{g.folded:>8}{time.perf_counter() - t0:>9.2f}"
        for engine in engines:
            t1 = time.perf_counter()
            svg = g.svg(engine)
            row += f"{time.perf_counter() - t1:>11.2f}{len(svg) / 1e3:>11.0f}"
        print(row)
    _results.finish(args, "graph_bench")


def readme_picture(path: str, engine: str = "auto") -> None:
    """The README's graph: a small MLP under offload(), kept values and their bytes."""

    def mlp(ws, x):
        for w in ws:
            x = jnp.tanh(x @ w)
        return jnp.mean(x**2)

    ws = [jnp.full((64, 64), 0.01)] * 3
    rep = tg.memory_report(mlp, policy=tg.policies.offload())(ws, jnp.ones((16, 64)))
    rep.graph(engine=engine).save(path)


def _walk(tape):
    for r in tape.records:
        yield r
        for b in r.bodies:
            yield from _walk(b)


if __name__ == "__main__":
    main()
