"""Shared helpers for tapegrad's oracle tests.

Every oracle test compares tapegrad against an independent answer: `jax.grad`
/ `jax.vjp` on the same function, or float64 finite differences. The helpers:

* `assert_grads_match(f, *args, argnums=0, ...)`: ``tg.grad`` vs ``jax.grad``.
* `assert_value_and_grad_match(f, *args, ...)`: the same for ``value_and_grad``.
* `assert_vjp_match(f, *args, seed=0, ...)`: ``tg.vjp`` vs ``jax.vjp`` on a
  random cotangent with the output's structure.
* `tols(dtype)`: the default (rtol, atol) for a dtype.
* `rand(shape, dtype, low, high, seed)`: deterministic uniform inputs.
* fixture `x64`: float64 enabled inside one test, the previous setting restored.
* `live_bytes_by_kind()`: bytes of the live jax arrays per memory kind (after gc).

Default tolerances: float64 rtol 1e-10 / atol 1e-12; float32 rtol 1e-5 /
atol 1e-6; bfloat16/float16 looser. A test that loosens them says why.

The hypothesis profile ``"ci"`` (bounded, derandomized examples, no deadline: the first
example of a test pays for jax's compile caches) is registered and loaded here.
A test can add ``("summary", text)`` to ``request.node.user_properties``; the
texts are printed at the end of the run (also under pytest-xdist).
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import importlib.metadata
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Callable, Sequence
from typing import Any

# XLA:CPU compiles a small program about 30% faster with its older loop emitters than with
# its MLIR fusion emitters (the default), and compiling is most of this
# suite's time: tests/rules/test_elementwise.py and tests/oracle/test_control.py take
# 97 s instead of 139 s on 2 cores. Both sides of every comparison (tapegrad and jax's own
# gradient) run the same code generator; what the tests check is tapegrad's programs, not
# XLA's code generation. XLA aborts on a flag it does not know, and newer ones dropped this
# one (tests/rules/test_check_grads_sweep.py probes it before use), so it is set only on the
# jaxlib this was measured with, and never over a choice already in XLA_FLAGS. It must be
# in the environment before jax starts its backend; subprocess tests inherit it.
if importlib.metadata.version("jaxlib").startswith("0.10.") and (
    "xla_cpu_use_fusion_emitters" not in os.environ.get("XLA_FLAGS", "")
):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_cpu_use_fusion_emitters=false"
    ).strip()

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, settings

import tapegrad as tg

__all__ = [
    "tols",
    "rand",
    "enable_x64",
    "assert_aux_close",
    "assert_grads_match",
    "assert_value_and_grad_match",
    "assert_vjp_match",
    "assert_trees_close",
]

settings.register_profile(
    "ci",
    max_examples=60,
    deadline=None,
    derandomize=True,  # the same examples every run: CI never depends on luck
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
settings.load_profile("ci")

# jax's persistent compilation cache, in a fresh directory for this run and this process
# (one per pytest-xdist worker: jax writes its cache files without a lock when the cache
# has no size limit). Tests compile many identical small programs under new function
# objects (a tape rule's jit per tape, a primitive's after a cache is cleared), which
# jax's in-memory caches miss; reading them back instead of compiling them again saves
# ~12% of tests/loops' time. The same executables run: nothing is compiled differently,
# and nothing carries over from one run to the next.
_JAX_CACHE = tempfile.mkdtemp(prefix="tapegrad-jax-cache-")
atexit.register(shutil.rmtree, _JAX_CACHE, ignore_errors=True)
jax.config.update("jax_compilation_cache_dir", _JAX_CACHE)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


# The quick tier (`pytest -m "not slow"`): the tests listed in slow_tests.txt, chosen by
# tests/_tier.py from a timed run of the whole suite, are marked slow.
_SLOW_LIST = os.path.join(os.path.dirname(os.path.abspath(__file__)), "slow_tests.txt")


def pytest_collection_modifyitems(config, items):
    if not os.path.exists(_SLOW_LIST):
        return
    with open(_SLOW_LIST) as f:
        slow = {line.strip() for line in f if line.strip()}
    for item in items:
        if item.nodeid in slow:
            item.add_marker(pytest.mark.slow)


def pytest_terminal_summary(terminalreporter):
    """Print the ``("summary", text)`` user properties that tests recorded
    (e.g. how many random programs test_hypothesis tried). User properties
    travel back from pytest-xdist workers, unlike a test's own prints."""
    lines = [
        value
        for reports in terminalreporter.stats.values()
        for rep in reports
        for key, value in getattr(rep, "user_properties", ())
        if key == "summary" and getattr(rep, "when", "call") == "call"
    ]
    if lines:
        terminalreporter.section("summary")
        for line in lines:
            terminalreporter.write_line(str(line))


# ---------------------------------------------------------------------------
# Tolerances and inputs


def tols(dtype: Any) -> tuple[float, float]:
    """Default ``(rtol, atol)`` for comparing gradients of this dtype."""
    dt = jnp.dtype(dtype)
    if dt == jnp.float64:
        return 1e-10, 1e-12
    if dt == jnp.float32:
        return 1e-5, 1e-6
    return 2e-2, 2e-2  # bfloat16 / float16: 8 and 11 mantissa bits


def _tree_dtype(tree) -> Any:
    """The least precise float dtype among a pytree's leaves (float32 if none is float)."""
    dts = [jnp.result_type(x) for x in jax.tree_util.tree_leaves(tree)]
    dts = [d for d in dts if jnp.issubdtype(d, jnp.floating)]
    if not dts:
        return jnp.float32
    return max(dts, key=lambda d: tols(d)[0])  # the least precise one sets the bar


def rand(
    shape: Sequence[int] = (),
    dtype: Any = jnp.float32,
    low: float = -1.0,
    high: float = 1.0,
    seed: int = 0,
) -> jax.Array:
    """Deterministic uniform values in ``[low, high)`` (drawn in float64, then cast)."""
    rng = np.random.RandomState(seed)
    return jnp.asarray(rng.uniform(low, high, size=tuple(shape)), dtype=dtype)


@contextlib.contextmanager
def enable_x64(enabled: bool = True):
    """Context manager: ``jax_enable_x64`` set to ``enabled`` inside, restored after."""
    prev = bool(jax.config.jax_enable_x64)
    jax.config.update("jax_enable_x64", enabled)
    try:
        yield
    finally:
        jax.config.update("jax_enable_x64", prev)


@pytest.fixture
def x64():
    """Enable float64 for the duration of one test; restores the previous setting."""
    with enable_x64(True):
        yield


# ---------------------------------------------------------------------------
# Comparisons


def _jax_oracle(g: Callable, *args):
    """jax's answer ``g(*args)``, compiled as one program where ``g`` can be jitted.

    Eager ``jax.grad`` dispatches and compiles every primitive of the forward and the
    backward on its own; one `jax.jit` of the whole transform costs less
    (tests/oracle/test_control.py and test_models.py: 137 -> 119 s on 2 cores). Where
    ``g`` cannot be traced abstractly (Python control flow on values, a shape from an
    argument, aux that is not an array), it runs eagerly, as before, so an error of
    jax's own still surfaces as jax's eager error.
    """
    try:
        return jax.jit(g)(*args)
    except Exception:
        return g(*args)


def assert_trees_close(
    actual, expected, rtol: float | None = None, atol: float | None = None, dtype: Any = None
) -> None:
    """Same tree structure, shapes and dtypes, and values within tolerance."""
    r, a = tols(dtype if dtype is not None else _tree_dtype(expected))
    rtol = r if rtol is None else rtol
    atol = a if atol is None else atol
    chex.assert_trees_all_equal_structs(actual, expected)
    chex.assert_trees_all_equal_shapes_and_dtypes(actual, expected)
    # float0 cotangents (integer inputs) carry no values to compare.
    act = [x for x in jax.tree_util.tree_leaves(actual) if np.asarray(x).dtype != jax.dtypes.float0]
    exp = [
        x for x in jax.tree_util.tree_leaves(expected) if np.asarray(x).dtype != jax.dtypes.float0
    ]
    chex.assert_trees_all_close(act, exp, rtol=rtol, atol=atol)


def assert_aux_close(actual, expected, rtol=None, atol=None, dtype=None) -> None:
    """Aux outputs: same structure and values. A Python scalar in jax's aux may
    come back from tapegrad as a jax scalar type (it passes through the traced
    program), so leaves are compared as numpy arrays."""
    chex.assert_trees_all_equal_structs(actual, expected)
    assert_trees_close(
        jax.tree_util.tree_map(np.asarray, actual),
        jax.tree_util.tree_map(np.asarray, expected),
        rtol,
        atol,
        dtype,
    )


def assert_grads_match(
    f: Callable,
    *args,
    argnums: int | Sequence[int] = 0,
    has_aux: bool = False,
    rtol: float | None = None,
    atol: float | None = None,
    **grad_kwargs,
):
    """Assert ``tg.grad(f, argnums)(*args)`` equals ``jax.grad(f, argnums)(*args)``.

    Tolerances default to `tols` of the least precise float dtype among ``args``.
    Returns tapegrad's gradient (and aux when ``has_aux``).
    """
    got = tg.grad(f, argnums=argnums, has_aux=has_aux, **grad_kwargs)(*args)
    want = _jax_oracle(jax.grad(f, argnums=argnums, has_aux=has_aux, **grad_kwargs), *args)
    dt = _tree_dtype(args)
    if has_aux:
        assert_aux_close(got[1], want[1], rtol, atol, dt)
        assert_trees_close(got[0], want[0], rtol, atol, dt)
    else:
        assert_trees_close(got, want, rtol, atol, dt)
    return got


def assert_value_and_grad_match(
    f: Callable,
    *args,
    argnums: int | Sequence[int] = 0,
    has_aux: bool = False,
    rtol: float | None = None,
    atol: float | None = None,
):
    """`assert_grads_match` for ``value_and_grad``; returns tapegrad's result."""
    got = tg.value_and_grad(f, argnums=argnums, has_aux=has_aux)(*args)
    want = _jax_oracle(jax.value_and_grad(f, argnums=argnums, has_aux=has_aux), *args)
    dt = _tree_dtype(args)
    if has_aux:
        (gv, gaux), gg = got
        (wv, waux), wg = want
        assert_aux_close(gaux, waux, rtol, atol, dt)
        assert_trees_close((gv, gg), (wv, wg), rtol, atol, dt)
    else:
        assert_trees_close(got, want, rtol, atol, dt)
    return got


def tanh_mlp(ws, x):
    """The small model several policy and display tests share: tanh layers, mean square."""
    for w in ws:
        x = jnp.tanh(x @ w)
    return jnp.mean(x**2)


# The memory kinds the default device addresses (a GPU has no ``unpinned_host``).
MEMORY_KINDS = frozenset(m.kind for m in jax.devices()[0].addressable_memories())


def exact_on_cpu(a, b) -> None:
    """``a == b`` bit for bit on a CPU. On a GPU two programs computing the same values
    (the per-record path and one compiled call, say) may round differently (other
    kernels, other fusions), so there within a few ulps."""
    if jax.default_backend() == "cpu":
        chex.assert_trees_all_equal(a, b)
    else:
        chex.assert_trees_all_close(a, b, rtol=1e-5, atol=1e-8)


def live_bytes_by_kind() -> dict[str, int]:
    """Bytes of every live jax array, by memory kind (``device``, ``pinned_host``, ...),
    after a garbage collection: what a test compares memory reports against."""
    gc.collect()
    out: dict[str, int] = {}
    for a in jax.live_arrays():
        k = a.sharding.memory_kind
        out[k] = out.get(k, 0) + a.nbytes
    return out


def held_after_forward(f: Callable, *args: Any) -> int:
    """Bytes of live jax arrays that ``f(*args)`` (returning ``(out, vjp_fn)``, as
    `tg.vjp` does) leaves alive beyond what was alive before and its output: what its
    forward keeps for backward."""
    gc.collect()
    before = sum(a.nbytes for a in jax.live_arrays())
    out, vjp_fn = f(*args)
    gc.collect()
    held = sum(a.nbytes for a in jax.live_arrays()) - before - out.nbytes
    del out, vjp_fn
    return held


def random_like(tree, seed: int = 0):
    """A pytree of standard-normal values with ``tree``'s structure, shapes, dtypes."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    rng = np.random.RandomState(seed)
    out = [jnp.asarray(rng.standard_normal(np.shape(x)), dtype=jnp.result_type(x)) for x in leaves]
    return jax.tree_util.tree_unflatten(treedef, out)


def assert_vjp_match(
    f: Callable,
    *args,
    ct: Any = None,
    seed: int = 0,
    has_aux: bool = False,
    rtol: float | None = None,
    atol: float | None = None,
):
    """Assert ``tg.vjp`` equals ``jax.vjp``: primal outputs and input cotangents.

    The cotangent defaults to random normal values shaped like the output.
    Returns tapegrad's input cotangents.
    """
    got = tg.vjp(f, *args, has_aux=has_aux)
    want = jax.vjp(f, *args, has_aux=has_aux)
    dt = _tree_dtype(args)
    assert_trees_close(got[0], want[0], rtol, atol, dt)
    if has_aux:
        assert_aux_close(got[2], want[2], rtol, atol, dt)
    if ct is None:
        ct = random_like(want[0], seed)
    got_ct, want_ct = got[1](ct), want[1](ct)
    assert_trees_close(got_ct, want_ct, rtol, atol, dt)
    return got_ct


REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_on_8_cpu_devices(code: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """Run ``code`` (dedented) in a fresh interpreter with 8 CPU devices: the XLA flag
    must be set before jax starts, so sharded tests run in a subprocess."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = (
        env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = REPO_ROOT + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=env,
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
