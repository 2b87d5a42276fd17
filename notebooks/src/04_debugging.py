"""Source of 04_debugging.ipynb (build with: python notebooks/_build.py)."""

# %% [markdown]
# # Debugging gradients: `detect_anomaly` and `gradcheck`
#
# Two tools from PyTorch, on the tape:
#
# * `tg.detect_anomaly()` checks every record's output in forward and every VJP rule's
#   result in backward, and raises `tg.AnomalyError` at the **first** NaN, naming the
#   record, the source line that made it, and the records that fed it;
# * `tg.gradcheck` compares tapegrad's reverse-mode Jacobian with central finite
#   differences in float64 — here on a custom `tg.Function`.

# %%
import inspect
import logging
import warnings

import chex
import jax
import jax.numpy as jnp
import numpy as np

import tapegrad as tg

# detect_anomaly warns that it slows things down; we know.
warnings.filterwarnings("ignore", message="tapegrad anomaly detection is enabled")

# %% [markdown]
# ## A NaN in forward
#
# `model` takes a square root of `tanh(x) - 0.5`, negative for most `x`. The loss is NaN,
# and so is the gradient, but neither says where it came from.


# %%
def model(x):
    h = jnp.tanh(x) - 0.5
    s = jnp.sqrt(h)  # NaN where h < 0
    return jnp.sum(s * x)


x = jnp.linspace(-1.0, 1.0, 8)
print("loss", model(x), "| grad", tg.grad(model)(x))

# %%
try:
    with tg.detect_anomaly():
        tg.grad(model)(x)
    raise AssertionError("detect_anomaly should have raised")
except tg.AnomalyError as e:
    err = e
print(err)
assert "'sqrt'" in str(err) and "(model)" in str(err)

# %% [markdown]
# The message names the record (`sqrt`), the cell line of `jnp.sqrt(h)`, and the chain of
# records that fed it (`sub` ← `tanh`). The record is on the tape, so we can look at it:

# %%
tape = tg.trace(model)(x)
bad = next(r for r in tape.records if r.primitive == "sqrt")
print(bad, "\n  at", bad.source)
# It is the line of `jnp.sqrt(h)`, and the error named the same record and line.
lines, start = inspect.getsourcelines(model)
sqrt_line = start + next(i for i, ln in enumerate(lines) if "jnp.sqrt" in ln)
assert bad.source.endswith(f":{sqrt_line} (model)")
assert f"record #{bad.index}" in str(err) and bad.source in str(err)

# %% [markdown]
# ## A NaN only in backward: the `jnp.where` trap
#
# `jnp.where(x > 0, jnp.sqrt(x), 0.0)` has a finite value everywhere, yet its gradient at
# `x <= 0` is NaN: the discarded branch's derivative (`0.5 / sqrt(x)`: inf or NaN) is
# multiplied by a zero cotangent, and `0 * inf = NaN`. `jax.grad` gives the same NaNs.


# %%
def safe_sqrt_sum(x):
    return jnp.sum(jnp.where(x > 0, jnp.sqrt(x), 0.0))


x2 = jnp.array([0.0, -1.0, 4.0])
print(
    "value",
    safe_sqrt_sum(x2),
    "| tg.grad",
    tg.grad(safe_sqrt_sum)(x2),
    "| jax.grad",
    jax.grad(safe_sqrt_sum)(x2),
)
assert np.isnan(np.asarray(jax.grad(safe_sqrt_sum)(x2))[:2]).all()

# %% [markdown]
# Checking forward would stop at the NaN the `where` discards on purpose; `forward=False`
# checks backward only, and finds the VJP rule that returns the NaN:

# %%
try:
    with tg.detect_anomaly(forward=False):
        tg.grad(safe_sqrt_sum)(x2)
    raise AssertionError("detect_anomaly should have raised")
except tg.AnomalyError as e:
    err = e
print(err)
assert "backward of 'sqrt'" in str(err)

# %% [markdown]
# The fix the message suggests: guard the argument, not only the result. Now the gradient is
# finite and matches jax's on the same function.


# %%
def safer_sqrt_sum(x):
    ok = x > 0
    return jnp.sum(jnp.where(ok, jnp.sqrt(jnp.where(ok, x, 1.0)), 0.0))


with tg.detect_anomaly():
    g = tg.grad(safer_sqrt_sum)(x2)
print(g)
chex.assert_trees_all_close(g, jax.grad(safer_sqrt_sum)(x2))
assert np.isfinite(np.asarray(g)).all()

# %% [markdown]
# Under `jax.jit` the checks are compiled in and report from a host callback when the
# program runs; jax wraps the error in its runtime error, whose message carries ours. (jax
# also logs the failed callback's traceback; its logger is silenced here to keep this short.)

# %%
logging.getLogger("jax._src.callback").setLevel(logging.CRITICAL)
try:
    jax.jit(tg.grad(safe_sqrt_sum, anomaly=tg.AnomalyMode(forward=False)))(x2)
    raise AssertionError("the jitted check should have raised")
except Exception as e:  # jax.errors.JaxRuntimeError around tg.AnomalyError
    kind, msg = type(e).__name__, str(e)
print(kind, "...", msg[msg.find("backward of") :][:300])
assert "backward of 'sqrt'" in msg

# %% [markdown]
# ## `gradcheck` on a custom `tg.Function`
#
# A numerically stable softplus, `log(1 + e^x)`, with a hand-written backward. `tg.Function`
# follows `torch.autograd.Function`: `ctx.save_for_backward` sends the residual through the
# active residual policy, and `apply` is built on `jax.custom_vjp`.


# %%
class Softplus(tg.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return jnp.logaddexp(x, 0.0)

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g * jax.nn.sigmoid(x)


class BuggySoftplus(Softplus):
    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g * jax.nn.sigmoid(-x)  # wrong sign


# %% [markdown]
# `gradcheck` wants float64 inputs: a central difference in float32 has rounding error
# ~1.2e-7 / eps, far above any useful tolerance. float64 *numpy* inputs are enough: the check
# turns `jax_enable_x64` on for its own duration only.

# %%
xs = np.random.default_rng(0).normal(size=(6,))  # float64
assert tg.gradcheck(Softplus.apply, (xs,))
assert tg.gradgradcheck(Softplus.apply, (xs,))  # backward is jax code: differentiable again
assert not jax.config.jax_enable_x64  # the caller's setting is untouched
print("Softplus passes gradcheck and gradgradcheck")

# %%
try:
    tg.gradcheck(BuggySoftplus.apply, (xs,))
    raise AssertionError("gradcheck should have caught the wrong sign")
except tg.GradcheckError as e:
    err = e
print(str(err).split("analytical Jacobian")[0])
assert not tg.gradcheck(BuggySoftplus.apply, (xs,), raise_exception=False)

# %% [markdown]
# Passing float32 is refused, with the reason (`allow_low_precision=True` casts instead):

# %%
try:
    tg.gradcheck(Softplus.apply, (xs.astype(np.float32),))
    raise AssertionError("float32 inputs should be refused")
except tg.DtypeError as e:
    print(e)
assert tg.gradcheck(Softplus.apply, (xs.astype(np.float32),), allow_low_precision=True)

# %% [markdown]
# The Function works under `tg.grad`, `jax.grad`, `jax.jit` and `jax.vmap`, and its saved
# residual is on the tape: `memory_report` shows it under the Function's name.

# %%
xf = jnp.asarray(xs, jnp.float32)
f = lambda x: jnp.sum(Softplus.apply(x) ** 2)  # noqa: E731
ref = jax.grad(lambda x: jnp.sum(jax.nn.softplus(x) ** 2))(xf)
for g in (tg.grad(f)(xf), jax.grad(f)(xf), jax.jit(tg.grad(f))(xf)):
    chex.assert_trees_all_close(g, ref, rtol=1e-5, atol=1e-6)
per_row = jax.vmap(tg.grad(f))(jnp.stack([xf, -xf]))
chex.assert_trees_all_close(per_row[1], jax.grad(f)(-xf), rtol=1e-5, atol=1e-6)

rep = tg.memory_report(f)(xf)
print(rep)
assert any(r.primitive == "Softplus" for r in rep.records)
