"""dot_general: each operand's cotangent is another dot_general with the
cotangent, so each side saves only the *other* operand.

Under a mesh with Explicit axes the backward dot_general contracts the
primal's batch/free dimensions, which may be sharded, so (like jax's own
``_dot_general_transpose_lhs``) it names its output sharding: the primal
operand's, permuted into the dot_general's output order.
"""

from __future__ import annotations

import numpy as np
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec

from tapegrad.core import jax_compat as compat
from tapegrad.rules._registry import defvjp


def _remaining(n, *taken):
    taken = set(int(d) for t in taken for d in t)
    return [i for i in range(n) if i not in taken]


def _ranges_like(*xs):
    start = 0
    for x in xs:
        x_len = len(x)
        yield list(range(start, start + x_len))
        start += x_len


def _transpose_lhs(
    g, y, x_ndim, y_ndim, dimension_numbers, precision, pet, x_sharding, swap_ans=False
):
    (x_contract, y_contract), (x_batch, y_batch) = dimension_numbers
    x_kept = _remaining(x_ndim, x_contract, x_batch)
    y_kept = _remaining(y_ndim, y_contract, y_batch)
    if swap_ans:
        ans_batch, ans_y, _ = _ranges_like(x_batch, y_kept, x_kept)
    else:
        ans_batch, _, ans_y = _ranges_like(x_batch, x_kept, y_kept)
    dims = ((ans_y, y_kept), (ans_batch, list(y_batch)))
    x_contract_sorted_by_y = list(np.take(x_contract, np.argsort(y_contract)))
    unsorted_axes = list(x_batch) + x_kept + x_contract_sorted_by_y
    out_axes = np.argsort(unsorted_axes)
    out_sharding = None
    if x_sharding is not None:
        spec = tuple(x_sharding.spec) + (None,) * (x_ndim - len(x_sharding.spec))
        out_sharding = NamedSharding(
            x_sharding.mesh,
            PartitionSpec(*(spec[a] for a in unsorted_axes)),
            memory_kind=x_sharding.memory_kind,
        )
    out = lax.dot_general(
        g, y, dims, precision=precision, preferred_element_type=pet, out_sharding=out_sharding
    )
    return lax.transpose(out, tuple(int(a) for a in out_axes))


def _dot_lhs(g, r, p):
    dn = p["dimension_numbers"]
    x, y = r.in_avals
    return _transpose_lhs(
        g,
        r.x[1],
        len(x.shape),
        len(y.shape),
        dn,
        p["precision"],
        p["preferred_element_type"],
        compat.explicit_sharding(x),
    )


def _dot_rhs(g, r, p):
    (xc, yc), (xb, yb) = p["dimension_numbers"]
    x, y = r.in_avals
    return _transpose_lhs(
        g,
        r.x[0],
        len(y.shape),
        len(x.shape),
        ((yc, xc), (yb, xb)),
        p["precision"],
        p["preferred_element_type"],
        compat.explicit_sharding(y),
        swap_ans=True,
    )


defvjp("dot_general", ("x1", _dot_lhs), ("x0", _dot_rhs))
