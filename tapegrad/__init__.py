"""tapegrad: JAX autodiff on an explicit tape, with pluggable residual policies."""

from tapegrad import (
    errors,
    passes,
    policies,
    rules,
)
from tapegrad._version import __version__
from tapegrad.anomaly.detect import (
    AnomalyEvent,
    AnomalyLog,
    AnomalyMode,
    detect_anomaly,
    is_anomaly_enabled,
    set_detect_anomaly,
)
from tapegrad.api.checkpoint import checkpoint, checkpoint_sequential, name
from tapegrad.api.function import Function, FunctionCtx, once_differentiable
from tapegrad.api.grad_hook import hook
from tapegrad.api.gradcheck import gradcheck, gradgradcheck
from tapegrad.api.transforms import grad, trace, value_and_grad, vjp
from tapegrad.core.caches import clear_caches
from tapegrad.core.tape import Lit, Record, Saved, Tape, Var
from tapegrad.display import html, text  # noqa: F401  (register the tape's printers)
from tapegrad.display.graph import TapeGraph
from tapegrad.engine.checkpoint import CheckpointPolicy, selective
from tapegrad.errors import (
    AnomalyError,
    DtypeError,
    EffectError,
    FunctionBackwardError,
    FunctionGradShapeError,
    GradcheckError,
    HookError,
    InvalidTapeError,
    MissingRuleError,
    NonDifferentiableError,
    OnceDifferentiableError,
    ProcessMismatchError,
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
from tapegrad.report.jax_residuals import JaxResiduals, jax_residuals
from tapegrad.report.memory import MemoryReport, memory_report

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
    "OnceDifferentiableError",
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
    "FunctionBackwardError",
    "FunctionGradShapeError",
    "GradcheckError",
    "InvalidTapeError",
    "MissingRuleError",
    "ProcessMismatchError",
    "TracerLeakError",
    "detect_anomaly",
    "gradcheck",
    "gradgradcheck",
    "is_anomaly_enabled",
    "passes",
    "set_detect_anomaly",
]
