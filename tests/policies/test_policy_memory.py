"""Policies never add memory: every built-in policy holds no more bytes beyond the
function's inputs than `save()` does (measured from `jax.live_arrays()` between `tg.vjp`'s
forward and backward), and `tg.memory_report`'s headline is that same number.

Records whose backward runs `jax.vjp` are reported with an estimate equal to the bytes
of the residuals `jax.vjp` keeps for that primitive.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import pytest
from conftest import MEMORY_KINDS, live_bytes_by_kind

import tapegrad as tg
from tapegrad import policies as P
from tapegrad.report.memory import vjp_residual_bytes

LAYERS, WIDTH, BATCH = 6, 64, 128
ACT = BATCH * WIDTH * 4  # one f32[128, 64] activation


def mlp(ws, x):
    h = x
    for w in ws:
        h = jnp.tanh(h @ w)
    return jnp.mean(h**2)


@pytest.fixture(scope="module")
def model():
    ks = jax.random.split(jax.random.key(0), LAYERS + 1)
    ws = [jax.random.normal(k, (WIDTH, WIDTH)) / 8 for k in ks[:LAYERS]]
    x = jax.random.normal(ks[-1], (BATCH, WIDTH))
    return ws, x


class CopyAll:
    """A custom policy that copies what it is given (as a user's storage policy might)."""

    def pack(self, value, info):
        return jnp.copy(value)

    def unpack(self, packed, info):
        return packed


def _is_dot(rec):
    return rec.primitive == "dot_general"  # keep matmuls, recompute tanh


# Every built-in policy (and a custom one), with the bytes its residuals may take
# beyond the inputs, as a fraction of save()'s.
POLICIES = {
    "save": (P.save(), 1.0),
    "offload": (P.offload(), 1.0),  # device: 0; host: save()'s activations
    "bf16": (P.compress(jnp.bfloat16), 0.5),
    "f16": (P.compress(jnp.float16), 0.5),
    "f8": (P.compress(jnp.float8_e4m3fn), 0.25),
    "int8": (P.compress("int8"), 0.27),
    "int8/ch": (P.compress("int8", axis=-1), 0.26),
    "hooks": (P.hooks(lambda a: a, lambda a: a), 1.0),
    "hooks-copy": (P.hooks(jnp.copy, lambda a: a, inputs=False), 1.0),
    "route": (P.route(lambda i: P.offload() if i.primitive == "tanh" else P.compress("int8")), 1.0),
    "budget": (P.budget(bytes=3 * ACT), 0.5),
    "budget-bf16": (P.budget(bytes=3 * ACT, base=P.compress(jnp.bfloat16)), 0.5),
    "selective": (tg.selective(_is_dot), 1.0),
    "selective-offload": (tg.selective(_is_dot, base=P.offload()), 1.0),
    "scan_checkpoint": (P.scan_checkpoint(), 1.0),
    "custom": (CopyAll(), 1.0),
}
if "unpinned_host" in MEMORY_KINDS:  # not a memory kind of a GPU
    POLICIES["offload-unpinned"] = (P.offload("unpinned_host"), 1.0)


def held_beyond_inputs(f, args, policy) -> int:
    """Bytes (every memory kind) that `tg.vjp`'s forward leaves alive besides its output:
    the inputs already exist before the baseline, so only what backward adds counts."""
    before = live_bytes_by_kind()
    out, vjp_fn = tg.vjp(f, *args, policy=policy)
    jax.block_until_ready(out)
    after = live_bytes_by_kind()
    grown = sum(after.values()) - sum(before.values()) - out.nbytes
    vjp_fn(jnp.ones_like(out))  # backward still works off what was held
    return grown


@pytest.fixture(scope="module")
def save_held(model):
    held = held_beyond_inputs(mlp, model, P.save())
    assert held == LAYERS * ACT  # each tanh output (the next layer's input), once
    return held


@pytest.mark.parametrize("name", list(POLICIES))
def test_no_policy_holds_more_than_save_beyond_the_inputs(model, save_held, name):
    ws, x = model
    policy, frac = POLICIES[name]
    save = save_held
    held = held_beyond_inputs(mlp, (ws, x), policy)
    assert held <= frac * save, (name, held, save)
    # the report's headline is that number, read off the same kind of run
    rep = tg.memory_report(mlp, argnums=(0, 1), policy=policy)(ws, x)
    assert rep.beyond_inputs_bytes == held, (name, rep.beyond_inputs_bytes, held)
    assert rep.input_bytes == sum(w.nbytes for w in ws) + x.nbytes  # kept as they are


def test_opting_in_to_inputs_is_what_adds_memory(model):
    ws, x = model
    inputs = sum(w.nbytes for w in ws) + x.nbytes
    plain = tg.memory_report(mlp, argnums=(0, 1), policy=P.compress(jnp.bfloat16))(ws, x)
    opted = P.compress(jnp.bfloat16, inputs=True)
    rep = tg.memory_report(mlp, argnums=(0, 1), policy=opted)(ws, x)
    # the bf16 copies of the weights and x come on top: the caller still holds the originals
    assert rep.input_bytes == 0
    assert rep.beyond_inputs_bytes == plain.beyond_inputs_bytes + inputs // 2
    assert held_beyond_inputs(mlp, (ws, x), opted) == rep.beyond_inputs_bytes
    # user hooks see the inputs by default (PyTorch's saved_tensors_hooks do)
    seen = []
    with tg.saved_tensors_hooks(lambda a: (seen.append(a.shape), a)[1], lambda a: a):
        tg.grad(mlp)(ws, x)
    assert (WIDTH, WIDTH) in seen and (BATCH, WIDTH) in seen


def test_custom_policy_is_given_no_inputs_unless_it_asks(model):
    ws, x = model
    infos = []

    class Spy:
        def pack(self, value, info):
            infos.append(info)
            return value

        def unpack(self, packed, info):
            return packed

    tg.grad(mlp, argnums=(0, 1), policy=Spy())(ws, x)
    assert infos and not any(i.is_input for i in infos)
    n = len(infos)
    Spy.inputs = True
    infos.clear()
    g = tg.grad(mlp, argnums=(0, 1), policy=Spy())(ws, x)
    assert sum(i.is_input for i in infos) == LAYERS + 1 and len(infos) == n + LAYERS + 1
    chex.assert_trees_all_close(g, jax.grad(mlp, argnums=(0, 1))(ws, x), rtol=1e-5, atol=1e-6)


def test_headline_leads_with_bytes_beyond_the_inputs(model):
    ws, x = model
    rep = tg.memory_report(mlp, argnums=(0, 1), policy=P.compress(jnp.bfloat16))(ws, x)
    lines = str(rep).splitlines()
    assert lines[1] == (
        f"  backward holds {rep.beyond_inputs_bytes:,} B beyond the inputs; "
        f"peak {rep.peak_beyond_inputs_bytes:,} B beyond the inputs"
    )
    assert f"inputs themselves {rep.input_bytes:,} B" in lines[2]
    assert rep.beyond_inputs_bytes == LAYERS * ACT // 2  # was 0.83x of save() with x, ws
    # backward unpacks one bf16 activation at a time on top: a float32 copy
    assert rep.peak_beyond_inputs_bytes > rep.beyond_inputs_bytes
    assert rep.peak_bytes - rep.peak_beyond_inputs_bytes <= rep.input_bytes
    html = rep._repr_html_()
    assert f'data-key="beyond_inputs_bytes" data-v="{rep.beyond_inputs_bytes}"' in html
    assert html.index('data-key="beyond_inputs_bytes"') < html.index('data-key="residual_bytes"')


def _jax_vjp_residual_bytes(f, *args) -> int:
    """Bytes of the arrays jax.vjp keeps for ``f`` (its Partial's leaves), less ``args``."""
    _, vjp_fn = jax.vjp(f, *args)
    ids = {id(a) for a in args}
    leaves = {id(a): a for a in jax.tree.leaves(vjp_fn) if hasattr(a, "nbytes")}
    return sum(a.nbytes for i, a in leaves.items() if i not in ids)


def test_fallback_records_are_flagged_with_jax_vjps_residual_bytes():
    x = jnp.linspace(1.5, 2.5, 6)
    a = jnp.outer(x, x) + jnp.eye(6)

    def f(x, a):
        return jnp.sum(jax.lax.lgamma(x)) + jnp.sum(jnp.linalg.eigh(a)[0] * x)

    tape = tg.trace(f, argnums=(0, 1))(x, a)
    fallbacks = {r.primitive: r for r in tape.fallback_records}
    assert set(fallbacks) == {"lgamma", "eigh"}
    want = {
        "lgamma": _jax_vjp_residual_bytes(jax.lax.lgamma, x),
        # the record is the bare primitive: jnp.linalg.eigh symmetrizes before it
        "eigh": _jax_vjp_residual_bytes(
            lambda a: jax.lax.linalg.eigh(a, symmetrize_input=False), a
        ),
    }
    assert want["lgamma"] == x.nbytes  # digamma(x)
    assert want["eigh"] > a.nbytes  # eigenvectors and more
    for prim, rec in fallbacks.items():
        assert vjp_residual_bytes(rec) == want[prim] > 0, prim
    rep = tg.memory_report(f, argnums=(0, 1))(x, a)
    assert {u.primitive: u.bytes for u in rep.unseen} == want
    assert all(u.rule == "fallback" for u in rep.unseen)
    # each is a transient of its record's backward, on top of what is live there (the
    # point before it: the last record's, past any transient point of a recomputation)
    for u in rep.unseen:
        labels = [s for s, _ in rep.timeline]
        i = labels.index(f"bwd {u.index} jax.vjp")
        j = i - 1
        while labels[j].endswith(" recompute"):
            j -= 1
        assert rep.timeline[i][1] == rep.timeline[j][1] + u.bytes <= rep.peak_bytes
    text = str(rep)
    assert f"it makes about {want['eigh']:,} B of residuals" in text
    assert "not counted" not in text
