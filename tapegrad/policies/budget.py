"""`tg.policies.budget`: the memory-budget planner, which lives in `tapegrad.planner`.

This module keeps the documented import path working::

    from tapegrad.policies.budget import Budget, BudgetError, budget, estimate

`budget(bytes=...)` returns a `Budget` policy that chooses, per residual, to save,
recompute, offload or compress so that the activation peak stays under ``bytes``;
`estimate` is the executor's (peak bytes, recompute flops) of a planned tape, and
`record_flops` / `segment_flops` the recompute costs it counts. The planner's search,
cost model and solvers are in `tapegrad.planner` (see its module notes).
"""

from tapegrad.planner import (
    Budget,
    BudgetError,
    budget,
    estimate,
    record_flops,
)

__all__ = ["Budget", "budget", "estimate", "BudgetError", "record_flops"]
