"""PyTorch, for the tests that also compare with it: skipped where it is not installed.

Every test in this folder asserts against its own oracle (jax.grad, finite differences,
hand-derived numbers) first; a ``*_as_torch`` test adds PyTorch itself when it can."""

from __future__ import annotations

import pytest


def torch():
    return pytest.importorskip("torch")
