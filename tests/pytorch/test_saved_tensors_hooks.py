"""PyTorch's saved-tensor hook contracts (TestAutograd test_saved_tensors_hook_*,
test_disabling_saved_tensor_hooks*, test_default_saved_tensors_hooks_*), for a
functional library: no in-place ops, version counters, threads or CUDA."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

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


# ---------------------------------------------------------------------------
# Double backward: an unpacked value stands for the residual it replaced


def cube(a):
    return jnp.sum(a**3)


A = jnp.array([0.5, 1.0, 2.0])


def _first(pack, unpack):
    """The first gradient, built with the hooks active (PyTorch: ``create_graph=True``)."""

    def first(a):
        with tg.saved_tensors_hooks(pack, unpack):
            return tg.grad(cube)(a)

    return first


SECOND = {
    "jax.grad": lambda g: jax.grad(lambda a: jnp.sum(g(a))),
    "tg.grad": lambda g: tg.grad(lambda a: jnp.sum(g(a))),
    "jit": lambda g: jax.jit(jax.grad(lambda a: jnp.sum(g(a)))),
    "vmap": lambda g: lambda a: jax.vmap(jax.grad(lambda a: jnp.sum(g(a))))(a[:, None])[:, 0],
    "jvp": lambda g: lambda a: jax.jvp(g, (a,), (jnp.ones_like(a),))[1],
}


@pytest.mark.parametrize("second", SECOND.values(), ids=SECOND.keys())
def test_default_saved_tensors_hooks_double_backward(second):
    """test_default_saved_tensors_hooks_double_backward: ``a ** 3`` saves a. With hooks
    (x -> x, x -> x) d/da sum(3 a^2) = 6a. With (x -> 2x, x -> x) the first gradient is
    3 (2a)^2 = 12 a^2, and PyTorch's second is 6 * 2 * a = 12a, not 24a: the unpacked
    2a stands for a (its derivative flows to a as a's own), pack is not differentiated."""
    np.testing.assert_allclose(second(_first(ident, ident))(A), 6 * A, rtol=1e-6)
    np.testing.assert_allclose(_first(lambda x: 2 * x, ident)(A), 12 * A**2, rtol=1e-6)
    np.testing.assert_allclose(second(_first(lambda x: 2 * x, ident))(A), 12 * A, rtol=1e-6)
    # a hook pair that gives the value back exactly: the derivatives are jax's
    exact = _first(lambda x: 2 * x, lambda x: x / 2)
    np.testing.assert_allclose(second(exact)(A), 6 * A, rtol=1e-6)


def test_double_backward_through_a_lossy_policy_is_straight_through():
    """The same contract for the built-in policies: a bf16 residual stands for the
    float32 value it rounded, so the second derivative is the exact rule's, evaluated at
    the rounded value (it was the derivative of the rounding)."""
    f = lambda a: jnp.sum(jnp.sin(a) ** 3)  # integer_pow saves s = sin(a): compressed
    first = tg.grad(f, policy=tg.policies.compress(jnp.bfloat16))
    a = jnp.array([0.3, 0.7, 1.1])
    u = jnp.sin(a).astype(jnp.bfloat16).astype(jnp.float32)  # what backward gets for s
    np.testing.assert_allclose(first(a), 3 * u**2 * jnp.cos(a), rtol=1e-6)
    want = 6 * u * jnp.cos(a) ** 2 - 3 * u**2 * jnp.sin(a)  # d/da, with du/da = cos(a)
    got = jax.grad(lambda a: jnp.sum(first(a)))(a)
    np.testing.assert_allclose(got, want, rtol=1e-5)


def test_straight_through_adds_nothing_to_the_compiled_program():
    """Under jit without an outer derivative the unpacked value is used as it is: the
    compiled backward is the one hooks would give without the straight-through."""
    pol = tg.policies.hooks(lambda x: 2 * x, ident)
    hlo = jax.jit(tg.grad(cube, policy=pol)).lower(A).as_text()
    assert "custom" not in hlo and hlo.count("stablehlo.multiply") <= 5


def test_double_backward_as_torch():
    t = torch()
    a = t.tensor(np.asarray(A, np.float64), requires_grad=True)
    with t.autograd.graph.saved_tensors_hooks(lambda x: 2 * x, lambda x: x):
        s = t.sum(a**3)
    (g,) = t.autograd.grad(s, (a,), create_graph=True)
    g.sum().backward()
    got = jax.grad(lambda a: jnp.sum(_first(lambda x: 2 * x, ident)(a)))(A)
    np.testing.assert_allclose(got, a.grad.numpy(), rtol=1e-6)


# ---------------------------------------------------------------------------
# The pack/unpack contract: an unpacked value of another shape or dtype is an error


class ClaimsExact:
    """A policy that says it is exact and is not: its unpack changes the dtype."""

    exact = True
    inputs = True

    def pack(self, value, info):
        return value

    def unpack(self, packed, info):
        return packed.astype(jnp.float16)


def _sin_times(x):
    return jnp.sum(jnp.sin(x) * x)  # the line the error must name


def _scanned(x):
    return jnp.sum(lax.scan(lambda c, a: (c + jnp.sin(a * c), None), x, jnp.arange(3.0))[0])


BROKEN = {
    "dtype, exact policy": ClaimsExact(),
    "shape, hooks": tg.policies.hooks(ident, lambda p: p[None]),
    "not an array, hooks": tg.policies.hooks(ident, lambda p: 3),
}
WAYS = {
    "eager": lambda g: g,
    "jit": jax.jit,
    "vmap": lambda g: lambda x: jax.vmap(g)(jnp.stack([x, x])),
}


@pytest.mark.parametrize("way", WAYS.values(), ids=WAYS.keys())
@pytest.mark.parametrize("policy", BROKEN.values(), ids=BROKEN.keys())
@pytest.mark.parametrize("f", [_sin_times, _scanned], ids=["records", "scan body"])
def test_unpack_that_breaks_the_contract_names_the_record_and_line(f, policy, way):
    """PyTorch checks what a backward gets against what was saved; tapegrad checks each
    unpacked residual: a ResidualError (a RuntimeError) that names the record, the user's
    line and the fix, never a gradient computed from the wrong value."""
    with pytest.raises(tg.ResidualError, match=r"unpack must return") as e:
        way(tg.grad(f, policy=policy))(jnp.linspace(0.1, 0.9, 3))
    assert "test_saved_tensors_hooks.py:" in str(e.value)
    assert "record #" in str(e.value)


# ---------------------------------------------------------------------------
# What the hooks see, and when


def test_saved_variable_packing_unpacking_with_default_hooks():
    """test_saved_variable_packing_unpacking_saved_original_with_default_hooks: for
    ``y = a * a``, hooks (2x, x / 2) give a.grad == 2a; hooks (2x, x) give 4a. By
    design, a value saved twice (self and other) is packed once here, twice in PyTorch."""
    a = jnp.array([0.5, -1.0, 2.0])
    square = lambda a: jnp.sum(a * a)
    packed = []

    def pack(x):
        packed.append(x.shape)
        return x

    with tg.saved_tensors_hooks(pack, ident):
        _, vjp_fn = tg.vjp(square, a)
    assert len(packed) == 1  # PyTorch: 2 (one per saved slot)
    with tg.saved_tensors_hooks(lambda x: 2 * x, lambda x: x / 2):
        np.testing.assert_allclose(tg.grad(square)(a), 2 * a)
    with tg.saved_tensors_hooks(lambda x: 2 * x, ident):
        np.testing.assert_allclose(tg.grad(square)(a), 4 * a)
    np.testing.assert_allclose(tg.grad(square)(a), jax.grad(square)(a))  # hooks exited


def test_did_not_save_original_with_default_hooks():
    """test_saved_variable_packing_unpacking_did_not_save_original_with_default_hooks:
    exp saves its output; through identity hooks a.grad == exp(a)."""
    a = jnp.array([0.1, 0.2])
    with tg.saved_tensors_hooks(ident, ident):
        np.testing.assert_allclose(tg.grad(lambda a: jnp.sum(jnp.exp(a)))(a), jnp.exp(a))


def test_setting_default_saved_variable_hooks_twice_should_use_inner():
    """test_setting_default_saved_variable_hooks_twice_should_use_inner: residuals saved
    in the inner scope use its hooks (5x, 5x): 2 * 5 * 5 * a; the outer's (3x, 3x):
    2 * 3 * 3 * b. Each vjp_fn unpacks after its scope has closed."""
    a, b = jnp.array([1.0, 2.0]), jnp.array([3.0, -1.0])
    square = lambda x: jnp.sum(x * x)
    with tg.saved_tensors_hooks(lambda x: 3 * x, lambda x: 3 * x):
        with tg.saved_tensors_hooks(lambda x: 5 * x, lambda x: 5 * x):
            _, vjp_a = tg.vjp(square, a)
        _, vjp_b = tg.vjp(square, b)
    np.testing.assert_allclose(vjp_a(jnp.ones(()))[0], 2 * 5 * 5 * a)
    np.testing.assert_allclose(vjp_b(jnp.ones(()))[0], 2 * 3 * 3 * b)


def test_wrapped_number_saved_tensors_hooks():
    """test_wrapped_number_saved_tensors_hooks: ``a * 3`` saves no array (3 is a literal),
    so a hook that raises is never called, eagerly or under jit."""

    def err_hook(x):
        raise RuntimeError("this hook should not be called")

    f = lambda a: jnp.sum(a * 3.0)
    with tg.saved_tensors_hooks(err_hook, err_hook):
        np.testing.assert_allclose(tg.grad(f)(jnp.ones(5)), 3.0)
        np.testing.assert_allclose(jax.jit(tg.grad(f))(jnp.ones(5)), 3.0)


class CustomError(Exception):
    pass


def test_saved_tensor_hooks_custom_error_propagation():
    """test_saved_tensor_hooks_custom_error_propagation: an exception raised by a pack
    hook (in forward) or an unpack hook (in backward) reaches the caller as it is; tapegrad
    adds a note naming the residual."""

    def raises(what):
        def hook(x):
            raise CustomError(what)

        return hook

    a = jnp.array(1.0)
    with tg.saved_tensors_hooks(raises("pack"), ident):
        with pytest.raises(CustomError, match="pack") as e:
            tg.vjp(jnp.sin, a)
    assert any("'sin'" in n for n in e.value.__notes__)
    with tg.saved_tensors_hooks(ident, raises("unpack")):
        _, vjp_fn = tg.vjp(jnp.sin, a)
    with pytest.raises(CustomError, match="unpack"):
        vjp_fn(jnp.ones(()))


def test_saved_tensors_hooks_custom_function_intermediates():
    """test_saved_tensor_hooks_custom_function_intermediates (and
    test_custom_function_saved_tensors): a tg.Function's saved intermediate goes through
    the hooks, and the gradient is right."""

    class Func(tg.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(jnp.exp(x))
            return jnp.exp(x)

        @staticmethod
        def backward(ctx, g):
            (intermediate,) = ctx.saved_tensors
            return g * intermediate

    seen = []
    a = jnp.array([0.5, 1.0])
    with tg.saved_tensors_hooks(lambda x: (seen.append(x.shape), 2 * x)[1], lambda x: x / 2):
        g = tg.grad(lambda a: jnp.sum(Func.apply(a)))(a)
    np.testing.assert_allclose(g, jnp.exp(a), rtol=1e-6)
    assert (2,) in seen


def test_saving_variable_to_disk(tmp_path):
    """test_saving_variable_to_disk: pack writes each residual to a file, unpack reads it
    back (eagerly: a pack that needs concrete data cannot run under jit)."""
    names = iter(range(100))

    def pack(x):
        path = tmp_path / f"{next(names)}.npy"
        np.save(path, np.asarray(x))
        return str(path)

    def unpack(path):
        return jnp.asarray(np.load(path))

    a = jnp.array([0.5, -2.0, 1.5])
    f = lambda a: jnp.sum(jnp.tanh(a) * a)
    with tg.saved_tensors_hooks(pack, unpack):
        g = tg.grad(f)(a)
    np.testing.assert_allclose(g, jax.grad(f)(a), rtol=1e-6)
    assert any(tmp_path.iterdir())


def test_hooks_under_jit_run_once_at_trace_time():
    """By design: under jax.jit the hooks run once, when the function is traced, on
    tracers; PyTorch calls them on every forward."""
    calls = []
    pol = tg.policies.hooks(lambda x: (calls.append(type(x)), x)[1], ident)
    step = jax.jit(tg.grad(lambda a: jnp.sum(jnp.sin(a)), policy=pol))
    step(A)
    step(A + 1.0)
    assert len(calls) == 1 and issubclass(calls[0], jax.core.Tracer)


# ---------------------------------------------------------------------------
# save_on_cpu


@pytest.mark.parametrize("kind", ["pinned_host", "unpinned_host"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64], ids=["f32", "f64"])
def test_graph_save_on_cpu(kind, dtype, x64):
    """test_graph_save_on_cpu (pin_memory True/False; float and double): y = a * a gives
    a.grad == 2a exactly, and the saved value keeps its dtype."""
    a = jnp.asarray(np.random.default_rng(0).standard_normal(5), dtype)
    pol = tg.policies.offload(kind, inputs=True)  # save_on_cpu copies inputs too
    g = tg.grad(lambda a: jnp.sum(a * a), policy=pol)(a)
    assert g.dtype == a.dtype
    np.testing.assert_array_equal(g, 2 * a)


def test_save_on_cpu_and_checkpoint():
    """test_save_on_cpu_and_checkpoint: offload around a checkpoint, and a checkpoint
    around offload, give the plain gradient of a.pow(2) eight times over."""
    a = jnp.array([[0.9, -1.1], [1.05, 0.95]])
    pow2 = lambda x: x**2

    def plain(a):
        return jnp.sum(pow2(pow2(pow2(pow2(a)))))

    def offload_around(a):
        h = tg.checkpoint(lambda x: pow2(pow2(x)))(pow2(a))
        return jnp.sum(pow2(h))

    def checkpoint_around(a):
        return jnp.sum(tg.checkpoint(lambda a: pow2(pow2(pow2(pow2(a)))))(a))

    want = jax.grad(plain)(a)
    pol = tg.policies.offload()
    np.testing.assert_allclose(tg.grad(offload_around, policy=pol)(a), want, rtol=1e-6)
    np.testing.assert_allclose(tg.grad(checkpoint_around, policy=pol)(a), want, rtol=1e-6)
    np.testing.assert_allclose(jax.jit(tg.grad(offload_around, policy=pol))(a), want, rtol=1e-6)
