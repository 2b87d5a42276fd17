"""Source of 02_residual_policies.ipynb (build with: python notebooks/_build.py)."""

# %% [markdown]
# # Residual policies: save, offload, compress, hooks
#
# Every value a record keeps for backward goes through the active **residual policy**:
# `pack(value, info)` in forward, `unpack(packed, info)` in backward. This notebook runs one
# pre-LN transformer block under each built-in policy, compares their gradients with
# `jax.grad` and their memory with `tg.memory_report`, and writes a custom policy that
# profiles residual bytes by primitive.

# %%
import collections
import json
import pathlib
import re

import chex
import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np
from IPython.display import display

import tapegrad as tg

P = tg.policies

# %% [markdown]
# ## A small transformer block
#
# Pre-LN attention + MLP, batch 2, 16 tokens, width 64, 4 heads (the same block as
# `bench/_models.py`, smaller).

# %%
HEADS = 4


def layernorm(x, g, b, eps=1e-5):
    mu = jnp.mean(x, -1, keepdims=True)
    var = jnp.mean((x - mu) ** 2, -1, keepdims=True)
    return (x - mu) * jax.lax.rsqrt(var + eps) * g + b


def block(p, x):
    b, t, d = x.shape
    h = layernorm(x, *p["ln1"])
    q, k, v = jnp.split(h @ p["wqkv"], 3, axis=-1)
    q, k, v = (a.reshape(b, t, HEADS, d // HEADS).transpose(0, 2, 1, 3) for a in (q, k, v))
    att = jax.nn.softmax(q @ k.transpose(0, 1, 3, 2) / jnp.sqrt(d // HEADS), axis=-1)
    o = (att @ v).transpose(0, 2, 1, 3).reshape(b, t, d)
    x = x + o @ p["wo"]
    h = layernorm(x, *p["ln2"])
    return x + jax.nn.gelu(h @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"]


def loss(p, x):
    return jnp.mean(block(p, x) ** 2)


d, ff = 64, 256
ks = jax.random.split(jax.random.PRNGKey(0), 5)
params = {
    "ln1": (jnp.ones(d), jnp.zeros(d)),
    "ln2": (jnp.ones(d), jnp.zeros(d)),
    "wqkv": jax.random.normal(ks[0], (d, 3 * d)) / np.sqrt(d),
    "wo": jax.random.normal(ks[1], (d, d)) / np.sqrt(d),
    "w1": jax.random.normal(ks[2], (d, ff)) / np.sqrt(d),
    "b1": jnp.zeros(ff),
    "w2": jax.random.normal(ks[3], (ff, d)) / np.sqrt(ff),
    "b2": jnp.zeros(d),
}
x = jax.random.normal(ks[4], (2, 16, d))
g_ref = jax.jit(jax.grad(loss))(params, x)  # the oracle (jitted: one compile, not one per op)

# %% [markdown]
# ## Four policies, one block
#
# * `save()` — the default: keep residuals on device as they are;
# * `offload()` — move them to pinned host memory in forward, back in backward (on CPU the
#   arrays really change memory kind; the saving shows on an accelerator);
# * `compress(jnp.bfloat16)` — store floating residuals as bfloat16;
# * `compress("int8")` — int8 with one scale per block of 16 values (a 1-byte code each).
#
# None of them touches the function's own inputs (`params`, `x`): the caller holds those
# anyway, so a moved or compressed copy would add memory, not save it (`inputs=True` opts in).
# "beyond in" is what backward holds beyond them, the report's headline.
#
# The gradient error is relative to the largest entry of each gradient, worst over leaves.

# %%
policies = {
    "save": P.save(),
    "offload": P.offload(),
    "bf16": P.compress(jnp.bfloat16),
    "int8": P.compress("int8"),
}


def rel_error(g, ref):
    return max(
        float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b)))
        for a, b in zip(jax.tree_util.tree_leaves(g), jax.tree_util.tree_leaves(ref))
    )


grads, reports = {}, {}
for name, policy in policies.items():
    grads[name] = tg.grad(loss, policy=policy)(params, x)
    reports[name] = tg.memory_report(loss, policy=policy)(params, x)

print(
    f"{'policy':<8} {'grad rel. err':>13} {'beyond in':>10} {'device B':>10} {'host B':>10} "
    f"{'peak B':>10}"
)
for name, rep in reports.items():
    print(
        f"{name:<8} {rel_error(grads[name], g_ref):>13.2e} {rep.beyond_inputs_bytes:>10,} "
        f"{rep.device_bytes:>10,} {rep.host_bytes:>10,} {rep.peak_bytes:>10,}"
    )

# %% [markdown]
# What these numbers must be, checked:

# %%
save, off, bf16, int8 = (reports[k] for k in ("save", "offload", "bf16", "int8"))
# save and offload keep the values exactly; bf16 has ~8 bits of mantissa, int8 ~7.
chex.assert_trees_all_close(grads["save"], g_ref, rtol=1e-5, atol=1e-6)
chex.assert_trees_all_close(grads["offload"], g_ref, rtol=1e-5, atol=1e-6)
assert rel_error(grads["bf16"], g_ref) < 2e-2
assert rel_error(grads["int8"], g_ref) < 1e-1
# Beyond the inputs (which stay as they are): offload moves every byte to the host; bf16
# halves them; int8 quarters them (plus its scales). save and offload also rebuild a few
# cheap values in backward (the layer norms' scaled outputs) from values they keep; a
# compressing policy keeps those too, since rebuilt from rounded operands they would come
# back rounded (docs/concepts.md), and rebuilds only what it builds from unchanged values
# (here a layer norm scale's broadcast, from the input): it halves (quarters) what it keeps.
assert off.host_bytes == save.beyond_inputs_bytes and off.device_bytes == off.input_bytes
kept = bf16.tape.saved_bytes - bf16.input_bytes  # every value but that broadcast
assert [r.primitive for r in bf16.tape.records if r.decision == "recompute"] == ["broadcast_in_dim"]
assert save.beyond_inputs_bytes < kept
assert bf16.beyond_inputs_bytes == kept // 2
assert kept / 4 < int8.beyond_inputs_bytes < 0.3 * kept
# (save and offload also count the inputs a rebuild reads: the layer norms' scales)
assert off.input_bytes == save.input_bytes >= bf16.input_bytes == int8.input_bytes

# %% [markdown]
# A report renders as a table in Jupyter (`MemoryReport._repr_html_`): the bytes each record
# keeps, where they live, how many are stored in another dtype.

# %%
display(reports["int8"])

# %% [markdown]
# ## Timelines side by side
#
# `MemoryReport.plot(ax=...)` draws the live residual bytes after each record: rising
# through forward, falling through backward (the dashed line is the turn). Under `offload`
# the *device* copies come back only while backward needs them (on an accelerator the host
# bytes are not device memory; this CPU counts both).

# %%
fig, axes = plt.subplots(1, len(reports), figsize=(16, 3.2), sharey=True)
for ax, (name, rep) in zip(axes, reports.items()):
    rep.plot(ax=ax)
    ax.set_title(f"{name}: peak {rep.peak_bytes / 1024:.0f} KiB")
fig.tight_layout()
plt.show()

# %% [markdown]
# ## Routing: a policy per residual
#
# `route(fn)` calls `fn(info)` for each residual and uses the policy it returns. Here: offload
# what is at least 8 KiB, keep the small ones (layer-norm statistics, scales) on device.


# %%
def big_to_host(info):
    return P.offload() if info.nbytes >= 8 << 10 else P.save()


routed = tg.memory_report(loss, policy=P.route(big_to_host))(params, x)
print(f"device {routed.device_bytes:,} B, host {routed.host_bytes:,} B")
# every value the tape keeps (route may hand a value to a lossy policy: nothing is rebuilt)
assert routed.device_bytes + routed.host_bytes == routed.tape.saved_bytes
# device: the inputs (kept as they are) and the small residuals
assert 0 < routed.device_bytes - routed.input_bytes < routed.host_bytes
chex.assert_trees_all_close(
    tg.grad(loss, policy=P.route(big_to_host))(params, x), g_ref, rtol=1e-5, atol=1e-6
)

# %% [markdown]
# ## A custom policy: profile residual bytes by primitive
#
# Any object with `pack(value, info)` and `unpack(packed, info)` is a policy. `info` is a
# `tg.ResidualInfo`: the record, which value (`in0`, `out0`, ...), shape, dtype, bytes, source
# line. This one changes nothing; it counts what passes through. With `inputs = True` it is
# given the function's own inputs too (a policy without it never sees them); with
# `exact = True` it says it gives back every value unchanged, so backward may rebuild cheap
# values from the ones it keeps, as under `save()` (a policy that does not say so is
# assumed to change values, and only values built from inputs it is not given are
# rebuilt).


# %%
class ProfileBytes:
    inputs = True
    exact = True

    def __init__(self):
        self.by_primitive = collections.Counter()
        self.by_line = collections.Counter()
        self.unpacked = 0

    def pack(self, value, info):
        self.by_primitive[info.primitive] += info.nbytes
        self.by_line[info.source.rsplit("/", 1)[-1]] += info.nbytes
        return value

    def unpack(self, packed, info):
        self.unpacked += 1
        return packed


prof = ProfileBytes()
with tg.residual_policy(prof):
    g_prof = tg.grad(loss)(params, x)

total = sum(prof.by_primitive.values())
for prim, nbytes in prof.by_primitive.most_common():
    print(f"{prim:<14} {nbytes:>9,} B  {nbytes / total:6.1%}")
print(f"{'total':<14} {total:>9,} B")

# Each distinct value is packed once (a value two records save counts once), so the
# profile adds up to the tape's residual bytes and to memory_report's.
assert total == tg.trace(loss, argnums=0)(params, x).saved_bytes == save.residual_bytes
n_distinct = len(tg.trace(loss, argnums=0)(params, x).residual_vars())
assert prof.unpacked == n_distinct  # each residual is unpacked once per backward
chex.assert_trees_all_close(g_prof, g_ref, rtol=1e-5, atol=1e-6)

# %% [markdown]
# ## PyTorch's `saved_tensors_hooks`
#
# The same idea with two plain callables, as in PyTorch: `pack(array) -> anything`,
# `unpack(anything) -> array` (no `info`; use a policy object for that, as above). Residuals
# packed inside the scope are unpacked by the same hooks, even when `vjp_fn` runs after the
# scope closed.

# %%
packed_sizes, unpacked_sizes = [], []


def pack_hook(a):
    packed_sizes.append(a.nbytes)
    return np.asarray(a)  # e.g. hand the residual to host numpy (eager only)


def unpack_hook(a):
    unpacked_sizes.append(a.nbytes)
    return jnp.asarray(a)


with tg.saved_tensors_hooks(pack_hook, unpack_hook):
    out, vjp_fn = tg.vjp(loss, params, x)
assert not unpacked_sizes  # nothing is unpacked before backward
g_hooks, _ = vjp_fn(jnp.ones_like(out))
print(
    f"{len(packed_sizes)} residuals packed ({sum(packed_sizes):,} B), "
    f"{len(unpacked_sizes)} unpacked"
)
assert sorted(packed_sizes) == sorted(unpacked_sizes)
# tg.vjp differentiates every input (x too), so a few more values are kept than under grad;
# hooks may change values, so nothing is rebuilt from kept ones (as under any such policy)
any_hooks = P.hooks(lambda v: v, lambda v: v)
assert sum(packed_sizes) == tg.trace(loss, policy=any_hooks)(params, x).saved_bytes
chex.assert_trees_all_close(g_hooks, g_ref, rtol=1e-5, atol=1e-6)

# %% [markdown]
# ## Under `jax.jit`
#
# Policies are traced like any jax code: `pack`/`unpack` run once, at trace time, and the
# compiled program carries the casts (or the `device_put`s to host memory).

# %%
jit_grad = jax.jit(tg.grad(loss, policy=P.compress("int8")))
chex.assert_trees_all_close(jit_grad(params, x), grads["int8"], rtol=1e-4, atol=1e-6)
hlo = jit_grad.lower(params, x).as_text()
n_i8 = len(re.findall(r"tensor<[0-9x]*xi8>", hlo))
print(f"the jitted program mentions int8 tensors {n_i8} times")
assert n_i8 > 0

# %% [markdown]
# ## Fewer bits, same accuracy? Training on real data
#
# `bench/accuracy_study.py` trains an MLP and a small CNN on scikit-learn's `load_digits`
# (1,797 8x8 images) with optax Adam (learning rate on a cosine decay to 0 by default)
# under each policy and several seeds, and writes the activation bytes held (from
# `tg.memory_report`), the test accuracy and every loss curve to
# `bench/accuracy_study.json`. Low-bit `compress(bits=...)` rounds stochastically with a
# fresh key each step; `auto` is `compress(bits="auto", budget_bits=3.0)`, its widths
# fitted on each run's first batch. The plot reads that file (re-run the script to
# refresh it).

# %%
root = pathlib.Path.cwd()
while not (root / "bench").is_dir() and root != root.parent:
    root = root.parent
study = json.loads((root / "bench" / "accuracy_study.json").read_text())
runs = study["runs"]
# policies the file has, fewest bits last (files from before `auto` lack it)
order = [
    p for p in ["save", "bf16", "int8", "4-bit", "auto", "2-bit"] if p in study["args"]["policies"]
]
fig, axes = plt.subplots(2, 2, figsize=(11, 7))
for model, ax, cax in zip(["mlp", "cnn"], axes[0], axes[1]):
    for policy in order:
        curves = [r["curve"] for r in runs if r["model"] == model and r["policy"] == policy]
        steps = 10 * np.arange(len(curves[0]))
        cax.plot(steps, np.mean(curves, 0), label=policy)
    cax.set(yscale="log", xlabel="Adam step", ylabel="training loss (mean of seeds)")
    cax.legend()
    for policy in order:
        rs = [r for r in runs if r["model"] == model and r["policy"] == policy]
        accs = [100 * r["test_accuracy"] for r in rs]
        ax.errorbar(
            rs[0]["held_bytes"] / 1024,
            np.mean(accs),
            yerr=np.std(accs),
            fmt="o",
            capsize=3,
            label=policy,
        )
        # every seed of a policy holds the same bytes: the sizes depend on shapes only
        # (and, for auto, on the widths each run fits: in this file the same bytes)
        assert len({r["held_bytes"] for r in rs}) == 1
    ax.set_xscale("log")
    ax.set(
        title=f"{model}: {study['args']['steps']} Adam steps "
        f"({study['args'].get('schedule', 'constant')} lr), mean ± sd of "
        f"{study['args']['seeds']} seeds",
        xlabel="activation KiB held for backward",
        ylabel="test accuracy (%)",
    )
    ax.legend()
    held = {
        p: next(r["held_bytes"] for r in runs if r["model"] == model and r["policy"] == p)
        for p in order
    }
    # fewer bits, fewer bytes, in this order
    assert [held[p] for p in order] == sorted(held.values(), reverse=True), held
plt.tight_layout()
plt.show()
