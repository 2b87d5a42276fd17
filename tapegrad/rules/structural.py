"""Shape, layout, placement and scheduling primitives: all linear, none saves anything."""

from __future__ import annotations

import numpy as np
from jax import lax

from tapegrad.core import jax_compat as compat
from tapegrad.rules._registry import Rule, deflinear, defrule


def _broadcast_in_dim(g, r, p):
    in_shape = r.in_avals[0].shape
    dims = p["broadcast_dimensions"]
    # Sum over the new axes and over the size-1 axes that were stretched.
    new_axes = tuple(i for i in range(g.ndim) if i not in dims)
    stretched = tuple(d for i, d in enumerate(dims) if in_shape[i] == 1 and g.shape[d] != 1)
    summed = (
        lax.reduce_sum(g, tuple(sorted(new_axes + stretched))) if (new_axes or stretched) else g
    )
    return summed.reshape(in_shape)


deflinear("broadcast_in_dim", _broadcast_in_dim, *([None] * 8))  # dynamic-shape operands: none


def _reshape(g, r, p):
    shape = r.in_avals[0].shape
    dims = p.get("dimensions")
    if dims is None:
        return g.reshape(shape)
    # lax.reshape(x, s, dimensions=d) reshapes transpose(x, d): undo both.
    g = g.reshape(tuple(shape[d] for d in dims))
    return lax.transpose(g, tuple(int(i) for i in np.argsort(dims)))


deflinear("reshape", _reshape)
deflinear("squeeze", lambda g, r, p: g.reshape(r.in_avals[0].shape))
deflinear("expand_dims", lambda g, r, p: g.reshape(r.in_avals[0].shape))
deflinear(
    "transpose",
    lambda g, r, p: lax.transpose(g, tuple(int(i) for i in np.argsort(p["permutation"]))),
)
# Under Explicit mesh axes the broadcast would come out replicated over the
# reduced axes; like jax's transpose, give it back the operand's sharding.
deflinear(
    "reduce_sum",
    lambda g, r, p: lax.broadcast_in_dim(
        g,
        r.in_avals[0].shape,
        tuple(i for i in range(len(r.in_avals[0].shape)) if i not in p["axes"]),
        out_sharding=compat.explicit_sharding(r.in_avals[0]),
    ),
)
deflinear("name", lambda g, r, p: g)


# Placement, as jax's transposes do it. A constraint (an inlined jit's in/out shardings)
# puts the cotangent where it put the value.
deflinear("sharding_constraint", lambda g, r, p: compat.sharding_constraint_p.bind(g, **p))


def _device_put_vjp(p, r, cts, active):
    # Operand i's cotangent is output i's, sent back to where operand i came from: the
    # interpreter fills ``srcs`` from the forward operands (`compat.device_put_sources`).
    live = [i for i, (a, g) in enumerate(zip(active, cts)) if a and g is not None]
    if not live:
        return [None] * len(active)
    keep = {k: tuple(p[k][i] for i in live) for k in ("srcs", "devices", "copy_semantics")}
    out = [None] * len(active)
    for i, ct in zip(live, compat.device_put_back([cts[i] for i in live], keep)):
        out[i] = ct
    return out


# kind "transfer": run op by op, never as one jitted rule, since a jitted call cannot
# move a value off its device set (a cotangent back from 8 devices to one).
defrule(Rule("device_put", lambda p, ins, outs, active: (), _device_put_vjp, kind="transfer"))


def _optimization_barrier_vjp(p, r, cts, active):
    # Each operand's cotangent is its output's, through one barrier as in jax's transpose.
    # An output without a cotangent gives its operand none: jax's transpose makes a dense
    # zero there, in device memory even for a host-memory operand, which then fails (the
    # outer derivative of a backward that brought an offloaded residual back, whose host
    # value gets no cotangent: `_stands_for` sends it to the original).
    live = [i for i, (a, g) in enumerate(zip(active, cts)) if a and g is not None]
    out = [None] * len(active)
    if live:
        for i, g in zip(live, lax.optimization_barrier(tuple(cts[i] for i in live))):
            out[i] = g
    return out


defrule(Rule("optimization_barrier", lambda p, ins, outs, active: (), _optimization_barrier_vjp))
