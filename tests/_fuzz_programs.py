"""Random programs for the fuzz tests and the fuzz bench (one generator for both).

A program is data (a dict: input shapes, steps, a loss, a value seed), so a failing one
can be printed, stored as JSON (tests/fuzz_regressions.json) and rebuilt exactly:

* `generate(d, smooth)`: a program drawn with ``d`` -- `HypothesisDraw` inside a
  hypothesis test, `RandomDraw` (a seeded `random.Random`) in bench/fuzz.py.
* `build(prog)`: the program as a function of its inputs; `inputs(prog)`: their values.
* `POLICIES` / `POLICY_TOL`: residual policies and how far each may move the gradient
  from save()'s (float32 rounding, or the quantisation error of compress).

A program is a few float32 inputs of a random base shape (rank 0-3, dims 1-4, some
broadcast), then 2-8 steps drawn from the primitive set -- unary elementwise ops,
broadcasting binary ops, matmuls with a fresh weight input, reductions, transposes,
reshapes, slices, concatenations -- and a scalar loss. Programs checked under compression
use smooth ops only: a quantised residual may flip a comparison (abs, max, where), which
moves the gradient by design, not by a bug.
"""

from __future__ import annotations

import random
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import tapegrad as tg

__all__ = [
    "POLICIES",
    "POLICY_TOL",
    "COMPRESSING",
    "HypothesisDraw",
    "RandomDraw",
    "generate",
    "build",
    "inputs",
    "scale",
    "max_err",
]


class RandomDraw:
    """Random choices from a seeded `random.Random`."""

    def __init__(self, rng: random.Random):
        self.rng = rng

    def integers(self, lo: int, hi: int) -> int:
        return self.rng.randint(lo, hi)

    def booleans(self) -> bool:
        return self.rng.random() < 0.5

    def sampled_from(self, seq: Any) -> Any:
        return self.rng.choice(list(seq))


class HypothesisDraw:
    """Random choices from a hypothesis ``draw`` (shrinkable, derandomized in CI)."""

    def __init__(self, draw: Any):
        from hypothesis import strategies as st

        self.draw, self.st = draw, st

    def integers(self, lo: int, hi: int) -> int:
        return self.draw(self.st.integers(lo, hi))

    def booleans(self) -> bool:
        return self.draw(self.st.booleans())

    def sampled_from(self, seq: Any) -> Any:
        return self.draw(self.st.sampled_from(list(seq)))


SMOOTH_UNARY = {
    "sin": jnp.sin,
    "cos": jnp.cos,
    "tanh": jnp.tanh,
    "sigmoid": jax.nn.sigmoid,
    "softplus": jax.nn.softplus,
    "atan": jnp.arctan,
    "half": lambda x: x * 0.5,
    "shift": lambda x: x + 1.0,
    "log1p_sq": lambda x: jnp.log1p(x * x),
    "sqrt1p_sq": lambda x: jnp.sqrt(1.0 + x * x),
    "gauss": lambda x: jnp.exp(-x * x),
    "square": jnp.square,
    "neg": jnp.negative,
}
ROUGH_UNARY = {"abs": jnp.abs, "relu": jax.nn.relu, "round_mix": lambda x: x * jnp.round(x)}
SMOOTH_BINARY = {
    "add": jnp.add,
    "sub": jnp.subtract,
    "mul": jnp.multiply,
    "div": lambda x, y: x / (1.0 + y * y),
    "hypot1": lambda x, y: jnp.sqrt(1.0 + x * x + y * y),
}
ROUGH_BINARY = {
    "max": jnp.maximum,
    "min": jnp.minimum,
    "where": lambda x, y: jnp.where(x > y, jnp.sin(x), y * 0.5),
}
REDUCE = {"sum": jnp.sum, "mean": jnp.mean, "max": jnp.max}

POLICIES = {
    "save": tg.policies.save(),
    "offload": tg.policies.offload(),
    "compress_bf16": tg.policies.compress(jnp.bfloat16),
    "compress_int8": tg.policies.compress("int8"),
    "hooks_identity": tg.policies.hooks(lambda a: a, lambda a: a),
    "selective_never": tg.selective(lambda r: tg.CheckpointPolicy.NEVER),
}
# max |g_policy - g_save| / max(1, max |g_save|): float32 rounding, or quantisation.
POLICY_TOL = {
    "save": 1e-5,
    "offload": 1e-5,
    "hooks_identity": 1e-5,
    "selective_never": 1e-5,
    "compress_bf16": 0.03,
    "compress_int8": 0.06,
}
COMPRESSING = {"compress_bf16", "compress_int8"}

# Every other built-in policy, run by bench/fuzz.py (exact: gradients as save()'s).
P = tg.CheckpointPolicy
MORE_POLICIES = {
    "selective_recompute": tg.selective(lambda r: P.PREFER_RECOMPUTE),
    "budget_256": tg.policies.budget(bytes=256),
    "route_offload_big": tg.policies.route(
        lambda info: tg.policies.offload() if info.nbytes > 16 else tg.policies.save()
    ),
    "int8_inputs": tg.policies.compress("int8", inputs=True),
}
POLICY_TOL.update(
    selective_recompute=1e-5, budget_256=1e-5, route_offload_big=1e-5, int8_inputs=0.06
)
COMPRESSING = COMPRESSING | {"int8_inputs"}
ALL_POLICIES = {**POLICIES, **MORE_POLICIES}


def generate(d: Any, smooth: bool = False) -> dict:
    """A program as data: input shapes, steps, the final loss, a value seed. ``d`` draws
    the random choices (`RandomDraw` or `HypothesisDraw`)."""
    rank = d.integers(0, 3)
    base = tuple(d.integers(1, 4) for _ in range(rank))
    shapes = [base]
    if d.booleans():  # a second input that broadcasts against the first
        drop = d.integers(0, rank)
        shapes.append(tuple(1 if d.booleans() else n for n in base[drop:]))
    vals = list(shapes)  # the shape of every value so far
    unary = dict(SMOOTH_UNARY, **({} if smooth else ROUGH_UNARY))
    binary = dict(SMOOTH_BINARY, **({} if smooth else ROUGH_BINARY))
    reduce = {k: v for k, v in REDUCE.items() if not (smooth and k == "max")}
    steps = []
    for _ in range(d.integers(2, 8)):
        i = d.integers(0, len(vals) - 1)
        s = vals[i]
        kinds = (
            ["u", "u", "b", "b"]
            + (["mm", "r", "cat", "slice"] if s else [])
            + (["t"] if len(s) >= 2 else [])
            + (["flat"] if len(s) >= 2 else [])
        )
        kind = d.sampled_from(kinds)
        if kind == "u":
            steps.append(("u", d.sampled_from(sorted(unary)), i))
        elif kind == "b":
            partners = [j for j, t in enumerate(vals) if _broadcasts(s, t)]
            j = d.sampled_from(partners)
            steps.append(("b", d.sampled_from(sorted(binary)), i, j))
            s = np.broadcast_shapes(s, vals[j])
        elif kind == "mm":  # x @ W with a new weight input
            k = d.integers(1, 4)
            shapes.append((s[-1], k))
            vals.append((s[-1], k))  # the weight is a value too
            steps.append(("mm", i, len(vals) - 1))
            s = s[:-1] + (k,)
        elif kind == "r":
            axis = d.integers(0, len(s) - 1)
            keep = d.booleans()
            steps.append(("r", d.sampled_from(sorted(reduce)), i, axis, keep))
            s = s[:axis] + ((1,) if keep else ()) + s[axis + 1 :]
        elif kind == "cat":
            steps.append(("cat", i))
            s = s[:-1] + (2 * s[-1],)
        elif kind == "slice":
            steps.append(("slice", i))
            s = s[:-1] + (max(1, s[-1] // 2),)
        elif kind == "t":
            steps.append(("t", i))
            s = s[:-2] + (s[-1], s[-2])
        else:
            steps.append(("flat", i))
            s = (int(np.prod(s)),)
        vals.append(tuple(s))
    loss = d.sampled_from(["sumsq", "mean", "sum_tanh"])
    return {
        "shapes": shapes,
        "steps": steps,
        "loss": loss,
        "seed": d.integers(0, 2**31 - 1),
        "smooth": smooth,
    }


def _broadcasts(a, b) -> bool:
    try:
        np.broadcast_shapes(a, b)
        return True
    except ValueError:
        return False


def build(prog):
    """The program as a function of its inputs (one per entry of ``prog["shapes"]``)."""
    unary = dict(SMOOTH_UNARY, **ROUGH_UNARY)
    binary = dict(SMOOTH_BINARY, **ROUGH_BINARY)
    n_in = len(prog["shapes"])

    def f(*xs):
        # Inputs are values 0..; a matmul's weight input is a value at its own position.
        weights = iter(xs[n_in - _n_weights(prog) :]) if _n_weights(prog) else iter(())
        vals = list(xs[: n_in - _n_weights(prog)])
        for st_ in prog["steps"]:
            k = st_[0]
            if k == "u":
                vals.append(unary[st_[1]](vals[st_[2]]))
            elif k == "b":
                vals.append(binary[st_[1]](vals[st_[2]], vals[st_[3]]))
            elif k == "mm":
                w = next(weights)
                vals.append(w)
                vals.append(vals[st_[1]] @ w)
            elif k == "r":
                vals.append(REDUCE[st_[1]](vals[st_[2]], axis=st_[3], keepdims=st_[4]))
            elif k == "cat":
                v = vals[st_[1]]
                vals.append(jnp.concatenate([v, v * 0.5], axis=-1))
            elif k == "slice":
                v = vals[st_[1]]
                vals.append(v[..., : max(1, v.shape[-1] // 2)])
            elif k == "t":
                vals.append(jnp.swapaxes(vals[st_[1]], -1, -2))
            else:
                vals.append(vals[st_[1]].reshape(-1))
        v = vals[-1]
        if prog["loss"] == "sumsq":
            return jnp.sum(v * v)
        if prog["loss"] == "mean":
            return jnp.mean(v) + 0.1 * jnp.sum(vals[0])
        return jnp.sum(jnp.tanh(v))

    return f


def _n_weights(prog) -> int:
    return sum(1 for s in prog["steps"] if s[0] == "mm")


def inputs(prog):
    """The input values: the data inputs, then one weight per matmul, in step order."""
    rng = np.random.RandomState(prog["seed"])
    return [jnp.asarray(rng.uniform(-1.0, 1.0, size=s), jnp.float32) for s in prog["shapes"]]


# In numpy: jnp would compile a max/abs/sub per new shape, a sixth of a fuzz run's time.
def scale(g) -> float:
    return max(
        [1.0] + [float(np.max(np.abs(np.asarray(x)))) for x in jax.tree.leaves(g) if np.size(x)]
    )


def max_err(a, b) -> float:
    return max(
        [0.0]
        + [
            float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64))))
            for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))
            if np.size(x)
        ]
    )
