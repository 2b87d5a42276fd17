"""Source of 06_language_model.ipynb (build with: python notebooks/_build.py)."""

# %% [markdown]
# # A character-level language model, seen from its backward pass
#
# A small transformer learns to write Python, trained with optax on text that ships with
# every Python: the standard library's own source files. We train it four ways — residuals
# saved, planned under a byte budget, offloaded to host memory, compressed to 8 bits — and
# look at what each keeps: loss curves (the exact policies' equal jax's), bytes and step time
# per policy, the graph of one block, what plain `jax.vjp` keeps beside what tapegrad keeps,
# and an anomaly log when the learning rate is pushed until training diverges.

# %%
import os
import time
import warnings

import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np
import optax
from IPython.display import display

import tapegrad as tg

P = tg.policies

# %% [markdown]
# ## Text: the standard library's source
#
# Bytes of a few standard-library modules, as integers in `[0, 256)`. Batches are random
# windows of `T + 1` bytes: the model reads the first `T`, predicts the next byte at each.

# %%
stdlib = os.path.dirname(os.__file__)
text = b"".join(
    open(os.path.join(stdlib, name), "rb").read()
    for name in ("textwrap.py", "string.py", "bisect.py", "heapq.py", "fnmatch.py")
)
data = jnp.asarray(np.frombuffer(text, dtype=np.uint8).astype(np.int32))
print(f"{len(text):,} bytes of Python;", repr(text[2000:2080].decode()))

T, B = 64, 16


def batch(key):
    starts = jax.random.randint(key, (B,), 0, len(data) - T - 1)
    windows = jax.vmap(lambda s: jax.lax.dynamic_slice(data, (s,), (T + 1,)))(starts)
    return windows[:, :-1], windows[:, 1:]


# %% [markdown]
# ## The model
#
# Two pre-LN blocks of causal self-attention and a GELU MLP, `d = 64`, four heads; plain
# `jax.numpy` on a dict of arrays.

# %%
D, H, LAYERS, V = 64, 4, 2, 256


def init(key):
    ks = iter(jax.random.split(key, 4 + 6 * LAYERS))

    def dense(m, n):
        return jax.random.normal(next(ks), (m, n)) / np.sqrt(m)

    blocks = [
        {
            "qkv": dense(D, 3 * D),
            "proj": dense(D, D),
            "up": dense(D, 4 * D),
            "down": dense(4 * D, D),
            "g1": jnp.ones(D),
            "g2": jnp.ones(D),
        }
        for _ in range(LAYERS)
    ]
    return {
        "embed": 0.1 * jax.random.normal(next(ks), (V, D)),
        "pos": 0.1 * jax.random.normal(next(ks), (T, D)),
        "blocks": blocks,
        "out": dense(D, V),
    }


def norm(x, g):
    x = x - x.mean(-1, keepdims=True)
    return g * x * jax.lax.rsqrt((x * x).mean(-1, keepdims=True) + 1e-5)


def block(p, x):
    b, t, _ = x.shape
    q, k, v = jnp.split(norm(x, p["g1"]) @ p["qkv"], 3, axis=-1)
    q, k, v = (a.reshape(b, t, H, D // H).transpose(0, 2, 1, 3) for a in (q, k, v))
    s = (q @ k.transpose(0, 1, 3, 2)) / np.sqrt(D // H)
    s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, -1e9)
    a = (jax.nn.softmax(s, axis=-1) @ v).transpose(0, 2, 1, 3).reshape(b, t, D)
    x = x + a @ p["proj"]
    return x + jax.nn.gelu(norm(x, p["g2"]) @ p["up"]) @ p["down"]


def loss(params, xs, ys):
    x = params["embed"][xs] + params["pos"]
    for p in params["blocks"]:
        x = block(p, x)
    logits = x @ params["out"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, ys).mean()


params0 = init(jax.random.PRNGKey(0))
xs, ys = batch(jax.random.PRNGKey(1))
print("parameters:", sum(a.size for a in jax.tree_util.tree_leaves(params0)))
print(f"loss at init {float(loss(params0, xs, ys)):.3f} (ln 256 = {np.log(256):.3f})")

# %% [markdown]
# ## Four policies
#
# `save()` is the default; `budget(bytes=...)` lets the planner choose, per residual,
# among keeping, recomputing and offloading to fit half of `save()`'s residual bytes;
# `offload()` keeps every residual in host memory; `compress(bits=8)` keeps them in 8 bits
# with stochastic rounding. `memory_report` measures each one's residuals from the live
# arrays.

# %%
full = tg.memory_report(loss)(params0, xs, ys).beyond_inputs_bytes
policies = {
    "save": P.save(),
    "budget": P.budget(bytes=full // 2, allow=("save", "recompute", "offload")),
    "offload": P.offload(),
    "compress 8 bits": P.compress(bits=8, key=jax.random.PRNGKey(7)),
}
reports = {
    name: tg.memory_report(loss, policy=pol)(params0, xs, ys) for name, pol in policies.items()
}
for name, rep in reports.items():
    print(
        f"{name:>16}: {rep.beyond_inputs_bytes / 1e6:6.2f} MB beyond the inputs "
        f"({rep.device_bytes / 1e6:.2f} MB device, {rep.host_bytes / 1e6:.2f} MB host)"
    )
assert reports["budget"].device_bytes - reports["budget"].input_bytes <= full // 2 * 1.05
assert reports["compress 8 bits"].beyond_inputs_bytes < full / 2

# %% [markdown]
# ## Training: the exact policies follow jax's loss curve
#
# One jitted step per policy (and one with `jax.value_and_grad` as the oracle), Adam,
# 40 steps on the same batches.

# %%
STEPS = 40
opt = optax.adam(3e-3)


def trainer(value_and_grad):
    @jax.jit
    def step(params, state, key):
        l, g = value_and_grad(params, *batch(key))
        updates, state = opt.update(g, state, params)
        return optax.apply_updates(params, updates), state, l

    return step


def train(step, steps=STEPS):
    params, state, losses = params0, opt.init(params0), []
    step(params, state, jax.random.PRNGKey(0))  # compile
    t0 = time.perf_counter()
    for i in range(steps):
        params, state, l = step(params, state, jax.random.PRNGKey(100 + i))
        losses.append(l)
    jax.block_until_ready(losses)
    return np.array(losses), (time.perf_counter() - t0) / steps


curves, times = {}, {}
curves["jax.grad"], times["jax.grad"] = train(trainer(jax.value_and_grad(loss)))
for name, pol in policies.items():
    curves[name], times[name] = train(trainer(tg.value_and_grad(loss, policy=pol)))

for name in ("save", "budget", "offload"):
    np.testing.assert_allclose(curves[name], curves["jax.grad"], rtol=2e-3, atol=2e-3)
assert abs(curves["compress 8 bits"][-10:].mean() - curves["jax.grad"][-10:].mean()) < 0.1
assert curves["jax.grad"][-10:].mean() < curves["jax.grad"][:5].mean() - 0.5  # it learns

fig, ax = plt.subplots(figsize=(7, 3.5))
for name, c in curves.items():
    ax.plot(c, label=f"{name} ({times[name] * 1e3:.1f} ms/step)", lw=1.2)
ax.set_xlabel("step")
ax.set_ylabel("cross-entropy")
ax.legend()
plt.show()

# %% [markdown]
# ## One block, drawn
#
# `tape.graph()` draws a block's tape: a box per record with your source line and what
# it keeps (bytes, decision), kept values on thick edges. `memory_report(...).graph()`
# draws the same with a policy's decisions — here the budget's.

# %%
x0 = params0["embed"][xs] + params0["pos"]
block_tape = tg.trace(block)(params0["blocks"][0], x0)
g = block_tape.graph()
assert g.nodes <= 150 and "keeps" in g.dot()
display(g)

# %%
block_report = tg.memory_report(block, policy=policies["budget"])(params0["blocks"][0], x0)
display(block_report.graph())

# %% [markdown]
# ## What plain `jax.grad` keeps, beside tapegrad
#
# `tg.jax_residuals` measures what `jax.vjp` itself holds for backward (its `vjp_fn`'s
# arrays), attributed to the line that made each; `compare` lays it beside tapegrad's
# report, row by row.

# %%
jr = tg.jax_residuals(loss)(params0, xs, ys)
_, vjp_fn = jax.vjp(lambda p: loss(p, xs, ys), params0)
held = {id(a): a for a in jax.tree_util.tree_leaves(vjp_fn)}
print(
    f"jax.vjp keeps {jr.beyond_inputs_bytes / 1e6:.2f} MB beyond the inputs; "
    f"tapegrad's save() {reports['save'].beyond_inputs_bytes / 1e6:.2f} MB"
)
assert jr.total_bytes == sum(a.nbytes for a in held.values())  # measured, not estimated
assert reports["save"].beyond_inputs_bytes < jr.beyond_inputs_bytes
display(reports["save"].compare(jr))

# %% [markdown]
# ## When training diverges: where the first non-finite value came from
#
# Push the learning rate until the loss blows up, then replay the first step whose loss
# is not finite under `tg.detect_anomaly(halt=False)`: it runs to the end and logs every
# origin of a NaN or Inf — the record, your source line, what it read.

# %%
hot = optax.sgd(1e4)


@jax.jit
def hot_step(params, key):
    l, g = jax.value_and_grad(loss)(params, *batch(key))
    return optax.apply_updates(params, hot.update(g, hot.init(params))[0]), l


params, bad = params0, None
for i in range(20):
    new, l = hot_step(params, jax.random.PRNGKey(500 + i))
    if not np.isfinite(float(loss(new, *batch(jax.random.PRNGKey(501 + i))))):
        bad = (new, jax.random.PRNGKey(501 + i))
        break
    params = new
assert bad is not None, "the learning rate did not make training diverge"

warnings.filterwarnings("ignore", "tapegrad anomaly detection is enabled")
with tg.detect_anomaly(check_inf=True, halt=False) as log:
    tg.grad(loss)(bad[0], *batch(bad[1]))
display(log)  # every origin, forward and backward, not their copies downstream
assert len(log.events) >= 1
first = log.events[0]
print(first.phase, first.primitive, first.source)
for op in first.operands or ():
    print("   ", op)
