"""PyTorch's saved-tensor hook contracts (TestAutograd test_saved_tensors_hook_*,
test_disabling_saved_tensor_hooks*, test_default_saved_tensors_hooks_*), for a
functional library: no in-place ops, version counters, threads or CUDA."""

from __future__ import annotations

import pytest

import tapegrad as tg
from tapegrad.core.residual_policy import current_policy, save

from ._torch import torch


def ident(x):
    return x


def _hooks_enabled() -> bool:
    """Whether registering hooks works here (PyTorch's _saved_tensors_hooks_is_enabled)."""
    try:
        with tg.saved_tensors_hooks(ident, ident):
            return True
    except RuntimeError:
        return False


# ---------------------------------------------------------------------------
# disable_saved_tensors_hooks


def test_disabling_saved_tensor_hooks():
    """test_disabling_saved_tensor_hooks: registering hooks in a disabled scope raises
    RuntimeError(msg), and so does entering the disabled scope while hooks are active;
    both leave the state as it was."""
    with tg.disable_saved_tensors_hooks("error message"):
        with pytest.raises(RuntimeError, match="error message"):
            with tg.saved_tensors_hooks(ident, ident):
                pass
    assert _hooks_enabled()

    with tg.saved_tensors_hooks(ident, ident):
        with pytest.raises(RuntimeError, match="error message") as e:
            with tg.disable_saved_tensors_hooks("error message"):
                pass
        assert str(e.value) == "error message"  # PyTorch's message; tapegrad's advice is a note
        assert any("outside the" in n for n in e.value.__notes__)
        assert current_policy() is not save()  # the hooks are still active
    assert _hooks_enabled()


def test_disabling_saved_tensor_hooks_nested():
    """test_disabling_saved_tensor_hooks_nested: the innermost message wins; leaving it
    restores the outer one; leaving both enables hooks again."""
    with tg.disable_saved_tensors_hooks("outer"):
        with tg.disable_saved_tensors_hooks("inner"):
            with pytest.raises(RuntimeError, match="inner"):
                with tg.saved_tensors_hooks(ident, ident):
                    pass
        assert not _hooks_enabled()
        with pytest.raises(RuntimeError, match="outer"):
            with tg.residual_policy(tg.policies.offload()):  # save_on_cpu: hooks too
                pass
    assert _hooks_enabled()


def test_disabled_scope_allows_the_default_policy_and_restores_on_error():
    with tg.disable_saved_tensors_hooks("off"):
        with tg.residual_policy(tg.policies.save()):  # no hooks: allowed
            pass
    with tg.residual_policy(tg.policies.save()):
        with tg.disable_saved_tensors_hooks("off"):
            pass
    with pytest.raises(ValueError), tg.disable_saved_tensors_hooks("off"):
        raise ValueError
    assert _hooks_enabled()


def test_disabling_as_torch():
    t = torch()
    from torch.autograd.graph import disable_saved_tensors_hooks, saved_tensors_hooks

    with saved_tensors_hooks(ident, ident):
        with pytest.raises(RuntimeError, match="error message"):
            with disable_saved_tensors_hooks("error message"):
                pass
    with disable_saved_tensors_hooks("outer"):
        with disable_saved_tensors_hooks("inner"):
            with pytest.raises(RuntimeError, match="inner"):
                with saved_tensors_hooks(ident, ident):
                    pass
        assert not t._C._autograd._saved_tensors_hooks_is_enabled()
    assert t._C._autograd._saved_tensors_hooks_is_enabled()
