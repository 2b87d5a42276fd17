"""Values backward rebuilds from what it keeps anyway (`_rebuild.rebuilt_records`):
a cheap exact op whose operands are all kept is re-run in backward, not kept."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from conftest import assert_trees_close, rand
from conftest import held_after_forward as _held

import tapegrad as tg
from tapegrad.engine import rebuild as _rebuild

P = tg.CheckpointPolicy


def block(p, x):
    """Pre-LN attention-ish block: layer norm, a matmul, a softmax, a matmul."""
    mu = jnp.mean(x, -1, keepdims=True)
    xc = x - mu
    h = xc * jax.lax.rsqrt(jnp.mean(xc**2, -1, keepdims=True) + 1e-5) * p["g"] + p["b"]
    s = h @ p["w"]
    e = jnp.exp(s - jax.lax.stop_gradient(jnp.max(s, -1, keepdims=True)))
    a = e / jnp.sum(e, -1, keepdims=True)
    return jnp.sum(jnp.tanh(a @ p["v"]) ** 2)


def params(d=16, n=12):
    return {
        "g": 1.0 + 0.1 * rand((d,), seed=1),
        "b": 0.1 * rand((d,), seed=2),
        "w": rand((d, n), seed=3) / 4,
        "v": rand((n, d), seed=4) / 4,
    }


def test_layer_norm_output_and_softmax_quotient_are_rebuilt():
    p, x = params(), rand((8, 16), seed=0)
    tape = tg.trace(block, argnums=(0, 1))(p, x)
    prims = [r.primitive for r in tape.records if r.decision == "recompute"]
    # normalised value, * g (+ its broadcast), + b (+ its broadcast), e / s
    assert sorted(prims) == sorted(
        ["mul", "mul", "broadcast_in_dim", "add", "broadcast_in_dim", "div"]
    )
    assert all(not s.prevent_cse for s in tape.segments)  # no barrier under jit
    # Every kept value is one a record saves for its own backward, or an input.
    kept, recomputed = tape.residual_keys()
    # h (for the matmul), h*rsqrt (for dg), g's broadcast (for dh*rsqrt), a (for the matmul)
    assert len(recomputed) == 4


def test_gradients_equal_jax_everywhere():
    p, x = params(), rand((8, 16), seed=0)
    want = jax.grad(block, argnums=(0, 1))(p, x)
    assert_trees_close(tg.grad(block, argnums=(0, 1))(p, x), want)
    out, vjp_fn = tg.vjp(block, p, x)
    assert_trees_close(vjp_fn(jnp.ones_like(out)), want)
    assert_trees_close(jax.jit(tg.grad(block, argnums=(0, 1)))(p, x), want)
    xs = jnp.stack([x, 2 * x])
    assert_trees_close(
        jax.vmap(tg.grad(block, argnums=1), (None, 0))(p, xs),
        jax.vmap(jax.grad(block, argnums=1), (None, 0))(p, xs),
    )
    hess = lambda g: g(lambda x: jnp.sum(g(block, argnums=1)(p, x) ** 2))(x)  # noqa: E731
    assert_trees_close(hess(tg.grad), hess(jax.grad), rtol=1e-4)
    for pol in (tg.policies.offload(), tg.policies.compress(jnp.float32)):
        assert_trees_close(tg.grad(block, argnums=(0, 1), policy=pol)(p, x), want)


def test_rebuilding_frees_exactly_the_rebuilt_values(monkeypatch):
    p, x = params(), rand((8, 16), seed=0)
    vjp = lambda p, x: tg.vjp(block, p, x)  # noqa: E731
    monkeypatch.setattr(_rebuild, "EXACT_CHEAP", frozenset())
    kept_all = _held(vjp, p, x)
    monkeypatch.undo()
    rebuilt = _held(vjp, p, x)
    # h and h * rsqrt (8x16 f32 each), g's broadcast (16) and the softmax a (8x12) are no
    # longer kept.
    assert kept_all - rebuilt == (2 * 8 * 16 + 16 + 8 * 12) * 4, (kept_all, rebuilt)
    tape = tg.trace(block, argnums=(0, 1))(p, x)
    kept, _ = tape.residual_keys()
    inputs = {v.id for v in tape.inputs}
    assert rebuilt == sum(v.nbytes for k, v in kept.items() if k not in inputs)
    assert rebuilt < _held(lambda p, x: jax.vjp(block, p, x), p, x)


def test_a_binding_choice_named_value_or_region_is_not_overridden():
    p, x = params(), rand((8, 16), seed=0)
    keep = tg.selective(lambda r: P.ALWAYS if r.primitive == "div" else P.PREFER_SAVE)
    tape = tg.trace(block, argnums=(0, 1), policy=keep)(p, x)
    assert "div" not in [r.primitive for r in tape.records if r.decision == "recompute"]
    assert "mul" in [r.primitive for r in tape.records if r.decision == "recompute"]

    def named(p, x):
        return block(p, tg.name(x * 2.0, "x2"))

    tape = tg.trace(named, argnums=(0, 1))(p, x)
    assert all(r.decision == "save" for r in tape.records if r.names)

    def regioned(p, x):  # a checkpoint region decides for its own records
        return tg.checkpoint(block, policy=lambda *_, **__: True)(p, x)

    tape = tg.trace(regioned, argnums=(0, 1))(p, x)
    assert all(r.decision == "save" for r in tape.records if r.region is not None)
    assert_trees_close(
        tg.grad(regioned, argnums=(0, 1))(p, x), jax.grad(block, argnums=(0, 1))(p, x)
    )


def test_a_value_whose_operand_is_not_kept_is_kept():
    # exp's input (s - max) is not kept by anyone: the subtraction cannot be rebuilt for
    # free, nor can exp (not a cheap op); tanh's input a @ v is a matmul's output.
    p, x = params(), rand((8, 16), seed=0)
    tape = tg.trace(block, argnums=(0, 1))(p, x)
    by_prim = {r.primitive: r for r in tape.records}
    assert by_prim["exp"].decision == "save" and by_prim["sub"].decision == "save"
    assert by_prim["tanh"].decision == "save"


def test_lossy_policies_rebuild_only_from_values_they_keep_unchanged():
    # Rebuilt from rounded operands, a value compress keeps exact (a divisor, under low
    # bits) would come back rounded: a lossy policy rebuilds only values whose every
    # operand it keeps bit for bit -- here g's broadcast (g is an input compress leaves
    # alone), not the normalised value or the softmax quotient (rounded operands).
    p, x = params(), rand((8, 16), seed=0)

    def rebuilt(policy):
        tape = tg.trace(block, argnums=(0, 1), policy=policy)(p, x)
        return [r for r in tape.records if r.decision == "recompute"]

    assert len(rebuilt(None)) == len(rebuilt(tg.policies.offload())) == 6
    assert len(rebuilt(tg.selective(lambda r: P.PREFER_SAVE))) == 6
    assert len(rebuilt(tg.policies.budget(bytes=1 << 30))) == 6
    g = tg.trace(block, argnums=(0, 1))(p, x).inputs[1]  # params flatten as b, g, v, w
    for lossy in (tg.policies.compress(bits=2), tg.policies.compress(jnp.bfloat16)):
        (rec,) = rebuilt(lossy)
        assert rec.primitive == "broadcast_in_dim" and rec.inputs[0].id == g.id, lossy
    for lossy in (  # these are handed the inputs too: nothing is known unchanged
        tg.policies.compress(bits=2, inputs=True),
        tg.policies.route(lambda i: tg.policies.save()),
        tg.policies.hooks(lambda v: v, lambda v: v),
    ):
        assert rebuilt(lossy) == [], lossy


def test_integer_index_arithmetic_is_rebuilt():
    # take_along_axis turns labels into gather indices with lt / add / select_n /
    # reshape: all exact, all from an input, so the indices are not kept, under any
    # policy that leaves integers alone.
    def xent(w, x, y):
        logits = x @ w
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], 1))

    w, x = rand((16, 10), seed=1), rand((32, 16), seed=2)
    y = jnp.arange(32, dtype=jnp.int32) % 10
    want = jax.grad(xent)(w, x, y)
    for pol in (None, tg.policies.compress(bits=2)):
        tape = tg.trace(xent, policy=pol)(w, x, y)
        gather = next(r for r in tape.records if r.primitive == "gather")
        kept, _ = tape.residual_keys()
        assert gather.inputs[1].id not in kept
        assert {r.primitive for r in tape.records if r.decision == "recompute"} >= {
            "lt",
            "select_n",
            "reshape",
        }
    assert_trees_close(tg.grad(xent)(w, x, y), want)


def test_a_policy_says_what_it_keeps_unchanged_and_wrappers_ask_their_base():
    p, x = params(), rand((8, 16), seed=0)

    def n_rebuilt(policy):
        tape = tg.trace(block, argnums=(0, 1), policy=policy)(p, x)
        return sum(r.decision == "recompute" for r in tape.records)

    class Identity:  # changes nothing, and says so per residual (not with exact = True)
        def pack(self, v, info):
            return v

        def unpack(self, v, info):
            return v

        def keeps_exact(self, info):
            return True

    assert n_rebuilt(Identity()) == n_rebuilt(None) == 6
    wrapped = tg.selective(lambda r: P.PREFER_SAVE, base=tg.policies.compress(bits=2))
    assert n_rebuilt(wrapped) == n_rebuilt(tg.policies.compress(bits=2)) == 1
    assert_trees_close(
        tg.grad(block, argnums=(0, 1), policy=Identity())(p, x),
        jax.grad(block, argnums=(0, 1))(p, x),
    )


def test_one_hot_labels_are_rebuilt_not_kept_or_rounded():
    # jax.nn.one_hot(y) is convert(eq(broadcast(y), iota)): exact ops from an integer
    # input, so the float one-hot the product keeps is rebuilt in backward -- under
    # save() nothing is kept for it, under compress(bits=2) no rounded copy either.
    def f(w, x, y):
        return jnp.sum(jax.nn.one_hot(y, 10) * jnp.tanh(x @ w))

    w, x = rand((16, 10), seed=1), rand((32, 16), seed=2)
    y = jnp.arange(32, dtype=jnp.int32) % 10
    for pol in (None, tg.policies.compress(bits=2)):
        tape = tg.trace(f, policy=pol)(w, x, y)
        mul = next(r for r in tape.records if r.primitive == "mul")
        one_hot = mul.inputs[0]
        assert one_hot.dtype == jnp.float32 and one_hot.shape == (32, 10)
        kept, recomputed = tape.residual_keys()
        assert one_hot.id not in kept and one_hot.id in recomputed
        assert "iota" in [r.primitive for r in tape.records if r.decision == "recompute"]
    # save(): tanh's output (32 x 10 f32) is all that is kept beyond the inputs
    assert tg.memory_report(f)(w, x, y).beyond_inputs_bytes == 32 * 10 * 4
    assert_trees_close(tg.grad(f)(w, x, y), jax.grad(f)(w, x, y))
