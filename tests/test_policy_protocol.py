"""The residual-policy protocol, written down (`tapegrad.core.residual_policy.MEMBERS`):
every built-in policy declares only members of it, a policy that declares nothing works
as `save()` with hooks, and a member of the wrong kind, a near-miss name, a policy without
`unpack` or a plan of the wrong shape is a `TypeError` naming the policy and the member,
raised where the policy is given (never a gradient computed without it); an `exact`
policy whose `unpack(pack(x))` is not `x` is one at the first array it packs."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tapegrad as tg
from tapegrad import policies as P
from tapegrad.core.residual_policy import MEMBERS, capabilities, check_policy, declared, wrapped
from tapegrad.rules.cheap import CHEAP, EXACT_CHEAP


def f(x):
    return jnp.sum(jnp.tanh(x) * jnp.sin(x))


X = jnp.linspace(-1.0, 1.0, 8)


def _builtin():
    return [
        P.save(),
        P.offload(),
        P.offload(prefetch="auto"),
        P.compress(jnp.bfloat16),
        P.compress("int8"),
        P.compress(bits=2, key=jax.random.key(0)),
        P.budget(bytes=1 << 10),
        P.budget(bytes=1 << 10, allow=("save", "recompute", "offload", "compress")),
        tg.selective(lambda r: tg.CheckpointPolicy.PREFER_SAVE, base=P.offload()),
        P.scan_checkpoint(every="sqrt", base=P.offload()),
        P.route(lambda info: P.save()),
        P.hooks(lambda x: x, lambda x: x),
    ]


@pytest.mark.parametrize("policy", _builtin(), ids=repr)
def test_builtin_policies_declare_only_protocol_members(policy):
    check_policy(policy)  # raises on anything else
    for p in wrapped(policy):
        for name in MEMBERS:
            declared(p, name)  # every member reads without error


class Hooks:
    """A policy that declares nothing but pack/unpack: `save()` with hooks."""

    def __init__(self):
        self.packed = 0

    def pack(self, value, info):
        self.packed += 1
        return value * 2

    def unpack(self, packed, info):
        return packed / 2


def test_a_policy_declaring_nothing_works_as_before():
    pol = Hooks()
    got = tg.grad(f, policy=pol)(X)
    np.testing.assert_allclose(got, jax.grad(f)(X), rtol=1e-6)
    assert pol.packed > 0
    caps = capabilities(pol)
    assert (caps.base, caps.choose, caps.decide, caps.plan, caps.loop_segment) == (None,) * 5


def _policy(**members):
    return type("UserPolicy", (Hooks,), members)()


@pytest.mark.parametrize(
    "members, words",
    [
        ({"exact": "yes"}, ["exact='yes'", "bool"]),
        ({"inputs": 1}, ["inputs=1", "bool"]),
        ({"prefetch": -1}, ["prefetch=-1", "int >= 0"]),
        ({"decide": "save"}, ["decide='save'", "callable"]),
        ({"keep_exact": True}, ["'keep_exact'", "did you mean 'keeps_exact'"]),
        ({"loop_segments": lambda self, r: 2}, ["'loop_segments'", "'loop_segment'"]),
        ({"unpack": None}, ["no callable unpack()"]),
    ],
)
def test_bad_members_are_errors_naming_policy_and_member(members, words):
    pol = _policy(**members)
    with pytest.raises(TypeError) as info:
        tg.grad(f, policy=pol)(X)
    msg = str(info.value)
    assert "UserPolicy" in msg and all(w in msg for w in words), msg
    assert pol.packed == 0  # nothing ran


def test_a_wrapped_policy_is_checked_too():
    with pytest.raises(TypeError, match="keep_exact"):
        tg.grad(f, policy=tg.selective(lambda r: True, base=_policy(keep_exact=True)))(X)


def test_a_plan_of_the_wrong_shape_is_an_error():
    class Short(Hooks):
        def plan(self, tape, fixed, rebuilt=frozenset()):
            return ["save"]  # one decision, for a tape of several records

    with pytest.raises(TypeError, match=r"plan\(\) must return one 'save' or 'recompute'"):
        tg.grad(f, policy=Short())(X)


def test_a_plan_of_the_right_shape_is_followed():
    class RecomputeTanh(Hooks):
        def plan(self, tape, fixed, rebuilt=frozenset()):
            return ["recompute" if r.primitive == "tanh" else "save" for r in tape.records]

    pol = RecomputeTanh()
    tape = tg.trace(f, policy=pol)(X)
    assert {r.decision for r in tape.records if r.primitive == "tanh"} == {"recompute"}
    np.testing.assert_allclose(tg.grad(f, policy=pol)(X), jax.grad(f)(X), rtol=1e-6)


def test_one_table_of_cheap_primitives():
    # what backward rebuilds bit for bit is a part of what a plan counts as cheap
    assert EXACT_CHEAP < CHEAP
    assert {"add", "mul", "reshape", "convert_element_type", "concatenate", "iota"} <= EXACT_CHEAP
    assert {"exp", "tanh"} <= CHEAP - EXACT_CHEAP


class Rounds(Hooks):
    """Declares exact but keeps bfloat16: a lie backward would rebuild values from."""

    exact = True

    def pack(self, value, info):
        self.packed += 1
        return value.astype(jnp.bfloat16) if jnp.issubdtype(value.dtype, jnp.floating) else value

    def unpack(self, packed, info):
        return packed.astype(info.dtype)


class Copies(Hooks):
    """Declares exact and is: a copy, bit for bit."""

    exact = True
    unpacked = 0

    def pack(self, value, info):
        self.packed += 1
        return jnp.copy(value)

    def unpack(self, packed, info):
        self.unpacked += 1
        return packed


@pytest.mark.parametrize("wrap", [lambda p: p, lambda p: tg.selective(lambda r: True, base=p)])
def test_an_exact_policy_that_changes_values_is_an_error(wrap):
    pol = Rounds()
    with pytest.raises(TypeError) as info:
        tg.grad(f, policy=wrap(pol))(X)
    msg = str(info.value)
    assert "Rounds" in msg and "exact=True" in msg and "bit for bit" in msg, msg
    assert "test_policy_protocol.py:" in msg  # the residual's line


def test_an_exact_policy_is_checked_eagerly_once():
    pol = Copies()
    want = jax.grad(f)(X)
    np.testing.assert_allclose(tg.grad(f, policy=pol)(X), want, rtol=1e-6)
    # checked against a host copy: the hooks run as often as backward needs, no more
    assert pol.unpacked == pol.packed == 2  # tanh(x), sin(x); x is not given to it
    np.testing.assert_allclose(jax.jit(tg.grad(f, policy=pol))(X), want, rtol=1e-6)
    # Under jit only tracers pass through pack: a lie is found on the first eager call.
    lie = Rounds()
    jax.jit(tg.grad(f, policy=lie))(X)
    with pytest.raises(TypeError, match="exact=True"):
        tg.grad(f, policy=lie)(X)
