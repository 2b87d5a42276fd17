"""How cheap a primitive is to run again: one table, read by the rebuilds
(`engine.rebuild`: cheap values backward rebuilds from what it keeps anyway) and by the
planner's hand-written plans (`planner.scorer`: "save all but cheap")."""

from __future__ import annotations

__all__ = ["EXACT_CHEAP", "CHEAP"]

# Elementwise arithmetic, casts, bit ops, comparisons and layout: run again, a few
# memory-bound ops per element, and the very same bits.
EXACT_CHEAP = frozenset(
    {
        "add",
        "sub",
        "mul",
        "div",
        "neg",
        "max",
        "min",
        "select_n",
        "convert_element_type",
        "bitcast_convert_type",
        "shift_left",
        "shift_right_logical",
        "shift_right_arithmetic",
        "and",
        "or",
        "xor",
        "not",
        "eq",
        "ne",
        "lt",
        "le",
        "gt",
        "ge",
        "broadcast_in_dim",
        "reshape",
        "squeeze",
        "expand_dims",
        "transpose",
        "slice",
        "unstack",  # jax 0.11 splits ``k1, k2 = split(key)`` with it (0.10: slice, squeeze)
        "concatenate",
        # iota: one-hot labels (``y[:, None] == iota``) and index arithmetic (labels
        # made into gather indices) are rebuilt too
        "iota",
    }
)
# Also cheap to run again, though transcendental, rounding or padding: what a plan that
# keeps "all but cheap" values recomputes.
CHEAP = EXACT_CHEAP | frozenset(
    {
        "abs",
        "sign",
        "exp",
        "exp2",
        "log",
        "log1p",
        "expm1",
        "tanh",
        "logistic",
        "sin",
        "cos",
        "tan",
        "sqrt",
        "rsqrt",
        "cbrt",
        "integer_pow",
        "pow",
        "square",
        "erf",
        "erf_inv",
        "split",
        "pad",
        "rev",
        "copy",
        "copy_p",
        "stop_gradient",
        "clamp",
        "is_finite",
        "nextafter",
        "round",
        "floor",
        "ceil",
        "reduce_precision",
    }
)
