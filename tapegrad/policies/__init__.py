"""Residual policies: what happens to each value a record keeps for backward."""

from tapegrad.policies._base import (ResidualInfo, ResidualPolicy, Save, current_policy,
                                     residual_policy, save)

__all__ = ["ResidualInfo", "ResidualPolicy", "Save", "current_policy", "residual_policy", "save"]
