"""Lossless structural residuals: rules whose derivative is a comparison keep bit-packed
masks (uint8, 8 elements a byte along the last axis), not their float operands.

Gradients are compared with `jax.vjp` (ties, NaN, +-inf, float64 at 1e-10 scale); what
each record keeps is read off the tape (its saves' avals) and off the arrays alive
between `tg.vjp`'s forward and backward (`jax.live_arrays`), against hand-counted bytes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_trees_close, enable_x64, live_bytes_by_kind, run_on_8_cpu_devices
from jax import lax

import tapegrad as tg
from tapegrad import policies as P
from tapegrad.rules import _bits

ROWS, COLS = 16, 40  # 640 elements: packed, 40 bools a row in 5 bytes
PACKED = ROWS * 5


def _special(shape=(ROWS, COLS), seed=0, dtype=np.float32, scale=1.0):
    """Random values with zeros, exact ties at 0.5, +-inf and NaN sprinkled in."""
    rng = np.random.RandomState(seed)
    x = rng.standard_normal(shape)
    flat = x.reshape(-1)
    flat[::7] = 0.0
    flat[3::11] = 0.5
    flat[5::37] = np.inf
    flat[6::41] = -np.inf
    flat[8::53] = np.nan
    return jnp.asarray((x * scale).astype(dtype))


def _finite(shape=(ROWS, COLS), seed=1, dtype=np.float32, scale=1.0):
    rng = np.random.RandomState(seed)
    x = rng.standard_normal(shape)
    x.reshape(-1)[::5] = 0.5  # ties with _special's 0.5s
    return jnp.asarray((x * scale).astype(dtype))


def _check_vjp(f, *args, jit=False, compiled_oracle=False):
    """tg.vjp == jax.vjp, exactly (masks are lossless), NaNs in the same places.

    ``compiled_oracle``: compare with jax's vjp under jax.jit. Where a reduce_max's
    extremum is NaN, jax's eager cotangent is NaN along the whole row (0/0 times the
    mask) but XLA rewrites ``x * convert(mask)`` into a select, so jax's own jitted
    cotangent is 0 there; tapegrad's eager backward runs each rule compiled."""
    out, vjp_fn = tg.vjp(f, *args)
    want_out, want_fn = jax.vjp(f, *args)
    ct = jnp.asarray(np.random.RandomState(7).standard_normal(np.shape(want_out)), out.dtype)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(want_out))
    jitted = jax.jit(lambda ct, *a: jax.vjp(f, *a)[1](ct))
    want = jitted(ct, *args) if compiled_oracle else want_fn(ct)
    for g, w in zip(vjp_fn(ct), want):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    if jit:
        got = jax.jit(lambda ct, *a: tg.vjp(f, *a)[1](ct))(ct, *args)
        for g, w in zip(got, jitted(ct, *args)):
            np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def _inner(x):
    """``x`` again (bit for bit), but not an input: an input is kept as it is
    (`test_operands_kept_anyway_are_kept_instead_of_masks`); and not a cheap op that
    backward would rebuild from ``x`` (-(-x) would be)."""
    return lax.reduce_precision(x, exponent_bits=8, mantissa_bits=23)


def _held(f, *args, policy=None):
    """Bytes `tg.vjp`'s forward leaves alive beyond the inputs and the output."""
    before = live_bytes_by_kind()
    out, vjp_fn = tg.vjp(f, *args, policy=policy)
    jax.block_until_ready(out)
    grown = sum(live_bytes_by_kind().values()) - sum(before.values()) - out.nbytes
    del vjp_fn
    return grown


def _saves(f, *args, argnums=0):
    tape = tg.trace(f, argnums=argnums)(*args)
    return tape, [
        (r.primitive, r.params.get("name"), s.kind, s.shape, str(s.dtype))
        for r in tape.records
        for s in r.saves
    ]


# ---------------------------------------------------------------------------
# The packing itself


@pytest.mark.parametrize("shape", [(8,), (300,), (4, 67), (2, 3, 64), (3, 5, 17)])
def test_pack_round_trip_matches_numpy_packbits(shape):
    rng = np.random.RandomState(sum(shape))
    m = rng.rand(*shape) > 0.5
    aval = _bits.mask_aval(shape)
    kept = _bits.pack_mask(jnp.asarray(m))
    assert (kept.shape, kept.dtype) == (aval.shape, aval.dtype)
    if _bits.packs(shape):
        assert kept.dtype == np.uint8 and kept.shape[-1] == -(-shape[-1] // 8)
        np.testing.assert_array_equal(np.asarray(kept), np.packbits(m, -1, bitorder="little"))
    else:  # too small to be worth two extra ops
        assert kept.dtype == np.bool_
    np.testing.assert_array_equal(np.asarray(_bits.unpack_mask(kept, shape)), m)
    jitted = jax.jit(lambda a: _bits.unpack_mask(_bits.pack_mask(a), shape))(jnp.asarray(m))
    np.testing.assert_array_equal(np.asarray(jitted), m)


def test_short_rows_and_tiny_masks_stay_bool():
    assert not _bits.packs((4096, 7))  # a byte per row of 7 would save little
    assert not _bits.packs((4, 8))  # 32 bytes
    assert _bits.packs((32, 8)) and _bits.packs((1, 256))
    assert _bits.mask_aval((32, 9)).shape == (32, 2)


# ---------------------------------------------------------------------------
# Each rule: gradients equal jax's, and the residual kept is the packed mask


def test_relu_keeps_a_packed_mask():
    x = _special()
    f = lambda x: jnp.sum(jax.nn.relu(x) * 3.0)  # noqa: E731
    _check_vjp(f, x, jit=True)
    _, saves = _saves(f, x)
    assert saves == [("custom_jvp_rule", "relu", "aux", (ROWS, 5), "uint8")]
    assert _held(f, x) == PACKED  # 32x fewer than x's float32 bytes


def test_relu6_and_leaky_relu():
    x = _special() * 4
    for f in (
        lambda x: jnp.sum(jax.nn.relu6(x) ** 2),
        lambda x: jnp.sum(jnp.sin(jax.nn.leaky_relu(x, 0.1))),
    ):
        _check_vjp(f, x, jit=True)
    # leaky_relu is a where on x >= 0: the predicate is rebuilt in backward from x, which
    # the caller holds, so select_n keeps it (rebuilt) rather than a packed copy; the slope,
    # a float32 scalar the mul that scales x needs, is rebuilt from its literal.
    f = lambda x: jnp.sum(jax.nn.leaky_relu(x, 0.1) * 2.0)  # noqa: E731
    tape, saves = _saves(f, x)
    assert sorted(saves) == [
        ("mul", None, "in", (), "float32"),
        ("select_n", None, "in", (ROWS, COLS), "bool"),
    ]
    (ge,) = [r for r in tape.records if r.primitive == "ge"]
    assert ge.decision == "recompute"
    assert _held(f, x) == 0
    # Under compress too: x is an input compress is not given, so the predicate rebuilt
    # from it is exact. Under a policy that may change anything it packs (hooks), nothing
    # is rebuilt: the predicate is kept packed (and the slope, 4 bytes, unless the identity
    # hook hands back an array alive anyway).
    assert _held(f, x, policy=tg.policies.compress(jnp.float32)) == 0
    hooks = tg.policies.hooks(lambda v: v, lambda v: v)
    assert PACKED <= _held(f, x, policy=hooks) <= PACKED + 4


def test_where_keeps_its_predicate_packed():
    x, y = _special(), _finite()
    # sin(x) is kept by nobody (sin keeps x): the predicate cannot be rebuilt for free.
    f = lambda x, y: jnp.sum(jnp.where(jnp.sin(x) > y, x * 2, y) ** 2)  # noqa: E731
    _check_vjp(f, x, y, jit=True)
    tape, _ = _saves(f, x, y, argnums=(0, 1))
    (sel,) = [r for r in tape.records if r.primitive == "select_n"]
    assert [(s.kind, s.shape, s.dtype) for s in sel.saves] == [("aux", (ROWS, 5), np.uint8)]
    # x > y on inputs is rebuilt from them in backward: no mask kept at all.
    g = lambda x, y: jnp.sum(jnp.where(x > y, x * 2, y) ** 2)  # noqa: E731
    _check_vjp(g, x, y, jit=True)
    tape, _ = _saves(g, x, y, argnums=(0, 1))
    (sel,) = [r for r in tape.records if r.primitive == "select_n"]
    assert [(s.kind, s.dtype) for s in sel.saves] == [("in", np.bool_)]
    assert [r.decision for r in tape.records if r.primitive == "gt"] == ["recompute"]


def test_where_with_a_literal_or_integer_selector():
    x, y, z = _special(), _finite(), _finite(seed=3)
    which = jnp.asarray(np.random.RandomState(2).randint(0, 3, (ROWS, COLS)), jnp.int32)
    f = lambda x, y, z: jnp.sum(lax.select_n(which, x, y, z) ** 2)  # noqa: E731
    _check_vjp(f, x, y, z)
    tape, _ = _saves(f, x, y, z, argnums=(0, 1, 2))
    (sel,) = [r for r in tape.records if r.primitive == "select_n"]
    # an integer selector cannot be a bit: kept as it is
    assert [(s.kind, s.dtype) for s in sel.saves] == [("in", np.int32)]
    _check_vjp(lambda x: jnp.sum(jnp.where(True, x, 0.0) * 2), x)


def test_clamp_keeps_one_mask_per_active_operand():
    x = _special()
    f = lambda x: jnp.sum(lax.clamp(-0.5, _inner(x), 0.5) * 3.0)  # noqa: E731  (ties at 0.5)
    _check_vjp(f, x, jit=True)
    _, saves = _saves(f, x)
    assert saves == [("clamp", None, "aux", (ROWS, 5), "uint8")]
    assert _held(f, x) == PACKED
    # jnp.clip is max then min: two packed masks each
    _check_vjp(lambda x: jnp.sum(jnp.clip(x, -0.5, 0.5) * 3.0), x, jit=True)
    # array bounds, every operand differentiated; lo > hi in places; ties everywhere
    lo, hi = _finite(seed=4) - 0.5, _finite(seed=5) + 0.5
    g = lambda lo, x, hi: jnp.sum(lax.clamp(_inner(lo), _inner(x), _inner(hi)) ** 2)  # noqa: E731
    _check_vjp(g, lo, x, hi, jit=True)
    _check_vjp(g, lo, lo, hi)  # x == lo everywhere
    _check_vjp(g, hi, x, lo)  # lo > hi
    _, saves = _saves(g, lo, x, hi, argnums=(0, 1, 2))
    assert [s[2:] for s in saves if s[0] == "clamp"] == [("aux", (ROWS, 5), "uint8")] * 3


@pytest.mark.parametrize("op", [jnp.maximum, jnp.minimum], ids=["max", "min"])
def test_binary_max_min_split_ties_like_jax(op):
    x, y = _special(), _finite()
    y = jnp.where(jnp.arange(COLS) % 3 == 0, x, y)  # exact ties, NaN against NaN too
    f = lambda x, y: jnp.sum(op(_inner(x), _inner(y)) * 3.0)  # noqa: E731
    _check_vjp(f, x, y, jit=True)
    _check_vjp(lambda x: jnp.sum(op(x, 0.0) * 3.0), x, jit=True)  # relu spelled maximum
    _check_vjp(lambda x: jnp.sum(op(x, x) * 3.0), x)  # all tied: 1/2 + 1/2
    _, saves = _saves(f, x, y, argnums=(0, 1))
    prim = "max" if op is jnp.maximum else "min"
    assert saves == [(prim, None, "aux", (ROWS, 5), "uint8")] * 2  # 2 bits, not 64
    assert _held(f, x, y) == 2 * PACKED


@pytest.mark.parametrize("op", [jnp.max, jnp.min], ids=["max", "min"])
def test_reduce_max_min_keep_a_packed_tie_mask(op):
    x = _special()
    tied = jnp.round(_finite() * 2) / 2  # many ties per row
    for f in (
        lambda x: jnp.sum(op(x, axis=-1) ** 2),
        lambda x: jnp.sum(op(x, axis=0) ** 2),
        lambda x: op(x) * 2.0,
    ):
        _check_vjp(f, x, jit=True, compiled_oracle=True)  # NaN rows: see _check_vjp
        _check_vjp(f, tied, jit=True)
    f = lambda x: jnp.sum(op(x, axis=-1) * 2.0)  # noqa: E731
    _, saves = _saves(f, x)
    assert saves == [(f"reduce_{op.__name__}", None, "aux", (ROWS, 5), "uint8")]
    assert _held(f, x) == PACKED


def _max_sin(h):
    return jnp.sum(jnp.maximum(h, 0.3) * jnp.sin(h))


def test_operands_kept_anyway_are_kept_instead_of_masks():
    """A mask costs a bit per element; an operand the caller holds (an input) or another
    record saves costs nothing: then the record keeps the operand (before masks, it did)."""
    x, y = _special(), _finite()
    m = _finite(seed=9) > 0
    cases = {
        "max": (lambda x, y: jnp.sum(jnp.maximum(x, y) * 3.0), (x, y)),
        "select_n": (lambda x, y: jnp.sum(jnp.where(m, x, y) * 3.0), (x, y)),
        "clamp": (lambda x, y: jnp.sum(lax.clamp(-0.5, x, 0.5) * 3.0), (x, y)),
        # sin keeps h: max keeps its operand h instead of two masks
        "max(h, 0.3)": (lambda x, y: _max_sin(_inner(x)), (x, y)),
    }
    for name, (f, args) in cases.items():
        _check_vjp(f, *args, jit=True)
        tape, saves = _saves(f, *args, argnums=(0, 1))
        prim = name.split("(")[0]
        kept = [s[2:] for s in saves if s[0] == prim]
        assert kept and all(k == "in" for k, *_ in kept), (name, kept)
        # max(h, 0.3): h (for sin and max) and sin(h); mul's other operand max(h, 0.3) is
        # rebuilt from h in backward
        assert _held(f, *args) == (0 if name != "max(h, 0.3)" else 2 * x.nbytes), name
    # an operand nobody else keeps: masks (2 bits) rather than the float (32)
    f = lambda x: jnp.sum(jnp.maximum(jnp.sin(x), x) * 3.0)  # noqa: E731
    _check_vjp(f, x)
    assert _held(f, x) == 2 * PACKED


def test_float64_at_1e_10():
    with enable_x64():
        x, y = _special(dtype=np.float64, scale=1e-10), _finite(dtype=np.float64, scale=1e-10)
        fs = (
            lambda x, y: jnp.sum(jax.nn.relu(x) * y),
            lambda x, y: jnp.sum(jnp.maximum(x, y) ** 2),
            lambda x, y: jnp.sum(jnp.clip(x, -5e-11, 5e-11) * y),
            lambda x, y: jnp.sum(jnp.max(x, axis=-1) * jnp.min(y, axis=-1)),
            lambda x, y: jnp.sum(jnp.where(x > y, x, y) ** 2),
        )
        for f in fs:
            _check_vjp(f, x, y, compiled_oracle=True)
            _check_vjp(f, jnp.where(jnp.isfinite(x), x, 0.5e-10), y)  # eager jax too


def test_integer_operands_keep_nothing():
    i = jnp.asarray(np.random.RandomState(0).randint(-5, 5, (ROWS, COLS)), jnp.int32)
    x = _finite()
    f = lambda x, i: jnp.sum(x * jnp.maximum(i, 0) + jnp.max(i, axis=-1)[:, None])  # noqa: E731
    _check_vjp(f, x, i.astype(jnp.float32))  # the oracle on floats
    got = tg.grad(f)(x, i)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(jax.grad(f)(x, i)))
    tape, saves = _saves(f, x, i)
    assert not [s for s in saves if s[0] in ("max", "reduce_max")]


@pytest.mark.parametrize("op", [lax.max, lax.min], ids=["max", "min"])
def test_max_pool_keeps_packed_window_indices(op):
    x = _special((2, 8, 8, 16))  # NaN, +-inf, ties inside windows
    x = x.at[:, ::2, ::2, :].set(x[:, 1::2, 1::2, :])
    init = -jnp.inf if op is lax.max else jnp.inf

    def pool(x, window=(1, 2, 2, 1), pad="VALID"):
        return lax.reduce_window(x, init, op, window, window, pad)

    f = lambda x: jnp.sum(pool(x) * 3.0)  # noqa: E731
    _check_vjp(f, x, jit=True)
    _, saves = _saves(f, x)
    # which element of each 2x2 window won: 2 bits per output, 4 to a byte
    name = f"reduce_window_{op.__name__}"
    assert saves == [(name, None, "aux", (2, 4, 4, 4), "uint8")]
    assert _held(f, x) == 2 * 4 * 4 * 4  # 64x fewer than the float32 input jax keeps
    # 3x3 windows with padding: 4 bits per output
    g = lambda x: jnp.sum(pool(x, (1, 3, 3, 1), ((0, 0), (1, 1), (1, 1), (0, 0))) ** 2)  # noqa: E731
    _check_vjp(g, jnp.nan_to_num(x), jit=True)
    _, saves = _saves(g, x)
    assert saves[0] == (name, None, "aux", (2, 3, 3, 8), "uint8")  # then ** 2 keeps its input


@pytest.mark.parametrize("n_values", [2, 3, 4, 9, 16, 17])
def test_code_packing_round_trip(n_values):
    shape = (3, 5, 40)
    codes = np.random.RandomState(n_values).randint(0, n_values, shape).astype(np.int8)
    kept = _bits.pack_codes(jnp.asarray(codes), n_values)
    aval = _bits.codes_aval(shape, n_values, np.int8)
    assert (kept.shape, kept.dtype) == (aval.shape, aval.dtype)
    bits = _bits.code_bits(n_values)
    assert kept.dtype == (np.int8 if bits == 8 else np.uint8)
    assert kept.shape[-1] == -(-40 * bits // 8)
    back = _bits.unpack_codes(kept, shape, n_values, np.int8)
    assert back.dtype == np.int8
    np.testing.assert_array_equal(np.asarray(back), codes)


# ---------------------------------------------------------------------------
# Through every transformation and policy


def _relu_mlp(ws, x):
    h = x
    for w in ws:
        h = jax.nn.relu(h @ w)
    return jnp.sum(h * h)


def _mlp_args(depth=3, width=64, batch=16):
    key = jax.random.PRNGKey(0)
    ws = [jax.random.normal(jax.random.fold_in(key, i), (width, width)) / 8 for i in range(depth)]
    return ws, jax.random.normal(key, (batch, width))


def test_vmap_and_grad_of_grad():
    ws, x = _mlp_args(depth=2, width=32)  # 16x32 masks: packed
    xs = jnp.stack([x, -x, x * 2])
    got = jax.vmap(tg.grad(_relu_mlp), in_axes=(None, 0))(ws, xs)
    want = jax.vmap(jax.grad(_relu_mlp), in_axes=(None, 0))(ws, xs)
    assert_trees_close(got, want)
    h = lambda x: jnp.sum(jnp.maximum(x, 0.3) ** 3) + jnp.sum(jnp.max(x, axis=-1) ** 2)  # noqa: E731
    x = _finite()
    gg = tg.grad(lambda x: jnp.sum(tg.grad(h)(x) ** 2))(x)
    assert_trees_close(gg, jax.grad(lambda x: jnp.sum(jax.grad(h)(x) ** 2))(x))


def test_scan_body_keeps_packed_masks_per_step():
    w = jax.random.normal(jax.random.PRNGKey(1), (COLS, COLS)) / 6
    xs = jax.random.normal(jax.random.PRNGKey(2), (12, ROWS, COLS))

    def f(c0, xs):
        def body(c, x):
            c = jax.nn.relu(c @ w + x)
            return c, jnp.max(c, axis=-1)

        c, ys = lax.scan(body, c0, xs)
        return jnp.sum(c) + jnp.sum(ys**2)

    c0 = _finite()
    _check_vjp(f, c0, xs, jit=True)
    tape = tg.trace(f, argnums=(0, 1))(c0, xs)
    (scan,) = [r for r in tape.records if r.primitive == "scan"]
    body_aux = [
        (r.primitive, s.shape, str(s.dtype))
        for r in scan.bodies[0].records
        for s in r.saves
        if s.kind == "aux"
    ]
    assert body_aux == [("custom_jvp_rule", (ROWS, 5), "uint8"), ("reduce_max", (ROWS, 5), "uint8")]
    rep = tg.memory_report(f, argnums=(0, 1))(c0, xs)
    assert rep.beyond_inputs_bytes == _held(f, c0, xs)


def test_policies_see_the_packed_value():
    x = _special()
    f = lambda x: jnp.sum(jax.nn.relu(x) * 3.0)  # noqa: E731
    seen = []
    with tg.saved_tensors_hooks(lambda a: (seen.append((a.shape, a.dtype)), a)[1], lambda a: a):
        g = tg.grad(f)(x)
    assert seen == [((ROWS, 5), np.uint8)]
    want = jax.grad(f)(x)
    np.testing.assert_array_equal(np.asarray(g), np.asarray(want))
    for policy in (P.compress("int8"), P.compress(jnp.bfloat16), P.offload()):
        got = tg.grad(f, policy=policy)(x)  # integers are kept exactly
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
        rep = tg.memory_report(f, policy=policy)(x)
        assert rep.beyond_inputs_bytes == _held(f, x, policy=policy)


def test_relu_mlp_report_equals_live_arrays():
    ws, x = _mlp_args(depth=4, width=64, batch=32)
    f = lambda x: _relu_mlp(ws, x)  # noqa: E731  (weights are constants: only x differentiated)
    rep = tg.memory_report(f)(x)
    held = _held(f, x)
    assert rep.beyond_inputs_bytes == held
    # With the weights constant the matmuls keep nothing of their own: the first three
    # relus keep 64 bits a row (8 bytes); h * h keeps the last relu's output (float32),
    # and that relu reads its mask off it (`custom_jvp._plain`): no fourth mask.
    assert held == 3 * 32 * 8 + 32 * 64 * 4
    g = tg.grad(f)(x)
    np.testing.assert_allclose(np.asarray(g), np.asarray(jax.grad(f)(x)), rtol=1e-6)


_SHARDED = """
import numpy as np, jax, jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
import tapegrad as tg
assert jax.device_count() == 8
mesh = jax.make_mesh((8,), ("d",), axis_types=(jax.sharding.AxisType.Explicit,))

def f(x, y):
    return jnp.sum(jax.nn.relu(x) * y) + jnp.sum(jnp.max(x, axis=-1) ** 2)

rng = np.random.RandomState(0)
for spec, packed in ((P("d", None), True), (P(None, "d"), False)):
    put = lambda a: jax.device_put(np.float32(a), NamedSharding(mesh, spec))
    x, y = put(rng.randn(32, 64)), put(rng.randn(32, 64))
    with jax.set_mesh(mesh):
        tape = tg.trace(f, argnums=(0, 1))(x, y)
        dts = {str(s.dtype) for r in tape.records for s in r.saves if s.kind == "aux"}
        assert dts == ({"uint8"} if packed else {"bool"}), (spec, dts)
        for mode in ("eager", "jit"):
            tg_f, jax_f = tg.grad(f, argnums=(0, 1)), jax.grad(f, argnums=(0, 1))
            if mode == "jit":
                tg_f, jax_f = jax.jit(tg_f), jax.jit(jax_f)
            for g, w in zip(tg_f(x, y), jax_f(x, y)):
                assert g.sharding.is_equivalent_to(w.sharding, 2), (spec, mode, g.sharding)
                np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-6)
print("OK")
"""


def test_sharded_masks_pack_along_unsharded_rows_subprocess():
    proc = run_on_8_cpu_devices(_SHARDED)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("OK"), proc.stderr[-4000:]
