"""`tg.jax_residuals` against jax itself: its bytes are the distinct arrays among the
leaves of `jax.vjp`'s ``vjp_fn``, each row is attributed to this file's lines, and
`compare` lays it beside a `tg.memory_report` with each side's totals."""

from __future__ import annotations

import importlib.util
import inspect
import os
import traceback

import jax
import jax.numpy as jnp
import pytest
from jax.ad_checkpoint import checkpoint_name

import tapegrad as tg
from tapegrad.display.common import WIDTH
from tapegrad.report.compare import compare

HERE = os.path.abspath(__file__)


def _key(x):
    try:
        return x.unsafe_buffer_pointer()
    except Exception:  # noqa: BLE001
        return id(x)


def vjp_bytes(f, *args, argnums=0, has_aux=False):
    """(bytes of the distinct arrays among vjp_fn's leaves, those that are inputs)."""
    nums = (argnums,) if isinstance(argnums, int) else tuple(argnums)

    def partial(*d):
        full = list(args)
        for i, x in zip(nums, d):
            full[i] = x
        return f(*full)

    vjp_fn = jax.vjp(partial, *[args[i] for i in nums], has_aux=has_aux)[1]
    seen = {}
    for leaf in jax.tree_util.tree_leaves(vjp_fn):
        seen.setdefault(_key(leaf), leaf.nbytes)
    inputs = {_key(x) for x in jax.tree_util.tree_leaves(args)}
    return sum(seen.values()), sum(n for k, n in seen.items() if k in inputs)


def lines_of(fn):
    src, start = inspect.getsourcelines(fn)
    return set(range(start, start + len(src)))


def line(src: str) -> int:
    return int(src.rsplit(":", 1)[1].split(" ")[0])


# ------------------------------------------------------------------ models


def mlp(ws, x):
    h = x
    for w in ws:
        h = jnp.tanh(h @ w)
    return jnp.mean(h**2)


def block(p, x):
    mu = jnp.mean(x, -1, keepdims=True)
    h = (x - mu) * jax.lax.rsqrt(jnp.var(x, -1, keepdims=True) + 1e-5)
    att = jax.nn.softmax(h @ p["q"] @ (h @ p["k"]).T / 4.0, axis=-1)
    x = x + att @ h @ p["o"]
    return jnp.mean((x + jax.nn.gelu(x @ p["w1"]) @ p["w2"]) ** 2)


def rnn(p, xs):
    def step(h, x):
        h = jnp.tanh(h @ p["w"] + x @ p["u"])
        return h, h

    h, ys = jax.lax.scan(step, jnp.zeros((xs.shape[1], 8)), xs)
    return jnp.mean(h**2) + jnp.mean(ys)


def named_mlp(ws, x):
    h = x
    for w in ws:
        h = checkpoint_name(jnp.tanh(h @ w), "act")
    return jnp.mean(h**2)


def _k(i):
    return jax.random.key(i)


WS = [jax.random.normal(_k(i), (8, 8)) / 3 for i in range(4)]
X = jax.random.normal(_k(9), (5, 8))
P = {k: jax.random.normal(_k(i), (8, 8)) / 3 for i, k in enumerate(("q", "k", "o", "w1", "w2"))}
R = {"w": jax.random.normal(_k(1), (8, 8)) / 3, "u": jax.random.normal(_k(2), (4, 8))}
XS = jax.random.normal(_k(3), (6, 5, 4))

MODELS = [(mlp, (WS, X)), (block, (P, X)), (rnn, (R, XS))]


@pytest.mark.parametrize("f,args", MODELS, ids=["mlp", "block", "rnn"])
def test_total_bytes_are_the_distinct_leaves_of_vjp_fn(f, args):
    jr = tg.jax_residuals(f)(*args)
    total, inputs = vjp_bytes(f, *args)
    assert jr.total_bytes == total
    assert jr.inputs_bytes == inputs
    assert jr.beyond_inputs_bytes == total - inputs
    assert jr.total_bytes == sum(r.bytes for r in jr.rows)
    assert jr.device_bytes == total and jr.host_bytes == 0
    assert not jr.notes
    # every row is attributed: an input is read, anything else made, on this file's lines
    ours = lines_of(f)  # a scan body's lines are inside its model's
    for r in jr.rows:
        assert r.source.startswith(HERE), r
        assert line(r.source) in ours, r
        assert r.primitive != "?"
        assert r.is_input == (r.primitive == "input")
        if r.is_input:
            assert r.what.startswith("argument ") and r.read_by


def test_rows_say_which_inputs_and_which_primitives():
    jr = tg.jax_residuals(mlp)(WS, X)
    named = {r.what for r in jr.rows if r.is_input}
    # ws[0]'s gradient needs x, not ws[0]; every later layer's needs its weight
    assert named == {"argument ws[1]", "argument ws[2]", "argument ws[3]", "argument x"}
    assert {r.primitive for r in jr.rows if not r.is_input} >= {"tanh"}
    for r in jr.rows:
        assert r.bytes == r.device_bytes == jnp.zeros(r.shape, r.dtype).nbytes


def test_scan_rows_are_charged_to_the_body_line_with_their_steps():
    jr = tg.jax_residuals(rnn)(R, XS)
    tanh = [r for r in jr.rows if r.primitive == "tanh"]
    assert tanh and all(r.steps == 6 and "scan ×6" in r.where for r in tanh)
    assert all(r.shape[0] == 6 for r in tanh)
    assert any(r.what == "carry" and r.primitive == "scan" for r in jr.rows)


def test_nothing_saveable_keeps_only_the_inputs():
    f = jax.checkpoint(mlp, policy=jax.checkpoint_policies.nothing_saveable)
    jr = tg.jax_residuals(f)(WS, X)
    total, inputs = vjp_bytes(f, WS, X)
    assert jr.total_bytes == total == inputs
    assert jr.beyond_inputs_bytes == 0
    assert all(r.is_input for r in jr.rows)


def test_save_only_these_names_keeps_the_named_values():
    pol = jax.checkpoint_policies.save_only_these_names("act")
    f = jax.checkpoint(named_mlp, policy=pol)
    jr = tg.jax_residuals(f)(WS, X)
    total, inputs = vjp_bytes(f, WS, X)
    assert jr.total_bytes == total
    assert jr.beyond_inputs_bytes == total - inputs > 0
    kept = [r for r in jr.rows if not r.is_input]
    assert kept and all(r.primitive == "name" and r.what == "named 'act'" for r in kept)
    assert all(line(r.source) in lines_of(named_mlp) for r in kept)


def test_offloading_policy_counts_host_bytes():
    pol = jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=[],
        names_which_can_be_offloaded=["act"],
        offload_src="device",
        offload_dst="pinned_host",
    )
    f = jax.checkpoint(named_mlp, policy=pol)
    try:
        total, _ = vjp_bytes(f, WS, X)
    except Exception as err:  # noqa: BLE001
        pytest.skip(f"this backend does not offload: {err}")
    jr = tg.jax_residuals(f)(WS, X)
    assert jr.total_bytes == total
    assert jr.host_bytes == sum(r.host_bytes for r in jr.rows)
    if jr.host_bytes:
        assert all(r.primitive == "name" for r in jr.rows if r.host_bytes)


def test_argnums_tuple_and_has_aux():
    jr = tg.jax_residuals(mlp, argnums=(0, 1))(WS, X)
    assert jr.argnums == (0, 1)
    assert (jr.total_bytes, jr.inputs_bytes) == vjp_bytes(mlp, WS, X, argnums=(0, 1))
    assert any(r.what == "argument ws[0]" for r in jr.rows)  # x's gradient needs ws[0]

    def with_aux(ws, x):
        return mlp(ws, x), {"x2": x * 2}

    jr = tg.jax_residuals(with_aux, argnums=1, has_aux=True)(WS, X)
    assert (jr.total_bytes, jr.inputs_bytes) == vjp_bytes(with_aux, WS, X, argnums=1, has_aux=True)
    assert jr.argnums == (1,)


def test_jit_is_looked_into():
    f = jax.jit(mlp)
    jr = tg.jax_residuals(f)(WS, X)
    assert jr.total_bytes == vjp_bytes(f, WS, X)[0]
    made = [r for r in jr.rows if not r.is_input]
    assert made and all("jit 'mlp'" in r.where for r in made)
    assert all(line(r.source) in lines_of(mlp) for r in made)


def test_value_dependent_python_control_flow_keeps_the_bytes():
    def f(x):
        return jnp.sum(jnp.sin(x if x[0] > 0 else -x))

    x = jnp.ones(3)
    jr = tg.jax_residuals(f)(x)
    assert jr.total_bytes == vjp_bytes(f, x)[0]
    assert jr.notes and "could not trace" in jr.notes[0]
    assert "note:" in str(jr)


def test_what_jax_cannot_differentiate_raises_jax_own_error():
    def f(x):
        return jax.lax.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, c[1] * 2.0), (0, x))[
            1
        ].sum()

    with pytest.raises(ValueError, match="Reverse-mode differentiation") as info:
        tg.jax_residuals(f)(jnp.ones(3))
    text = "".join(traceback.format_exception(info.value))
    src, start = inspect.getsourcelines(f)
    assert f'"{HERE}", line {start + 1}' in text  # the user's while_loop line


def test_text_and_html():
    ws = [jax.random.normal(_k(i), (8, 8)) / 3 for i in range(12)]
    jr = tg.jax_residuals(mlp)(ws, X)
    s = str(jr)
    assert all(len(x) <= WIDTH for x in s.splitlines())
    assert f"= {jr.total_bytes:,} B" in s
    assert "⋮" in s  # the layers fold
    assert "test_jax_residuals.py:" in s
    h = jr._repr_html_()
    assert f'data-key="total_bytes" data-v="{jr.total_bytes}"' in h
    assert f'data-key="inputs_bytes" data-v="{jr.inputs_bytes}"' in h
    assert "tg-fold" in h and "By source line" in h


@pytest.mark.parametrize("f,args", MODELS, ids=["mlp", "block", "rnn"])
def test_compare_keeps_each_side_totals(f, args):
    mem = tg.memory_report(f)(*args)
    jr = tg.jax_residuals(f)(*args)
    cmp = compare(mem, jr)
    assert cmp.left.bytes == mem.residual_bytes
    assert cmp.left.inputs_bytes == mem.input_bytes
    assert cmp.right.bytes == jr.total_bytes
    assert cmp.right.beyond_inputs_bytes == jr.beyond_inputs_bytes
    assert sum(r.left.bytes for r in cmp.rows if r.left) == mem.residual_bytes
    assert sum(r.right.bytes for r in cmp.rows if r.right) == jr.total_bytes
    # both programs are the same lines: most of jax's bytes meet a tapegrad row
    both = sum(r.right.bytes for r in cmp.rows if r.left and r.right)
    assert both > 0
    s = str(cmp)
    assert all(len(x) <= WIDTH for x in s.splitlines())
    assert f"{jr.total_bytes:,}" in s and f"{mem.residual_bytes:,}" in s
    h = cmp._repr_html_()
    assert f'data-key="b_bytes" data-v="{jr.total_bytes}"' in h
    assert str(jr.compare(mem)).startswith("compare: (a) jax.vjp")


def test_compare_two_memory_reports():
    a = tg.memory_report(mlp)(WS, X)
    b = tg.memory_report(mlp, policy=tg.policies.compress(jnp.bfloat16))(WS, X)
    cmp = compare(a, b)
    assert (cmp.left.bytes, cmp.right.bytes) == (a.residual_bytes, b.residual_bytes)
    assert cmp.right.compressed_bytes == sum(r.compressed_bytes for r in b.records) > 0
    assert any(r.right and "compress" in r.right.decision for r in cmp.rows)
    assert "tapegrad" in str(cmp)


def _bench_models():
    path = os.path.join(os.path.dirname(os.path.dirname(HERE)), "bench", "_models.py")
    spec = importlib.util.spec_from_file_location("_bench_models", path)
    m = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(m)
    return m


def test_bench_models_match_jax():
    """The benchmark's MLP, transformer block and scanned RNN (as bench/grad_bench.py
    and bench/loop_bench.py build them): jax.vjp keeps 3,014,656 / 11,031,052 /
    13,189,120 bytes for argnums=0."""
    m = _bench_models()
    k1, k2 = jax.random.split(jax.random.key(0), 4)[:2]
    arrays, heads = m.split_static(m.transformer_params(k1))

    def tloss(p, x):
        return m.transformer_loss({**p, "heads": heads}, x)

    ks = jax.random.split(jax.random.key(0), 8)
    cases = [
        (m.mlp_loss, (m.mlp_params(k1, 8, 256), jax.random.normal(k2, (64, 256))), 3_014_656),
        (tloss, (arrays, jax.random.normal(k2, (8, 64, 128))), 11_031_052),
        (m.rnn_loss, (m.rnn_params(ks[0]), jax.random.normal(ks[1], (200, 32, 128))), 13_189_120),
    ]
    for f, args, want in cases:
        jr = tg.jax_residuals(f)(*args)
        assert jr.total_bytes == vjp_bytes(f, *args)[0] == want
        assert not jr.notes and all(r.primitive != "?" for r in jr.rows)
