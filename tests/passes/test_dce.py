"""`tg.passes.dce` and `tg.passes.run`: dead records go, the gradient stays (jax.grad is
the oracle), effects stay, the input tape is untouched, broken passes are named."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tapegrad as tg
from tapegrad.passes import dce, run, validate


def with_dead_code(x, w):
    unused = jnp.sin(x) @ jnp.cos(w)  # dead: never reaches the output
    jnp.exp(unused)  # dead too
    return jnp.sum(jnp.tanh(x @ w) ** 2)


X = jnp.linspace(-1.0, 1.0, 6).reshape(2, 3)
W = jnp.linspace(0.5, -0.5, 12).reshape(3, 4)


def prims(tape):
    return [r.primitive for r in tape.records]


def test_dce_removes_dead_records_and_keeps_the_rest_in_order():
    tape = tg.trace(with_dead_code)(X, W)
    assert {"sin", "cos", "exp"} <= set(prims(tape))
    out = dce(tape)
    assert not {"sin", "cos", "exp"} & set(prims(out))
    assert prims(out) == ["dot_general", "tanh", "integer_pow", "reduce_sum"]
    assert prims(tape).count("dot_general") == 2  # the dead one went too
    assert [r.index for r in out.records] == list(range(len(out.records)))
    validate(out)
    assert out.saved_bytes == tape.saved_bytes  # dead records never save residuals


def test_dce_leaves_its_input_untouched():
    tape = tg.trace(with_dead_code)(X, W)
    before = (tape.records, str(tape))
    dce(tape)
    assert tape.records is before[0] and str(tape) == before[1]


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_gradient_with_dce_equals_jax(jit):
    g = tg.grad(with_dead_code, argnums=(0, 1), passes=[dce])
    g = jax.jit(g) if jit else g
    want = jax.grad(with_dead_code, argnums=(0, 1))(X, W)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7), g(X, W), want)


def test_dce_keeps_side_effects(capsys):
    def f(x):
        jax.debug.print("seen {}", jnp.sum(x))  # no outputs, but an effect
        return jnp.sum(x * 2.0)

    tape = dce(tg.trace(f)(jnp.ones(3)))
    assert "debug_print" in prims(tape)
    assert "reduce_sum" in prims(tape)  # the printed sum feeds the print: kept
    tg.grad(f, passes=[dce])(jnp.ones(3))
    assert "seen 3.0" in capsys.readouterr().out


def test_dce_drops_unused_constants():
    c = jnp.arange(3.0) + 1.0  # a closed-over array becomes a tape constant

    def f(x):
        jnp.sin(c)
        return jnp.sum(x**2)

    tape = tg.trace(f)(jnp.ones(3))
    assert len(tape.consts) == 1
    assert len(dce(tape).consts) == 0


def test_dce_is_idempotent_and_a_no_op_without_dead_code():
    tape = dce(tg.trace(with_dead_code)(X, W))
    again = dce(tape)
    assert prims(again) == prims(tape)


def test_dce_remaps_recompute_segments():
    sel = tg.selective(lambda r: tg.CheckpointPolicy.NEVER)
    tape = tg.trace(with_dead_code, policy=sel)(X, W)
    assert tape.segments
    out = dce(tape)
    validate(out)
    for seg_before, seg_after in zip(tape.segments, out.segments):
        assert [tape.records[k].primitive for k in seg_before.records] == [
            out.records[k].primitive for k in seg_after.records
        ]
    got = tg.grad(with_dead_code, argnums=(0, 1), policy=sel, passes=[dce])(X, W)
    want = jax.grad(with_dead_code, argnums=(0, 1))(X, W)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7), got, want)


def test_run_applies_passes_in_order_and_accepts_partials():
    seen = []

    def spy(tag):
        def p(tape):
            seen.append((tag, len(tape.records)))
            return tape

        return p

    tape = tg.trace(with_dead_code)(X, W)
    run(tape, [spy("a"), dce, spy("b"), functools.partial(tg.passes.check_finite, check_inf=False)])
    assert seen[0] == ("a", len(tape.records)) and seen[1][1] < len(tape.records)
    assert run(tape, None) is tape and run(tape, []) is tape


def test_a_pass_that_breaks_the_tape_is_named():
    def drop_first(tape):
        return dataclasses.replace(tape, records=tape.records[1:])

    with pytest.raises(tg.InvalidTapeError) as ei:
        tg.grad(with_dead_code, passes=[drop_first])(X, W)
    msg = str(ei.value)
    assert "drop_first" in msg and "before it is defined" in msg or "has index" in msg
    assert isinstance(ei.value, ValueError) and isinstance(ei.value, tg.TapegradError)

    with pytest.raises(tg.InvalidTapeError, match="returned NoneType, not a Tape"):
        tg.grad(with_dead_code, passes=[lambda tape: None])(X, W)

    def boom(tape):
        raise KeyError("inside the pass")

    with pytest.raises(KeyError) as ei:
        tg.grad(with_dead_code, passes=[boom])(X, W)
    assert any("tape pass" in n and "boom" in n for n in ei.value.__notes__)
    with pytest.raises(TypeError, match="callables"):
        tg.grad(with_dead_code, passes=[3])(X, W)


def test_validate_catches_misnumbered_and_undefined():
    tape = tg.trace(with_dead_code)(X, W)
    shuffled = dataclasses.replace(tape, records=tape.records[::-1])
    with pytest.raises(tg.InvalidTapeError):
        validate(shuffled)
    renumbered = dataclasses.replace(
        shuffled,
        records=tuple(dataclasses.replace(r, index=i) for i, r in enumerate(shuffled.records)),
    )
    with pytest.raises(tg.InvalidTapeError, match="before it is defined"):
        validate(renumbered)
