"""tapegrad: JAX autodiff on an explicit tape, with pluggable residual policies."""

from tapegrad import errors, policies, rules
from tapegrad._checkpoint import (CheckpointPolicy, checkpoint, checkpoint_sequential, name,
                                  selective)
from tapegrad._memory import MemoryReport, memory_report
from tapegrad._tape import Lit, Record, Saved, Tape, Var
from tapegrad._transforms import grad, trace, value_and_grad, vjp
from tapegrad.errors import (HookError, NonDifferentiableError, ResidualError, TapegradError)
from tapegrad.policies import (ResidualInfo, disable_saved_tensors_hooks, residual_policy,
                               saved_tensors_hooks)

__version__ = "0.1.0"

__all__ = [
    "CheckpointPolicy", "checkpoint", "checkpoint_sequential", "name", "selective",
    "HookError", "Lit", "MemoryReport", "NonDifferentiableError", "Record", "ResidualError",
    "ResidualInfo", "Saved", "Tape", "TapegradError", "Var", "__version__",
    "disable_saved_tensors_hooks", "errors", "grad", "memory_report", "policies",
    "residual_policy", "rules", "saved_tensors_hooks", "trace", "value_and_grad", "vjp",
]
