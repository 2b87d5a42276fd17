"""tapegrad: JAX autodiff on an explicit tape, with pluggable residual policies."""

from tapegrad import (
    _display_html,  # noqa: F401  (registers the tape's "html" printer)
    _display_text,  # noqa: F401  (registers the tape's "text" printer)
    errors,
    passes,
    policies,
    rules,
)
from tapegrad._anomaly import (
    AnomalyEvent,
    AnomalyLog,
    AnomalyMode,
    detect_anomaly,
    is_anomaly_enabled,
    set_detect_anomaly,
)
from tapegrad._caches import clear_caches
from tapegrad._checkpoint import (
    CheckpointPolicy,
    checkpoint,
    checkpoint_sequential,
    name,
    selective,
)
from tapegrad._checks import gradcheck, gradgradcheck
from tapegrad._function import Function, FunctionCtx, once_differentiable
from tapegrad._graph import TapeGraph
from tapegrad._hooks import hook
from tapegrad._jax_residuals import JaxResiduals, jax_residuals
from tapegrad._memory import MemoryReport, memory_report
from tapegrad._tape import Lit, Record, Saved, Tape, Var
from tapegrad._transforms import grad, trace, value_and_grad, vjp
from tapegrad._version import __version__
from tapegrad.errors import (
    AnomalyError,
    DtypeError,
    EffectError,
    GradcheckError,
    HookError,
    InvalidTapeError,
    MissingRuleError,
    NonDifferentiableError,
    ResidualError,
    TapegradError,
    TracerLeakError,
)
from tapegrad.policies import (
    ResidualInfo,
    disable_saved_tensors_hooks,
    residual_policy,
    saved_tensors_hooks,
)

__all__ = [
    "CheckpointPolicy",
    "checkpoint",
    "checkpoint_sequential",
    "clear_caches",
    "name",
    "selective",
    "HookError",
    "Lit",
    "MemoryReport",
    "NonDifferentiableError",
    "Record",
    "ResidualError",
    "ResidualInfo",
    "Saved",
    "Tape",
    "TapeGraph",
    "TapegradError",
    "Var",
    "__version__",
    "disable_saved_tensors_hooks",
    "errors",
    "grad",
    "memory_report",
    "policies",
    "residual_policy",
    "rules",
    "saved_tensors_hooks",
    "trace",
    "value_and_grad",
    "vjp",
    "Function",
    "FunctionCtx",
    "hook",
    "jax_residuals",
    "JaxResiduals",
    "once_differentiable",
    "AnomalyError",
    "AnomalyEvent",
    "AnomalyLog",
    "AnomalyMode",
    "DtypeError",
    "EffectError",
    "GradcheckError",
    "InvalidTapeError",
    "MissingRuleError",
    "TracerLeakError",
    "detect_anomaly",
    "gradcheck",
    "gradgradcheck",
    "is_anomaly_enabled",
    "passes",
    "set_detect_anomaly",
]
