"""Source of 03_checkpointing.ipynb (build with: python notebooks/_build.py)."""

# %% [markdown]
# # Recompute instead of save: checkpointing
#
# A residual does not have to be kept: backward can recompute it from values that were.
# tapegrad inlines checkpointed calls into the tape, marks every record `save` or
# `recompute`, and groups the recomputed records into *segments* that backward re-runs
# once, at the first use of their values.
#
# This notebook: `tg.checkpoint`, `tg.checkpoint_sequential`, selective checkpointing with
# `tg.CheckpointPolicy`, the budget planner's memory–recompute trade-off as a plot, and what
# a `lax.scan` keeps under `save()`, `offload()` and `scan_checkpoint("sqrt")`.

# %%
import gc

import chex
import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np
from jax import lax

import tapegrad as tg

CP = tg.CheckpointPolicy

# %% [markdown]
# ## The model
#
# Eight residual layers `h + gelu(h @ w)`, width 64, batch 32. The residual stream is
# tagged with `tg.name` (jax's `checkpoint_name`) so that policies can refer to it.


# %%
def layer(w, h):
    return tg.name(h + jax.nn.gelu(h @ w), "resid")


def loss(ws, x):
    h = x
    for w in ws:
        h = layer(w, h)
    return jnp.mean(h**2)


ks = jax.random.split(jax.random.PRNGKey(0), 9)
ws = [jax.random.normal(k, (64, 64)) / 8 for k in ks[:8]]
x = jax.random.normal(ks[8], (32, 64))
g_ref = jax.jit(jax.grad(loss))(ws, x)  # the oracle for every variant below
# float32, eight layers deep, jitted oracle vs eager tapegrad: roundoff differs by ~1e-6.
TOL = dict(rtol=1e-4, atol=1e-5)


def activation_peak(rep):
    """Peak live residual bytes that are not the inputs (those are alive anyway)."""
    return rep.peak_bytes - rep.input_bytes


def recompute_flops(tape):
    """Flops backward spends re-running segments: 2·M·N·K per matmul, one per element otherwise."""
    total = 0
    for seg in tape.segments:
        for i in seg.records:
            rec = tape.records[i]
            out = sum(int(np.prod(o.shape)) for o in rec.outputs)
            if rec.primitive == "dot_general":
                (contract, _), _ = rec.params["dimension_numbers"]
                out *= 2 * int(np.prod([rec.inputs[0].shape[d] for d in contract]))
            total += out
    return total


base = tg.memory_report(loss)(ws, x)
print(f"save everything: activation peak {activation_peak(base):,} B")

# %% [markdown]
# ## `tg.checkpoint`: recompute a function's insides
#
# `tg.checkpoint` is `jax.checkpoint`, so the same code also runs under `jax.grad`. Each
# layer's insides are recomputed; only the layer inputs are kept.


# %%
def loss_ckpt(ws, x):
    h = x
    for w in ws:
        h = tg.checkpoint(layer)(w, h)
    return jnp.mean(h**2)


chex.assert_trees_all_close(tg.grad(loss_ckpt)(ws, x), g_ref, **TOL)
chex.assert_trees_all_close(jax.grad(loss_ckpt)(ws, x), g_ref, **TOL)
ckpt = tg.memory_report(loss_ckpt)(ws, x)
tape = ckpt.tape
n_rec = sum(r.decision == "recompute" for r in tape.records)
print(f"{n_rec} of {len(tape)} records recomputed, in {len(tape.segments)} segments")
print(
    f"activation peak {activation_peak(ckpt):,} B (was {activation_peak(base):,} B); "
    f"recompute {recompute_flops(tape):,} flops"
)
assert activation_peak(ckpt) < activation_peak(base) / 2
assert len(tape.segments) >= len(ws) - 1

# %% [markdown]
# In the tape, the recomputed records say so, and each segment lists what it is recomputed
# from (its saved inputs) and what it provides to backward:

# %%
seg = tape.segments[0]
print("segment 0: records", seg.records)
print("  recomputed from", [f"{v}:{v.aval}" for v in seg.inputs])
print("  provides", [f"{v}:{v.aval}" for v in seg.outputs])
print("\n".join(str(tape.records[i]) for i in seg.records[:4]))

# %% [markdown]
# ## `tg.checkpoint_sequential`
#
# PyTorch's helper: split a list of functions into `segments` chunks and checkpoint all but
# the last. `"sqrt"` picks √n chunks, the classic memory/recompute balance.


# %%
def loss_seq(ws, x):
    fns = [lambda h, w=w: layer(w, h) for w in ws]
    return jnp.mean(tg.checkpoint_sequential(fns, "sqrt", x) ** 2)


chex.assert_trees_all_close(tg.grad(loss_seq)(ws, x), g_ref, **TOL)
seq = tg.memory_report(loss_seq)(ws, x)
print(
    f"activation peak {activation_peak(seq):,} B, {len(seq.tape.segments)} segments, "
    f"recompute {recompute_flops(seq.tape):,} flops"
)
assert activation_peak(ckpt) <= activation_peak(seq) < activation_peak(base)

# %% [markdown]
# ## Selective checkpointing
#
# `tg.selective(fn)` asks `fn(record)` for each record: `ALWAYS` / `NEVER` save (binding),
# or `PREFER_SAVE` / `PREFER_RECOMPUTE` (hints a budget planner may override). Saving the
# matmul outputs and the residual stream and recomputing the cheap elementwise GELU is
# jax's `dots_saveable` idea; saving only the residual stream is per-layer checkpointing.


# %%
def dots_and_resid(rec):
    return CP.ALWAYS if rec.primitive == "dot_general" or "resid" in rec.names else CP.NEVER


def prefer_dots_and_resid(rec):
    keep = rec.primitive == "dot_general" or "resid" in rec.names
    return CP.PREFER_SAVE if keep else CP.PREFER_RECOMPUTE


def resid_only(rec):
    return CP.ALWAYS if "resid" in rec.names else CP.NEVER


sel = {}
for fn in (dots_and_resid, prefer_dots_and_resid, resid_only):
    policy = tg.selective(fn)
    chex.assert_trees_all_close(tg.grad(loss, policy=policy)(ws, x), g_ref, **TOL)
    sel[fn.__name__] = rep = tg.memory_report(loss, policy=policy)(ws, x)
    print(
        f"{fn.__name__:<22} activation peak {activation_peak(rep):>8,} B, "
        f"recompute {recompute_flops(rep.tape):>10,} flops"
    )

# Without a budget, PREFER_x means x: the same plan as the binding version.
assert activation_peak(sel["prefer_dots_and_resid"]) == activation_peak(sel["dots_and_resid"])
assert (
    activation_peak(sel["resid_only"])
    < activation_peak(sel["dots_and_resid"])
    < activation_peak(base)
)
assert recompute_flops(sel["dots_and_resid"].tape) < recompute_flops(sel["resid_only"].tape)

# %% [markdown]
# ## The budget planner
#
# `tg.policies.budget(bytes=B)` chooses save or recompute per record so that the activation
# peak stays under `B`, at the least recompute cost it finds. With a selective `base`,
# `ALWAYS`/`NEVER` bind and `PREFER_*` are hints: below the hints' peak, the planner may
# recompute a `PREFER_SAVE` matmul, but never an `ALWAYS` one.

# %%
tight = (activation_peak(sel["dots_and_resid"]) + activation_peak(sel["resid_only"])) // 2
prefer = tg.memory_report(
    loss, policy=tg.policies.budget(bytes=tight, base=tg.selective(prefer_dots_and_resid))
)(ws, x)
print(f"budget {tight:,} B with PREFER_* hints: peak {activation_peak(prefer):,} B")
assert activation_peak(prefer) <= tight
try:
    always = tg.policies.budget(bytes=tight, base=tg.selective(dots_and_resid))
    tg.memory_report(loss, policy=always)(ws, x)
    raise AssertionError("ALWAYS-saved matmuls cannot fit this budget")
except tg.policies.BudgetError as e:
    print("with ALWAYS: BudgetError:", str(e).split(";")[0])

# %% [markdown]
# ## The memory–recompute curve
#
# Sweep the budget from a third of the full activation peak up to all of it. Each point is
# a plan the planner chose, measured by `memory_report` (the peak) and by the tape's
# recomputed segments (the flops). Budgets no plan fits raise `BudgetError`.

# %%
full = activation_peak(base)
budgets = np.linspace(full / 3, full, 12).astype(int)
curve, infeasible = [], []
for b in budgets:
    policy = tg.policies.budget(bytes=int(b))
    try:
        rep = tg.memory_report(loss, policy=policy)(ws, x)
    except tg.policies.BudgetError:
        infeasible.append(int(b))
        continue
    curve.append((int(b), activation_peak(rep), recompute_flops(rep.tape)))
    assert activation_peak(rep) <= b  # the plan keeps its promise, measured independently

for b, peak, flops in curve:
    print(f"budget {b:>8,} B -> peak {peak:>8,} B, recompute {flops:>10,} flops")
print("no plan for budgets", infeasible)
# the full budget recomputes only what backward always rebuilds (cheap ops whose operands
# it keeps anyway: the layer norm's scaled output, `docs/concepts.md`)
assert curve[-1][2] == recompute_flops(base.tape)
assert len(curve) >= 4 and curve[0][2] > curve[-1][2]

# The gradients stay exact at the tightest feasible budget.
tightest = tg.policies.budget(bytes=curve[0][0])
chex.assert_trees_all_close(tg.grad(loss, policy=tightest)(ws, x), g_ref, **TOL)

# %%
fig, ax = plt.subplots(figsize=(6, 4))
peaks = [p / 1024 for _, p, _ in curve]
flops = [f / 1e6 for _, _, f in curve]
ax.plot(peaks, flops, "o-", label="budget planner")
named = {"checkpoint per layer": ckpt, "checkpoint_sequential": seq, **sel}
for label, rep in named.items():
    ax.plot(activation_peak(rep) / 1024, recompute_flops(rep.tape) / 1e6, "x", ms=9, label=label)
ax.set_xlabel("activation peak (KiB)")
ax.set_ylabel("recomputed MFLOP in backward")
ax.set_title("memory vs recompute, 8 residual GELU layers")
ax.legend(fontsize=8)
plt.show()

# %% [markdown]
# ## Loops: what a scan keeps
#
# An RNN `h = tanh(h @ w + x @ u)` as a `lax.scan` over T=200 steps (batch 8, width 32).
# The scan is one record on the tape, its body a tape of its own, run ×200. Look at the
# `saves/step` of the body records and at the byte count under the body: a step keeps only
# its carry `h` (1 KiB), because the `tanh` output *is* the next step's carry (stacked
# once), and `w`, `u` and the slices of `xs` are the scan record's own saves, kept once.

# %%
T, B, D = 200, 8, 32
kw, ku, kx = jax.random.split(jax.random.PRNGKey(1), 3)
w = jax.random.normal(kw, (D, D)) / D**0.5
u = jax.random.normal(ku, (D, D)) / D**0.5
xs = jax.random.normal(kx, (T, B, D))
h0 = jnp.zeros((B, D))
rnn_args, RNN_ARGNUMS = (w, u, xs, h0), (0, 1, 2, 3)  # differentiate all four


def rnn(w, u, xs, h0):
    def step(h, x):
        return jnp.tanh(h @ w + x @ u), None

    h, _ = lax.scan(step, h0, xs)
    return jnp.mean(h**2)


print(tg.trace(rnn)(*rnn_args))

# %% [markdown]
# Three policies on the same scan, each report checked against what is really alive: the
# arrays `tg.vjp` leaves alive after forward beyond the inputs, read from
# `jax.live_arrays()` and split by memory kind (`jax.vjp` for scale). The inputs (about
# 209 KiB, mostly `xs`) count in a report (`rep.input_bytes`) but are alive anyway, so the
# comparisons leave them out. Each policy's gradients are checked against `jax.grad`.


# %%
def live_growth(fn):
    """Bytes of the arrays fn() leaves alive, by memory kind (measured, not estimated)."""
    gc.collect()
    before = {id(a) for a in jax.live_arrays()}
    out = fn()
    gc.collect()
    grown = {"device": 0, "host": 0}
    for a in jax.live_arrays():
        if id(a) not in before:
            grown["host" if "host" in (a.sharding.memory_kind or "") else "device"] += a.nbytes
    return grown, out


g_rnn = jax.grad(rnn, argnums=RNN_ARGNUMS)(*rnn_args)
jax_live, _ = live_growth(lambda: jax.vjp(rnn, *rnn_args))
loop_policies = {
    "save()": tg.policies.save(),
    "offload()": tg.policies.offload(),
    'scan_checkpoint("sqrt")': tg.policies.scan_checkpoint("sqrt"),
}
loop_reps, loop_live = {}, {}
for name, policy in loop_policies.items():
    rep = tg.memory_report(rnn, argnums=RNN_ARGNUMS, policy=policy)(*rnn_args)
    live, (_, vjp_fn) = live_growth(lambda: tg.vjp(rnn, *rnn_args, policy=policy))
    loop_reps[name], loop_live[name] = rep, live
    for g, ref in zip(vjp_fn(jnp.float32(1.0)), g_rnn):
        np.testing.assert_allclose(g, ref, rtol=2e-5, atol=1e-6)
    print(
        f"{name:<23} report: device {rep.device_bytes:>7,} B, host {rep.host_bytes:>7,} B "
        f"(inputs {rep.input_bytes:>7,} B), peak {rep.peak_bytes:>7,} B | "
        f"alive: device {live['device']:>7,} B, host {live['host']:>7,} B"
    )
print(f"{'jax.vjp':<23} alive: device {jax_live['device']:,} B")

save_rep, off_rep, ckpt_rep = loop_reps.values()
# save(): the report's bytes beyond the inputs are the bytes tg.vjp keeps alive
save_live = loop_live["save()"]["device"]
assert abs(save_rep.device_bytes - save_rep.input_bytes - save_live) < 256
# offload(): next to nothing on device beyond the inputs, every step's activation on host
assert off_rep.device_bytes - off_rep.input_bytes <= 0.1 * jax_live["device"]
assert loop_live["offload()"]["device"] <= 0.1 * jax_live["device"]
assert min(off_rep.host_bytes, loop_live["offload()"]["host"]) >= T * B * D * 4
# scan_checkpoint: a fraction of save()'s peak
assert activation_peak(ckpt_rep) < 0.5 * activation_peak(save_rep)

# %% [markdown]
# Over forward then backward (the scan is record 0, so its backward is the last step):
# `save()` holds the inputs plus one carry per step until the scan's backward ends.
# `offload()` keeps the device line at the inputs (the caller holds them, so they are not
# copied) and every step's residuals on host; its backward brings one step's residuals
# back to device, the bump at the end. `scan_checkpoint("sqrt")` sits just above the inputs
# (a carry every 15 steps) and rises only by the one 15-step segment it recomputes at a
# time in backward.

# %%
fig, axs = plt.subplots(1, 3, figsize=(14, 3.2), sharey=True)
for ax, (name, rep) in zip(axs, loop_reps.items()):
    rep.plot(ax=ax, label=name)
    if rep.input_bytes:
        ax.axhline(rep.input_bytes, color="gray", lw=0.8, ls=":", label="inputs")
        ax.legend(fontsize="small")
fig.suptitle(f"live residual bytes, RNN scan over {T} steps")
fig.tight_layout()
plt.show()
