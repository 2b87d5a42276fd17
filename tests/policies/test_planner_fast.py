"""The planner's scoring engine (`planner.index.TapeIndex`) against the executor's own
functions: on random plans of chains, DAGs, checkpoint regions, derived residuals and
loops, its segments are `build_segments`', its (peak, flops, kept sizes, per-record
trace) are `planner.problem.simulate`'s and its timelines `planner.joint.timeline`'s on the
planned tape."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tapegrad as tg
from tapegrad.engine.checkpoint import build_segments
from tapegrad.planner import joint, simulate
from tapegrad.planner.index import TapeIndex
from tests.policies.test_budget import Cube, gated, make, residual2
from tests.policies.test_planner_joint import block, layered_dag


def with_aux(ws, x):
    h = Cube.apply(jnp.sin(x @ ws[0]))
    h = h + jnp.tanh(h @ ws[1])
    return jnp.sum(jnp.cos(h) ** 2)


def regions(ws, x):
    layer = tg.checkpoint(lambda h, w: jnp.tanh(jnp.sin(h @ w)))
    h = x
    for w in ws:
        h = h + layer(h, w)
    return jnp.sum(h**2)


def loop(ws, x):
    def body(h, w):
        return jnp.tanh(h @ w), jnp.sum(h)

    h, ys = jax.lax.scan(body, jnp.sin(x), jnp.stack(ws))
    return jnp.sum(jnp.exp(h) ** 2) + jnp.sum(ys)


def _tapes():
    d = 16
    ks = iter(jax.random.split(jax.random.key(3), 16))
    blk = (
        [tuple(jax.random.normal(next(ks), (d, d)) / 4 for _ in range(6))],
        jax.random.normal(next(ks), (8, d)),
    )
    sq = [(8, 8)] * 4
    return {
        "residual2": (residual2, make([(8, 16), (16, 8), (8, 24), (24, 8)])),
        "gated": (gated, make([(8, 16), (8, 16), (16, 8)])),
        "aux": (with_aux, make([(8, 8), (8, 8)])),
        "regions": (regions, make(sq)),
        "loop": (loop, make(sq)),
        "block": (block, blk),
        "dag": (layered_dag(5, 5, 3), (jnp.eye(8) * 0.5, jnp.ones((4, 8)))),
    }


def _seg_sig(segs):
    return [
        (s.id, s.records, tuple(v.id for v in s.inputs), tuple(v.id for v in s.outputs))
        for s in segs
    ]


def _plans(n, seed=0):
    rng = np.random.default_rng(seed)
    plans = [["save"] * n, ["recompute"] * n]
    for p in (0.1, 0.3, 0.5, 0.8):
        plans += [["recompute" if r else "save" for r in rng.random(n) < p] for _ in range(10)]
    return plans


@pytest.mark.parametrize("name", list(_tapes()))
def test_index_scores_as_the_executor(name):
    f, args = _tapes()[name]
    tape = tg.trace(f, argnums=0)(*args)
    n = len(tape.records)
    idx = TapeIndex(tape)
    plans = _plans(n)
    assert any(build_segments(tape, d) for d in plans)
    for dec in plans:
        segs = build_segments(tape, dec)
        assert _seg_sig(idx.segments(dec)) == _seg_sig(segs)
        planned = dataclasses.replace(tape, segments=segs)
        t_ref: dict = {}
        t_idx: dict = {}
        ref = simulate(planned, {}, t_ref)
        got = idx.simulate(dec, t_idx)
        assert got[:2] == ref[:2], dec
        assert got[2] == ref[2] and list(got[2]) == list(ref[2])
        assert t_idx == t_ref


@pytest.mark.parametrize("name", list(_tapes()))
def test_index_timeline_is_the_tapes(name):
    f, args = _tapes()[name]
    tape = tg.trace(f, argnums=0)(*args)
    idx = TapeIndex(tape)
    plans = _plans(len(tape.records), seed=1)
    assert any(build_segments(tape, d) for d in plans)
    for dec in plans:
        planned = dataclasses.replace(tape, segments=build_segments(tape, dec))
        for prefetch in (0, 1, 3):
            ref = joint.timeline(planned, prefetch, {})
            got = idx.timeline(idx.segments(dec), prefetch)
            for field in dataclasses.fields(ref):
                a, b = getattr(got, field.name), getattr(ref, field.name)
                if isinstance(b, np.ndarray):
                    assert a.dtype == b.dtype and np.array_equal(a, b), (field.name, dec)
                else:
                    assert type(a) is type(b) and a == b, (field.name, dec)
            assert got.keys == ref.keys  # the same keys in the same order
            assert all(u is v for u, v in zip(got.vars, ref.vars))


@pytest.mark.parametrize("name", ["residual2", "regions", "block", "dag"])
def test_plans_that_build_the_same_segments_share_their_scores(name):
    # `TapeIndex` keeps segments, simulate's scores and timelines by the recomputed
    # records backward needs: a plan that recomputes other records too (nothing reads
    # them) gets the very same objects, and what comes back from the memo, in any order,
    # is still the executor's.
    f, args = _tapes()[name]
    tape = tg.trace(f, argnums=0)(*args)
    idx = TapeIndex(tape)
    plans = _plans(len(tape.records), seed=2)
    shared = 0
    for dec in plans + plans[::-1]:
        needed = idx._needed(dec)
        lean = ["save" if i not in needed else d for i, d in enumerate(dec)]
        if lean != dec:
            shared += 1
            assert idx.segments(lean) is idx.segments(dec)
            assert idx.simulate(lean) is idx.simulate(dec)
            assert idx.timeline(idx.segments(lean), 1) is idx.timeline(idx.segments(dec), 1)
        planned = dataclasses.replace(tape, segments=build_segments(tape, dec))
        assert _seg_sig(idx.segments(dec)) == _seg_sig(planned.segments)
        assert idx.simulate(dec)[:2] == simulate(planned, {})[:2]
        ref = joint.timeline(planned, 1, {})
        got = idx.timeline(idx.segments(dec), 1)
        assert np.array_equal(got.release, ref.release) and np.array_equal(got.unpack, ref.unpack)
        assert np.array_equal(got.fixed, ref.fixed) and got.keys == ref.keys
    assert shared > 0  # the point: some plans recompute records nothing needs


def test_a_thousand_record_tape_plans_within_a_bounded_search():
    # A 300-layer MLP with residual adds (~900 records): the search simulates a bounded
    # number of plans (work, not wall clock), with the default allow and all four.
    from tapegrad.planner import Budget, estimate, scorer
    from tests.policies.test_planner_joint import COSTS

    def deep(ws, x):
        h = x
        for w in ws:
            h = h + jnp.tanh(h @ w)
        return jnp.sum(h**2)

    rng = np.random.default_rng(1)
    ws = [jnp.asarray(w, jnp.float32) for w in rng.normal(size=(300, 16, 16)) / 4]
    tape = tg.trace(deep, argnums=0)(ws, jnp.asarray(rng.normal(size=(8, 16)), jnp.float32))
    n = len(tape.records)
    assert n >= 900
    full = estimate(tape)[0]
    bound = 2 * max(scorer.MIN_SCORES, scorer.WORK // n) + 4  # two searches at most
    for kw in ({}, dict(allow=("save", "recompute", "offload", "compress"), max_error="int8")):
        pol = Budget(int(full * 0.4), costs=COSTS, **kw)
        dec = pol.plan(tape, [None] * n)
        assert pol.last["plans_scored"] <= bound, pol.last
        assert pol.last["peak_bytes"] <= pol.bytes
        # the plan is what it says: the executor's schedule agrees
        planned = dataclasses.replace(tape, segments=build_segments(tape, dec))
        peak, flops, _ = simulate(planned)
        assert flops == pol.last["recompute_flops"]
        if not kw:
            assert peak == pol.last["peak_bytes"]
        assert "recompute" in dec
