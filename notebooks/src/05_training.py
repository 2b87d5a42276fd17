"""Source of 05_training.ipynb (build with: python notebooks/_build.py)."""

# %% [markdown]
# # Training with tapegrad: optax + equinox
#
# tapegrad's transforms compose with `jax.jit` and `jax.vmap`, so they drop into an ordinary
# JAX training loop. Here: a small equinox MLP fitted to a synthetic regression task with
# optax's Adam, gradients from `jax.jit(tg.value_and_grad(loss, policy=...))` with residuals
# stored in bfloat16; then per-example gradients with `jax.vmap(tg.grad(...))`.

# %%
import chex
import equinox as eqx
import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np
import optax

import tapegrad as tg

# %% [markdown]
# ## Data and model
#
# `y = sin(2 x₀) cos(x₁) + noise` on 256 points of `[-2, 2]²`. equinox models are pytrees
# that mix arrays with static parts (the activation function, layer sizes):
# `eqx.partition` splits them into the arrays we differentiate and the static rest, and
# `eqx.combine` puts them back inside the loss.

# %%
kx, kn, km = jax.random.split(jax.random.PRNGKey(0), 3)
X = jax.random.uniform(kx, (256, 2), minval=-2.0, maxval=2.0)
Y = jnp.sin(2 * X[:, :1]) * jnp.cos(X[:, 1:]) + 0.05 * jax.random.normal(kn, (256, 1))

model = eqx.nn.MLP(2, 1, width_size=32, depth=2, activation=jnp.tanh, key=km)
params, static = eqx.partition(model, eqx.is_array)
print("parameters:", sum(p.size for p in jax.tree_util.tree_leaves(params)))


def loss(params, x, y):
    model = eqx.combine(params, static)
    return jnp.mean((jax.vmap(model)(x) - y) ** 2)


# %% [markdown]
# ## The gradient, and its oracle
#
# Under the default `save()` policy tapegrad's gradient equals `jax.grad`'s; with residuals
# compressed to bfloat16 it is close (bfloat16 keeps 8 bits of mantissa), and the residuals
# beyond the inputs (the parameters and the batch, which the caller holds anyway and the
# policy leaves alone) take half the memory.

# %%
policy = tg.policies.compress(jnp.bfloat16)
value_and_grad = jax.jit(tg.value_and_grad(loss, policy=policy))

l_ref, g_ref = jax.jit(jax.value_and_grad(loss))(params, X, Y)  # the oracle
l_tg, g_tg = jax.jit(tg.value_and_grad(loss))(params, X, Y)
chex.assert_trees_all_close((l_tg, g_tg), (l_ref, g_ref), rtol=1e-5, atol=1e-6)
l_bf, g_bf = value_and_grad(params, X, Y)
chex.assert_trees_all_close(l_bf, l_ref, rtol=1e-6)  # forward is untouched by the policy
chex.assert_trees_all_close(g_bf, g_ref, rtol=5e-2, atol=5e-3)

save_rep = tg.memory_report(loss)(params, X, Y)
bf16_rep = tg.memory_report(loss, policy=policy)(params, X, Y)
print(
    f"held beyond the inputs: save {save_rep.beyond_inputs_bytes:,} B, "
    f"bf16 {bf16_rep.beyond_inputs_bytes:,} B"
)
assert bf16_rep.beyond_inputs_bytes < 0.6 * save_rep.beyond_inputs_bytes

# %% [markdown]
# ## The training loop
#
# A jitted step: tapegrad's value and gradient, then optax's Adam update. 200 full-batch
# steps.

# %%
optimizer = optax.adam(1e-2)


@jax.jit
def step(params, opt_state, x, y):
    value, grads = value_and_grad(params, x, y)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, value


opt_state = optimizer.init(params)
losses = []
for _ in range(200):
    params, opt_state, value = step(params, opt_state, X, Y)
    losses.append(float(value))
print(f"loss: first {losses[0]:.4f}, last {losses[-1]:.4f}")
assert losses[-1] < 0.1 * losses[0]
assert np.isfinite(losses).all()

# %%
trained = eqx.combine(params, static)
fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(11, 3.5))
ax0.semilogy(losses)
ax0.set_xlabel("step")
ax0.set_ylabel("training MSE")
ax0.set_title("Adam, residuals in bfloat16")
order = jnp.argsort(Y[:, 0])
ax1.plot(Y[order, 0], ".", ms=3, label="target")
ax1.plot(jax.vmap(trained)(X)[order, 0], ".", ms=3, label="model")
ax1.set_xlabel("example (sorted by target)")
ax1.legend()
fig.tight_layout()
plt.show()

# %% [markdown]
# ## Per-example gradients
#
# `jax.vmap(tg.grad(...))` maps tapegrad's backward over a batch: one gradient per example,
# with every parameter getting a leading batch axis. Checked against the same with
# `jax.grad`, and against the mean gradient.


# %%
def example_loss(params, x, y):
    model = eqx.combine(params, static)
    return jnp.sum((model(x) - y) ** 2)


per_example = jax.jit(jax.vmap(tg.grad(example_loss), in_axes=(None, 0, 0)))
g_each = per_example(params, X[:32], Y[:32])
g_each_ref = jax.jit(jax.vmap(jax.grad(example_loss), in_axes=(None, 0, 0)))(params, X[:32], Y[:32])
chex.assert_trees_all_close(g_each, g_each_ref, rtol=1e-5, atol=1e-6)

first = jax.tree_util.tree_leaves(g_each)[0]
print("first weight:", jax.tree_util.tree_leaves(params)[0].shape, "-> per example", first.shape)
assert first.shape[0] == 32

# The mean of the per-example gradients is the gradient of the mean loss.
g_mean = jax.jit(jax.grad(loss))(params, X[:32], Y[:32])
chex.assert_trees_all_close(
    jax.tree_util.tree_map(lambda g: g.mean(0), g_each), g_mean, rtol=1e-4, atol=1e-6
)

# %% [markdown]
# Per-example gradient norms show which examples pull hardest on the model:

# %%
norms = jnp.sqrt(
    sum(jnp.sum(g.reshape(32, -1) ** 2, axis=1) for g in jax.tree_util.tree_leaves(g_each))
)
worst = int(jnp.argmax(norms))
print(
    f"largest per-example gradient norm {float(norms[worst]):.3f} at example {worst}, "
    f"residual {float(trained(X[worst])[0] - Y[worst, 0]):+.3f}"
)
