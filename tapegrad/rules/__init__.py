"""VJP rules, keyed by primitive name, grouped by family."""

from tapegrad.rules import (  # noqa: F401  (register rules)
    conv,
    custom_jvp,
    elementwise,
    indexing,
    linalg,
    reductions,
    structural,
)
from tapegrad.rules._registry import (
    NONDIFF,
    RULES,
    Res,
    Rule,
    deflinear,
    defnondiff,
    defrule,
    defvjp,
    lookup,
)
from tapegrad.rules.control import FALLBACK, WHILE_ERROR

__all__ = [
    "NONDIFF",
    "RULES",
    "Res",
    "Rule",
    "FALLBACK",
    "WHILE_ERROR",
    "deflinear",
    "defnondiff",
    "defrule",
    "defvjp",
    "lookup",
]
