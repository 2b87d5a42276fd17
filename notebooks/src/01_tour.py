"""Source of 01_tour.ipynb (build with: python notebooks/_build.py)."""

# %% [markdown]
# # A tour of tapegrad
#
# tapegrad differentiates pure `jax.numpy` functions like `jax.grad` does, but through an
# **explicit tape**: the function is traced once into a list of primitive *records*, every
# value a record keeps for backward (a *residual*) is visible and counted, and reverse mode
# is an interpreter over that list.
#
# This notebook: `tg.grad` / `tg.vjp` against jax, the tape and what each record saves, and
# a comparison with `jax.ad_checkpoint.print_saved_residuals` on the same function.

# %%
import contextlib
import io
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
from IPython.display import display
from jax.ad_checkpoint import print_saved_residuals

import tapegrad as tg

print("jax", jax.__version__, "| tapegrad", tg.__version__, "|", jax.devices()[0].platform)

# %% [markdown]
# ## `tg.grad` and `tg.vjp` are drop-in for jax's
#
# A 3-layer tanh MLP with a mean-square readout; parameters are a list of matrices (any
# pytree works).


# %%
def loss(params, x):
    h = x
    for w in params:
        h = jnp.tanh(h @ w)
    return jnp.mean(h**2)


keys = jax.random.split(jax.random.PRNGKey(0), 4)
params = [jax.random.normal(k, (64, 64)) / 8 for k in keys[:3]]
x = jax.random.normal(keys[3], (32, 64))

g_tg = tg.grad(loss)(params, x)
g_jax = jax.grad(loss)(params, x)
chex.assert_trees_all_close(g_tg, g_jax, rtol=1e-5, atol=1e-7)

(v_tg, (gw_tg, gx_tg)) = tg.value_and_grad(loss, argnums=(0, 1))(params, x)
(v_jax, (gw_jax, gx_jax)) = jax.value_and_grad(loss, argnums=(0, 1))(params, x)
chex.assert_trees_all_close((v_tg, gw_tg, gx_tg), (v_jax, gw_jax, gx_jax), rtol=1e-5, atol=1e-7)
print("loss", float(v_tg), "| grads match jax.grad")

# %% [markdown]
# `tg.vjp` returns `(out, vjp_fn)` like `jax.vjp`. Here on the (non-scalar) hidden layer,
# with a random cotangent:


# %%
def hidden(params, x):
    return jnp.tanh(x @ params[0])


out, vjp_fn = tg.vjp(hidden, params, x)
ct = jax.random.normal(jax.random.PRNGKey(1), out.shape)
out_j, vjp_j = jax.vjp(hidden, params, x)
chex.assert_trees_all_close(out, out_j)
chex.assert_trees_all_close(vjp_fn(ct), vjp_j(ct), rtol=1e-5, atol=1e-6)
print("vjp matches jax.vjp")

# %% [markdown]
# ## The tape
#
# `tg.trace(f)(*args)` returns the `Tape` that `tg.grad` runs on. In Jupyter it renders as
# a table (`Tape._repr_html_`): primitive, shapes, what each record saves, the bytes, and
# the source line that made it.

# %%
tape = tg.trace(loss)(params, x)
display(tape)

# %% [markdown]
# `print(tape)` gives the same as text, in `jax.make_jaxpr`'s notation, with `saves[...]`
# per record (`in0` = the record's first input, `out0` = its output).

# %%
print(tape)

# %% [markdown]
# ## What each record saves, and why
#
# A rule saves the least its backward needs (`Record.saves`):
#
# | primitive | saves | why |
# |---|---|---|
# | `dot_general` `h @ w` | `in0`, `in1` | `dh = g @ w.T` needs `w`, `dw = h.T @ g` needs `h` |
# | `tanh` | `out0` | `d tanh(u) = 1 - tanh(u)²`: the output suffices, the input is not kept |
# | `integer_pow` (`h**2`) | `in0` | `d h² = 2h`; `h` is already saved by `tanh`: counted once |
# | `reduce_sum`, `div` by a constant | nothing | linear: backward is a broadcast / a scale |

# %%
why = {
    "dot_general": "both operands: each one's gradient needs the other",
    "tanh": "its output y: dy/du = 1 - y**2",
    "integer_pow": "its input: d x**2 = 2x",
    "reduce_sum": "nothing: linear",
    "div": "nothing: division by a literal is linear",
}
for rec in tape.records:
    saves = ",".join(map(str, rec.saves)) or "-"
    print(
        f"#{rec.index} {rec.primitive:<12} saves {saves:<8} {rec.saved_bytes:>7,} B  "
        f"{why[rec.primitive]}"
    )

by_prim = {}
for rec in tape.records:
    by_prim.setdefault(rec.primitive, set()).add(tuple(str(s) for s in rec.saves))
assert by_prim["tanh"] == {("out0",)}
assert by_prim["dot_general"] == {("in1", "in0")}
assert by_prim["reduce_sum"] == {()} and by_prim["div"] == {()}

# %% [markdown]
# What is saved depends on what is differentiated. `tg.trace(loss, argnums=0)` treats only
# `params` as differentiated: the first matmul then needs no gradient for `x`, so it does
# not keep `w0`.

# %%
tape_w = tg.trace(loss, argnums=0)(params, x)
print("all inputs:", [str(s) for s in tape.records[0].saves], f"{tape.saved_bytes:,} B")
print("params only:", [str(s) for s in tape_w.records[0].saves], f"{tape_w.saved_bytes:,} B")
assert [str(s) for s in tape_w.records[0].saves] == ["in0"]  # x, for dw0
assert tape_w.saved_bytes == tape.saved_bytes - params[0].nbytes

# %% [markdown]
# ## Compared with `jax.ad_checkpoint.print_saved_residuals`
#
# jax can list the residuals its own `jax.vjp` keeps for the same function. It prints to
# stdout; capture that and count the bytes.

# %%
buf = io.StringIO()
with contextlib.redirect_stdout(buf):
    print_saved_residuals(loss, params, x)
jax_lines = buf.getvalue().strip().splitlines()
print("\n".join(jax_lines))

ITEMSIZE = {"f32": 4, "f64": 8, "bf16": 2, "f16": 2, "i32": 4, "bool": 1}


def line_bytes(line):
    dtype, shape = re.match(r"(\w+)\[([\d,]*)\]", line).groups()
    return ITEMSIZE[dtype] * int(np.prod([int(d) for d in shape.split(",") if d]))


jax_bytes = sum(line_bytes(ln) for ln in jax_lines)

# The same count from the residuals jax.vjp really holds (its vjp_fn is a Partial over them).
_, jax_vjp_fn = jax.vjp(loss, params, x)
held = [a for a in jax.tree_util.tree_leaves(jax_vjp_fn) if isinstance(a, jax.Array)]
print(
    f"\njax: {len(jax_lines)} residuals, {jax_bytes:,} B (vjp_fn holds {len(held)} arrays, "
    f"{sum(a.nbytes for a in held):,} B)"
)
print(f"tapegrad: {len(tape.residual_vars())} residuals, {tape.saved_bytes:,} B")
assert jax_bytes == sum(a.nbytes for a in held)
assert tape.saved_bytes < jax_bytes

# %% [markdown]
# The difference is the `sub` lines: jax linearizes `tanh` (JVP, then transpose) and keeps
# the tangent map's coefficient `1 - tanh(u)²` **and** `tanh(u)` for each layer, plus
# `2h` for the square. tapegrad's `tanh` rule keeps only `tanh(u)` and computes `1 - y²` in
# backward (one cheap elementwise op), and `h**2` reuses the saved `h`.

# %%
n_sub = sum(" output of sub " in ln for ln in jax_lines)
n_tanh = sum(r.primitive == "tanh" for r in tape.records)
act = x.nbytes  # one (32, 64) activation
extra = jax_bytes - tape.saved_bytes
print(
    f"jax keeps {n_sub} 'sub' activations that tapegrad recomputes; "
    f"difference {extra:,} B = {extra // act} activations"
)
assert n_sub == n_tanh
assert extra == (n_sub + 1) * act  # the `sub`s and jax's extra `2h`
