"""The memory planner: per residual, save, recompute, offload or compress, so that the
activation peak fits a byte budget at the least predicted step time.

`budget(bytes=...)` (`tg.policies.budget`) returns a `Budget` policy whose tape plan
the interpreter runs. Bottom up:

* the problem: `cost` (the cost model, `CostModel`, `calibrate`, flops and bytes),
  `problem` (the executor's schedule of a planned tape: `estimate`, `simulate`),
  `joint` (a plan's timeline and the per-residual mechanisms on it), `index` (the
  tape's facts for scoring many plans), `chain` (the chain view);
* the solvers: `chain` and `chain_joint` (exact programs on chains), `stages` (the
  chain program over layers), `scorer` and `families` (save/recompute candidates),
  `search` (local and iterated searches), `ilp` and `ilp_joint` (HiGHS programs, the
  joint one's model in `ilp_joint_model`, `ilp_joint_columns`, `ilp_joint_rows`);
* on top: `candidates` (the stages' work limits and the exact programs' candidates),
  `save_recompute`, `joint_search`, `joint_plan`, and `policy` (`Budget`, `budget`).

`measure` checks a plan's predicted peak against the arrays jax holds. Nothing in the
planner imports the package's api; the policies package re-exports `budget`,
`Budget`, `BudgetError`, `CostModel` and `calibrate`.
"""

from tapegrad.planner.budget import Budget, budget
from tapegrad.planner.cost import (
    CostModel,
    calibrate,
    default_costs,
    prefetch_depth,
    record_flops,
    segment_flops,
)
from tapegrad.planner.problem import BudgetError, estimate, simulate

__all__ = [
    "Budget",
    "BudgetError",
    "CostModel",
    "budget",
    "calibrate",
    "default_costs",
    "estimate",
    "prefetch_depth",
    "record_flops",
    "segment_flops",
    "simulate",
]
