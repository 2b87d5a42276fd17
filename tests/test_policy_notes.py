"""Policies that say when they did nothing: `MemoryReport.policy_notes` and a warning once
per policy object, judged against what ``save()`` keeps (the oracle: the same report
under ``save()``, and the bytes each policy really moved)."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import pytest

import tapegrad as tg
from tapegrad import policies as P


def mlp(w, x):
    return jnp.sum(jnp.tanh(x @ w) ** 2)


def linear(w, x):
    return jnp.sum(x @ w)  # backward keeps only x and w: the function's inputs


W, X = jnp.eye(8) * 0.5, jnp.ones((4, 8))


def _report(f, policy):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rep = tg.memory_report(f, policy=policy)(W, X)
    return rep, [str(w.message) for w in caught if issubclass(w.category, UserWarning)]


def test_offload_of_inputs_only_says_it_moved_nothing():
    pol = P.offload()
    rep, warned = _report(linear, pol)
    assert rep.host_bytes == 0 and rep.residual_bytes == rep.input_bytes > 0
    (note,) = rep.policy_notes
    assert "moved no byte to host" in note and "inputs=True" in note
    assert warned == [note]
    assert "policy: " + note[:40] in str(rep) and "policy: " in rep._repr_html_()
    _, again = _report(linear, pol)  # once per policy object
    assert again == []
    rep, _ = _report(linear, P.offload(inputs=True))  # asked to move inputs: it does
    assert rep.host_bytes > 0 and rep.policy_notes == ()


def test_a_policy_that_acts_says_nothing():
    for pol in (
        P.offload(),
        P.compress(jnp.bfloat16),
        P.compress(bits=4, key=jax.random.PRNGKey(0)),
    ):
        rep, warned = _report(mlp, pol)
        assert rep.policy_notes == () and warned == [], pol
    rep, warned = _report(mlp, P.save())
    assert rep.policy_notes == () and warned == []


def test_compress_of_values_already_narrow():
    w, x = W.astype(jnp.bfloat16), X.astype(jnp.bfloat16)
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        rep = tg.memory_report(mlp, policy=P.compress(jnp.bfloat16))(w, x)
    assert sum(r.compressed_bytes for r in rep.records) == 0
    assert len(rep.policy_notes) == 1 and "compressed no residual" in rep.policy_notes[0]


def test_selective_that_matches_nothing_and_one_that_matches():
    never = tg.selective(lambda rec: tg.CheckpointPolicy.PREFER_SAVE)

    def f(w, x):
        return mlp(w, tg.checkpoint(lambda a: jnp.sin(a) * 2.0, policy=never)(x))

    rep, warned = _report(f, None)
    # the policy given to memory_report is save(); a selective policy inside a checkpoint
    # region is not the report's policy: nothing to say
    assert rep.policy_notes == ()
    rep, _ = _report(mlp, never)
    assert len(rep.policy_notes) == 1 and "recomputed nothing" in rep.policy_notes[0]
    recompute = tg.selective(
        lambda rec: (
            tg.CheckpointPolicy.PREFER_RECOMPUTE
            if rec.primitive == "tanh"
            else tg.CheckpointPolicy.PREFER_SAVE
        )
    )
    rep, _ = _report(mlp, recompute)
    assert rep.policy_notes == ()


def test_a_budget_above_saves_bytes_changed_nothing():
    full = tg.memory_report(mlp)(W, X)
    rep, warned = _report(mlp, P.budget(bytes=10 * full.residual_bytes + 4096))
    assert rep.residual_bytes == full.residual_bytes
    assert len(rep.policy_notes) == 1 and "changed nothing" in rep.policy_notes[0]
    assert warned == list(rep.policy_notes)


def test_hooks_are_not_judged():
    pol = P.hooks(lambda v: v, lambda p: p)
    rep, warned = _report(mlp, pol)
    assert rep.policy_notes == () and warned == []


@pytest.mark.parametrize("f", [mlp, linear])
def test_notes_do_not_change_the_figures(f):
    base = tg.memory_report(f)(W, X)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rep = tg.memory_report(f, policy=P.offload())(W, X)
    assert rep.residual_bytes == base.residual_bytes
