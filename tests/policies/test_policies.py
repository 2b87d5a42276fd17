"""Residual policies: every policy gives save()'s gradient (exactly, or within the
compression tolerance), moves/shrinks residuals as it says, and follows the
saved-tensors-hooks semantics of the seeds."""

from __future__ import annotations

import threading

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import MEMORY_KINDS, exact_on_cpu, live_bytes_by_kind

import tapegrad as tg
from tapegrad import policies as P


def mlp(ws, x):
    h = x
    for w in ws:
        h = jnp.tanh(h @ w)
    return jnp.mean(h**2)


@pytest.fixture(scope="module")
def model():
    ks = jax.random.split(jax.random.key(0), 5)
    ws = [jax.random.normal(k, (32, 32)) / 6 for k in ks[:4]]
    x = jax.random.normal(ks[4], (16, 32))
    return ws, x


EXACT = [
    P.save(),
    P.offload(),
    *([P.offload("unpinned_host")] if "unpinned_host" in MEMORY_KINDS else []),
    P.hooks(lambda a: a, lambda a: a),
    P.route(lambda info: P.offload() if info.primitive == "tanh" else P.save()),
]


@pytest.mark.parametrize("policy", EXACT, ids=repr)
@pytest.mark.parametrize("jit", [False, True])
def test_lossless_policies_give_save_gradient_exactly(model, policy, jit):
    ws, x = model
    g = tg.grad(mlp, policy=policy)
    g = jax.jit(g) if jit else g
    ref = jax.grad(mlp)(ws, x)
    chex.assert_trees_all_close(g(ws, x), ref, rtol=1e-6, atol=1e-7)
    exact_on_cpu(g(ws, x), tg.grad(mlp)(ws, x) if not jit else jax.jit(tg.grad(mlp))(ws, x))


@pytest.mark.parametrize(
    "policy,tol",
    [
        (P.compress(jnp.bfloat16), 2e-2),
        (P.compress(jnp.float16), 2e-3),
        (P.compress("int8"), 3e-2),
        (P.compress("int8", axis=-1), 3e-2),
    ],
    ids=repr,
)
def test_compress_gradient_within_tolerance(model, policy, tol):
    ws, x = model
    g = tg.grad(mlp, policy=policy)(ws, x)
    ref = jax.grad(mlp)(ws, x)
    for a, b in zip(g, ref):
        rel = float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))
        assert rel < tol, rel
        assert rel > 0  # compression really happened


@pytest.mark.parametrize(
    "policy", [P.save(), P.offload(), P.compress(jnp.bfloat16), P.compress("int8")], ids=repr
)
def test_memory_report_agrees_with_live_arrays(model, policy):
    ws, x = model
    rep = tg.memory_report(mlp, argnums=(0, 1), policy=policy)(ws, x)
    before = live_bytes_by_kind()
    out, vjp_fn = tg.vjp(mlp, ws, x, policy=policy)
    jax.block_until_ready(out)
    after = live_bytes_by_kind()
    grown = {k: after.get(k, 0) - before.get(k, 0) for k in set(after) | set(before)}
    grown["device"] -= out.nbytes
    # Residuals that are the inputs themselves were alive before the call.
    assert grown.get("device", 0) == rep.device_bytes - rep.input_bytes
    assert grown.get("pinned_host", 0) == rep.host_bytes
    del vjp_fn


def test_offload_moves_residuals_to_host_eagerly_and_under_jit(model):
    ws, x = model
    rep = tg.memory_report(mlp, policy=P.offload())(ws, x)
    # The inputs stay where the caller holds them; every activation moves.
    assert rep.device_bytes == rep.input_bytes > 0 and rep.host_bytes > 0
    assert rep.beyond_inputs_bytes == rep.host_bytes
    everything = tg.memory_report(mlp, policy=P.offload(inputs=True))(ws, x)
    assert everything.device_bytes == 0
    assert everything.host_bytes == rep.host_bytes + rep.input_bytes
    policy = P.route(lambda info: P.offload())
    # Offloaded arrays really live in pinned_host memory.
    off = P.offload()
    packed = off.pack(x, tg.ResidualInfo(None, None, x.shape, x.dtype))
    assert packed.sharding.memory_kind == "pinned_host"
    assert (
        off.unpack(packed, tg.ResidualInfo(None, None, x.shape, x.dtype)).sharding.memory_kind
        == "device"
    )
    jaxpr = str(jax.make_jaxpr(tg.grad(mlp, policy=policy))(ws, x))
    assert "MemorySpace.Host" in jaxpr and "MemorySpace.Device" in jaxpr


def test_compress_bytes_halve_and_quarter(model):
    ws, x = model
    full = tg.memory_report(mlp, policy=P.save())(ws, x).residual_bytes
    bf16 = tg.memory_report(mlp, policy=P.compress(jnp.bfloat16, inputs=True))(ws, x).residual_bytes
    i8 = tg.memory_report(mlp, policy=P.compress("int8", block_size=None, inputs=True))(ws, x)
    assert bf16 == full // 2
    n_res = sum(1 for r in i8.records for _ in r.saves.split(","))
    assert full // 4 < i8.residual_bytes <= full // 4 + 2 * n_res  # + one bf16 scale each
    assert i8.records[0].compressed_bytes > 0


def test_int8_per_channel_is_more_accurate_on_skewed_channels():
    x = jnp.stack([jnp.linspace(-1, 1, 64), jnp.linspace(-100, 100, 64)], axis=-1)
    info = tg.ResidualInfo(None, None, x.shape, x.dtype)
    per_tensor = P.compress("int8", block_size=None)
    per_channel = P.compress("int8", axis=-1)
    e_t = jnp.abs(per_tensor.unpack(per_tensor.pack(x, info), info) - x)[:, 0].max()
    e_c = jnp.abs(per_channel.unpack(per_channel.pack(x, info), info) - x)[:, 0].max()
    assert e_c < e_t / 10


def test_integer_residuals_are_not_compressed():
    idx = jnp.array([2, 0, 1])
    info = tg.ResidualInfo(None, None, idx.shape, idx.dtype)
    assert P.compress("int8").pack(idx, info) is idx
    assert P.compress(jnp.bfloat16).pack(idx, info) is idx


class Counter:
    def __init__(self):
        self.packed, self.unpacked = [], []

    def pack(self, x):
        self.packed.append(x.shape)
        return ("box", x)

    def unpack(self, p):
        assert p[0] == "box"
        self.unpacked.append(p[1].shape)
        return p[1]


def test_saved_tensors_hooks_pack_once_unpack_once_per_backward(model):
    ws, x = model
    c = Counter()
    with tg.saved_tensors_hooks(c.pack, c.unpack):
        out, vjp_fn = tg.vjp(mlp, ws, x)
    tape = tg.trace(mlp)(ws, x)
    n_distinct = len(tape.residual_vars())
    assert len(c.packed) == n_distinct
    assert c.unpacked == []
    g1 = vjp_fn(jnp.ones(()))  # outside the scope: the hooks active at pack time unpack
    assert len(c.unpacked) == n_distinct
    g2 = vjp_fn(jnp.ones(()))
    assert len(c.unpacked) == 2 * n_distinct and len(c.packed) == n_distinct
    chex.assert_trees_all_close(g1, g2)
    chex.assert_trees_all_close(g1, jax.vjp(mlp, ws, x)[1](jnp.ones(())), rtol=1e-6, atol=1e-7)


def test_hooks_nest_inner_overrides_outer_and_restore_on_error(model):
    ws, x = model
    outer, inner = Counter(), Counter()
    with tg.saved_tensors_hooks(outer.pack, outer.unpack):
        with tg.saved_tensors_hooks(inner.pack, inner.unpack):
            tg.grad(mlp)(ws, x)
        assert inner.packed and not outer.packed
        with pytest.raises(ZeroDivisionError):
            with tg.saved_tensors_hooks(inner.pack, inner.unpack):
                _ = 1 / 0
        tg.grad(mlp)(ws, x)
        assert outer.packed
    assert P.current_policy() is P.save()


def test_explicit_policy_wins_over_context(model):
    ws, x = model
    c = Counter()
    with tg.saved_tensors_hooks(c.pack, c.unpack):
        tg.grad(mlp, policy=P.save())(ws, x)
    assert c.packed == []


def test_hooks_scope_is_per_thread(model):
    ws, x = model
    c = Counter()
    seen = {}

    def other():
        seen["policy"] = P.current_policy()

    with tg.saved_tensors_hooks(c.pack, c.unpack):
        t = threading.Thread(target=other)
        t.start()
        t.join()
    assert seen["policy"] is P.save()


def test_disable_saved_tensors_hooks_raises_with_message():
    with tg.disable_saved_tensors_hooks("hooks are off in this library"):
        with pytest.raises(RuntimeError, match="hooks are off in this library"):
            with tg.saved_tensors_hooks(lambda a: a, lambda a: a):
                pass
    with tg.saved_tensors_hooks(lambda a: a, lambda a: a):  # allowed again outside
        pass


def test_unpack_with_wrong_shape_names_the_record_and_line(model):
    ws, x = model
    bad = P.hooks(lambda a: a, lambda a: a[..., :1] if a.ndim else a)
    with pytest.raises(tg.ResidualError, match=r"test_policies.py:\d+") as e:
        tg.grad(mlp, policy=bad)(ws, x)
    assert "unpack must return" in str(e.value)


def test_unpack_with_wrong_dtype_raises(model):
    ws, x = model
    bad = P.hooks(lambda a: a, lambda a: a.astype(jnp.float16))
    with pytest.raises(tg.ResidualError, match="float16"):
        tg.grad(mlp, policy=bad)(ws, x)


def test_exception_in_hook_propagates_with_record_named(model):
    ws, x = model

    def boom(a):
        raise KeyError("storage full")

    with pytest.raises(KeyError, match="storage full") as e:
        tg.grad(mlp, policy=P.hooks(boom, lambda a: a))(ws, x)
    assert any("test_policies.py" in n for n in e.value.__notes__)


def test_eager_only_pack_under_jit_gets_a_clear_error(model):
    ws, x = model
    pol = P.hooks(np.asarray, jnp.asarray)
    tg.grad(mlp, policy=pol)(ws, x)  # fine eagerly
    with pytest.raises(Exception) as e:
        jax.jit(tg.grad(mlp, policy=pol))(ws, x)
    assert any("trace time" in n for n in getattr(e.value, "__notes__", []))


def test_retain_residuals_false_releases_and_second_call_raises(model):
    ws, x = model
    c = Counter()
    out, vjp_fn = tg.vjp(mlp, ws, x, policy=P.hooks(c.pack, c.unpack), retain_residuals=False)
    vjp_fn(jnp.ones(()))
    with pytest.raises(tg.ResidualError, match="second time"):
        vjp_fn(jnp.ones(()))


def test_deleted_residual_raises_naming_the_record():
    w = jnp.ones((3, 3))
    x = jnp.arange(3.0)
    out, vjp_fn = tg.vjp(lambda w, x: jnp.sum(jnp.tanh(x @ w)), w, x)
    x.delete()
    with pytest.raises(tg.ResidualError, match="deleted") as e:
        vjp_fn(jnp.ones(()))
    assert "dot_general" in str(e.value)


def test_custom_vjp_residuals_go_through_hooks():
    @jax.custom_vjp
    def f(x):
        return jnp.sin(x)

    def fwd(x):
        return jnp.sin(x), (jnp.cos(x), x * 2)

    def bwd(res, g):
        c, _ = res
        return (g * c,)

    f.defvjp(fwd, bwd)
    c = Counter()
    x = jnp.linspace(0, 1, 5)
    with tg.saved_tensors_hooks(c.pack, c.unpack):
        g = tg.grad(lambda x: jnp.sum(f(x) ** 2))(x)
    assert len(c.packed) >= 2  # both custom_vjp residuals (+ the square's input)
    chex.assert_trees_all_close(g, jax.grad(lambda x: jnp.sum(f(x) ** 2))(x), rtol=1e-6)


def test_route_picks_by_size(model):
    ws, x = model
    seen = []

    def pick(info):
        seen.append(info.nbytes)
        return P.offload() if info.nbytes >= 2048 else P.save()

    rep = tg.memory_report(mlp, policy=P.route(pick))(ws, x)
    # offload() leaves the inputs (weights, x) where they are
    assert rep.host_bytes == sum(n for n in seen if n >= 2048) - rep.input_bytes
    assert rep.device_bytes == sum(n for n in seen if n < 2048) + rep.input_bytes


def test_memory_report_renders(model):
    ws, x = model
    rep = tg.memory_report(mlp, policy=P.offload())(ws, x)
    text = str(rep)
    assert "tanh" in text and "offload" in text
    assert all(len(line) <= 100 for line in text.splitlines()[1:])
    assert "<table" in rep._repr_html_()
    assert rep.peak_bytes >= rep.residual_bytes
    assert rep.timeline[-1][1] == 0  # everything released at the end of backward


def test_offload_inputs_false_moves_only_activations(model):
    ws, x = model
    plain = tg.memory_report(mlp)(ws, x)
    rep = tg.memory_report(mlp, policy=P.offload(inputs=False))(ws, x)
    # The function's own inputs stay on device (the caller holds them anyway) ...
    assert rep.device_bytes == plain.input_residual_bytes > 0
    # ... and every other residual lives on host.
    assert rep.host_bytes == plain.residual_bytes - plain.input_residual_bytes > 0
    chex.assert_trees_all_equal(
        tg.grad(mlp, policy=P.offload(inputs=False))(ws, x), tg.grad(mlp)(ws, x)
    )
    seen = []
    spy = P.route(lambda info: (seen.append(info.is_input), P.save())[1])
    tg.grad(mlp, policy=spy)(ws, x)
    assert True in seen and False in seen


@pytest.mark.parametrize("jit", [False, True])
def test_route_inside_a_scan(jit):
    """A routed residual inside a loop body is stacked per step: the packed value must be
    the chosen policy's arrays only (it held the policy object, which a scan cannot stack)."""

    def loss(a, h):
        def step(c, _):
            c = jnp.tanh(c * a + 0.1)
            return c, jnp.sin(c)

        c, ys = jax.lax.scan(step, h, None, length=4)
        return jnp.mean(c**2) + jnp.mean(ys**2)

    pol = P.route(lambda info: P.offload() if info.primitive == "tanh" else P.save())
    a, h = jnp.linspace(-1.0, 1.0, 8), jnp.linspace(0.5, -0.5, 8)
    g = tg.grad(loss, argnums=(0, 1), policy=pol)
    got = (jax.jit(g) if jit else g)(a, h)
    chex.assert_trees_all_close(got, jax.grad(loss, argnums=(0, 1))(a, h), rtol=1e-5, atol=1e-7)
