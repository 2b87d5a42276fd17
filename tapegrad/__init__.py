"""tapegrad: JAX autodiff on an explicit tape, with pluggable residual policies."""

from tapegrad import errors, policies, rules
from tapegrad._tape import Lit, Record, Saved, Tape, Var
from tapegrad._transforms import grad, trace, value_and_grad, vjp
from tapegrad.errors import NonDifferentiableError, ResidualError, TapegradError
from tapegrad.policies import residual_policy

__version__ = "0.1.0"

__all__ = [
    "Lit", "NonDifferentiableError", "Record", "ResidualError", "Saved", "Tape", "TapegradError",
    "Var", "__version__", "errors", "grad", "policies", "residual_policy", "rules", "trace",
    "value_and_grad", "vjp",
]
