"""Residual policies: what happens to each value a record keeps for backward.

A policy is any object with ``pack(value, info)`` and ``unpack(packed, info)``.
"""

from tapegrad.core.residual_policy import (
    ResidualInfo,
    ResidualPolicy,
    Save,
    current_policy,
    disable_saved_tensors_hooks,
    residual_policy,
    save,
)
from tapegrad.planner import CostModel, calibrate
from tapegrad.policies._allocate import BitAllocation

# Through the submodule: importing it binds ``tapegrad.policies.budget`` to the module,
# which the function then replaces here, once (a later import would not rebind it).
from tapegrad.policies.budget import Budget, BudgetError, budget
from tapegrad.policies.compress import Compress, Int8, compress
from tapegrad.policies.hooks import Hooks, Route, hooks, route, saved_tensors_hooks
from tapegrad.policies.loops import ScanCheckpoint, scan_checkpoint
from tapegrad.policies.offload import Offload, offload

__all__ = [
    "BitAllocation",
    "Budget",
    "BudgetError",
    "CostModel",
    "budget",
    "calibrate",
    "Compress",
    "Hooks",
    "Int8",
    "Offload",
    "ResidualInfo",
    "ResidualPolicy",
    "Route",
    "Save",
    "ScanCheckpoint",
    "compress",
    "current_policy",
    "disable_saved_tensors_hooks",
    "hooks",
    "offload",
    "residual_policy",
    "route",
    "save",
    "saved_tensors_hooks",
    "scan_checkpoint",
]
