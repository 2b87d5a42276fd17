"""The joint planner (`budget(allow=("save", "recompute", "offload", "compress"))`):
gradients equal jax.grad for every plan; the predicted device peak matches the peak
measured from `jax.live_arrays()` eagerly; the measured peak never rises as the
budget tightens; the plan is on or below the Pareto front of single-mechanism
policies and of `jax.checkpoint_policies`; an infeasible budget names the minimum;
the greedy mechanism assignment is within 5% of the exact ILP (highspy) and of brute
force on small DAGs."""

from __future__ import annotations

import itertools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tapegrad as tg
from tapegrad.core.residual_policy import resolve_prefetch
from tapegrad.planner import estimate, joint
from tapegrad.planner.cost import CostModel, compressed_nbytes, device_nbytes
from tapegrad.planner.measure import measured_peak
from tapegrad.planner.scorer import Scorer

P = tg.policies
ALL = ("save", "recompute", "offload", "compress")
# Fixed figures, so plans do not depend on a calibration of the machine running the tests.
COSTS = CostModel(
    flops_per_s=5e10, d2h_bytes_per_s=5e9, h2d_bytes_per_s=5e9, compress_bytes_per_s=2e9
)


def mlp(ws, x):
    h = x
    for w in ws:
        h = jnp.tanh(h @ w)
    return jnp.sum(h**2)


def _norm(x):
    m = jnp.mean(x, axis=-1, keepdims=True)
    return (x - m) * jax.lax.rsqrt(jnp.mean((x - m) ** 2, axis=-1, keepdims=True) + 1e-5)


def block(ps, x):
    """Pre-norm transformer-ish blocks: attention and an MLP on a residual stream."""
    for wq, wk, wv, wo, w1, w2 in ps:
        h = _norm(x)
        a = jax.nn.softmax((h @ wq) @ (h @ wk).T / 4.0, axis=-1)
        x = x + (a @ (h @ wv)) @ wo
        x = x + jnp.tanh(_norm(x) @ w1) @ w2
    return jnp.sum(x**2)


@pytest.fixture(scope="module")
def mlp_model():
    ks = jax.random.split(jax.random.key(0), 9)
    return [jax.random.normal(k, (64, 64)) / 8 for k in ks[:8]], jax.random.normal(ks[8], (32, 64))


@pytest.fixture(scope="module")
def block_model():
    ks = iter(jax.random.split(jax.random.key(1), 7))
    d, f = 32, 64
    ps = [
        tuple(
            jax.random.normal(next(ks), s) / np.sqrt(s[0])
            for s in [(d, d), (d, d), (d, d), (d, d), (d, f), (f, d)]
        )
        for _ in range(1)
    ]
    return ps, jax.random.normal(next(ks), (16, d))


def save_peak(f, args):
    tape = tg.trace(f, argnums=0)(*args)
    return estimate(tape)[0]


def planned(f, args, bytes, **kw):
    pol = P.budget(bytes, costs=COSTS, **kw)
    tg.trace(f, argnums=0)(*args)  # noqa: B018 (trace only)
    return pol


MODES = [
    ("recompute", ("save", "recompute"), None),
    ("offload", ("save", "offload"), None),
    ("all-lossless", ALL, None),
    ("all-bf16", ALL, "bf16"),
    ("all-int8", ALL, "int8"),
]


CASES = [("mlp", m) for m in MODES] + [("block", MODES[0]), ("block", MODES[3])]


@pytest.mark.parametrize("model,mode", CASES, ids=[f"{c[0]}-{c[1][0]}" for c in CASES])
def test_gradients_equal_jax_and_predicted_peak_is_measured(model, mode, mlp_model, block_model):
    _, allow, max_error = mode
    f, args = (mlp, mlp_model) if model == "mlp" else (block, block_model)
    want = jax.grad(f)(*args)
    full = save_peak(f, args)
    lossy = max_error is not None
    tried = 0
    for frac in (0.75, 0.5, 0.3) if model == "mlp" else (0.8, 0.7, 0.55):
        pol = P.budget(int(full * frac), allow=allow, max_error=max_error, costs=COSTS)
        try:
            got = tg.grad(f, policy=pol)(*args)
        except P.BudgetError:
            assert frac <= 0.55  # below what these mechanisms can reach
            continue
        tried += 1
        tol = dict(rtol=5e-2, atol=5e-2) if lossy else dict(rtol=1e-5, atol=1e-5)
        chex.assert_trees_all_close(got, want, **tol)
        predicted = pol.last["peak_bytes"]
        assert predicted <= pol.bytes
        measured = measured_peak(f, args, pol)
        assert abs(measured - predicted) <= 0.05 * predicted, (frac, measured, predicted)
    assert tried >= 2


def test_plans_use_every_mechanism_they_are_allowed(mlp_model):
    full = save_peak(mlp, mlp_model)
    kinds = set()
    for frac in (0.7, 0.5, 0.3):
        pol = P.budget(
            int(full * frac), allow=("save", "offload", "compress"), max_error="int8", costs=COSTS
        )
        tg.grad(mlp, policy=pol)(*mlp_model)
        kinds |= set(pol.last["mechanisms"])
    assert {"offload"} <= kinds
    # lossless only: never a compressed residual
    pol = P.budget(int(full * 0.3), allow=ALL, costs=COSTS)
    tg.grad(mlp, policy=pol)(*mlp_model)
    assert not {"bf16", "int8"} & set(pol.last["mechanisms"])
    # offload slow, compress fast: compress is chosen where it applies
    slow = CostModel(5e10, 1e6, 1e6, 1e12)
    pol = P.budget(int(full * 0.7), allow=ALL, max_error="bf16", costs=slow)
    tg.grad(mlp, policy=pol)(*mlp_model)
    assert set(pol.last["mechanisms"]) == {"save", "bf16"}


def test_gradients_under_jit_equal_jax(mlp_model):
    full = save_peak(mlp, mlp_model)
    slow_flops = CostModel(1e8, 5e9, 5e9, 2e9)  # recompute dear: offload is chosen
    pol = P.budget(int(full * 0.4), allow=ALL, costs=slow_flops)
    jitted = jax.jit(tg.grad(mlp, policy=pol))(*mlp_model)
    assert pol.last["mechanisms"].get("offload", 0) > 0
    chex.assert_trees_all_close(jitted, jax.grad(mlp)(*mlp_model), rtol=1e-5, atol=1e-5)


def test_measured_peak_never_rises_as_the_budget_tightens(mlp_model):
    full = save_peak(mlp, mlp_model)
    budgets = np.linspace(full, full * 0.26, 20).astype(int)
    peaks = []
    for b in budgets:
        pol = P.budget(int(b), allow=ALL, max_error="bf16", costs=COSTS)
        peaks.append(measured_peak(mlp, mlp_model, pol))
        assert peaks[-1] <= b * 1.0001
    assert all(b <= a for a, b in zip(peaks, peaks[1:])), peaks


def test_a_dag_meets_every_budget_down_to_a_quarter_as_predicted():
    """A random DAG of tanh/sin/matmul nodes (`bench/planner_bench.py`'s): over 20
    tightening budgets, every one has a plan, and the peak measured from live arrays is
    the predicted one, under the budget, never rising. Two regressions this caught:
    values backward rebuilds for free were binding "recompute" for the planner (so it
    could not keep the one rebuilt value instead of its operands: no plan below 57%),
    and backward held each record's cotangents into the next record's recomputation."""
    f = layered_dag(3, layers=6, width=3)
    args = (jnp.eye(64) * 0.5, jax.random.normal(jax.random.key(3), (32, 64)))
    full = save_peak(f, args)
    peaks = []
    for b in np.linspace(full, full * 0.25, 20).astype(int):
        pol = P.budget(int(b), allow=ALL, max_error="bf16", costs=COSTS)
        measured = measured_peak(f, args, pol)
        assert measured == pol.last["peak_bytes"] <= b, (b, measured, pol.last["peak_bytes"])
        peaks.append(measured)
    assert all(q <= p for p, q in zip(peaks, peaks[1:])), peaks
    assert peaks[-1] <= full * 0.25


def _single(f, args, column: int, costs: CostModel, policy) -> tuple[float, int]:
    """(predicted seconds, predicted peak) of one mechanism applied to every residual;
    the seconds include rebuilding the values an exact policy rebuilds in backward
    (`_rebuild.rebuilt_records`)."""
    tape = tg.trace(f, argnums=0, policy=policy)(*args)
    tl = joint.timeline(tape, prefetch=resolve_prefetch(policy, tape))
    opts = joint.options(tl, (joint.COLUMNS[column],), costs)
    choice = np.where(opts.valid[:, column], column, 0)
    peak, secs = joint.evaluate(tl, opts, choice)
    return secs + costs.recompute_s(estimate(tape)[1]), peak


@pytest.mark.parametrize("model", ["mlp", "block"])
def test_plan_is_on_or_below_the_pareto_front_of_single_policies(model, mlp_model, block_model):
    f, args = (mlp, mlp_model) if model == "mlp" else (block, block_model)
    points = {}
    for name, col, pol in [
        ("save", 0, P.save()),
        ("offload", 1, P.offload()),
        ("bf16", 2, P.compress(jnp.bfloat16)),
    ]:
        secs, peak = _single(f, args, col, COSTS, pol)
        assert abs(measured_peak(f, args, pol) - peak) <= 0.05 * peak, name
        points[name] = (secs, peak)
    cps = jax.checkpoint_policies
    names = ["dots_saveable"] if model == "block" else ["nothing_saveable", "dots_saveable"]
    for name in names:
        g = tg.checkpoint(f, policy=getattr(cps, name))
        peak, flops = estimate(tg.trace(g, argnums=0)(*args))
        points[name] = (COSTS.recompute_s(flops), peak)
    for name, (secs, peak) in points.items():
        pol = P.budget(peak, allow=ALL, max_error="bf16", costs=COSTS)
        tg.grad(f, policy=pol)(*args)
        assert pol.last["peak_bytes"] <= peak, name
        assert pol.last["time_s"] <= secs * (1 + 1e-9) + 1e-12, (name, pol.last["time_s"], secs)


def test_infeasible_budget_names_the_minimum(mlp_model):
    full = save_peak(mlp, mlp_model)
    with pytest.raises(P.BudgetError, match="smallest peak among the plans tried is") as e:
        tg.grad(mlp, policy=P.budget(full // 20, allow=ALL, costs=COSTS))(*mlp_model)
    floor = int(str(e.value).split("tried is ")[1].split(" bytes")[0].replace(",", ""))
    assert full // 20 < floor < full
    pol = P.budget(floor, allow=ALL, costs=COSTS)  # the minimum named is reachable
    tg.grad(mlp, policy=pol)(*mlp_model)
    assert pol.last["peak_bytes"] <= floor
    with pytest.raises(ValueError, match="allow must name"):
        P.budget(full, allow=("save", "teleport"))
    with pytest.raises(ValueError, match="max_error"):
        P.budget(full, allow=ALL, max_error="int4")


@pytest.mark.parametrize("allow", [("save",), ("save", "compress")])
def test_a_budget_without_recompute_never_recomputes(mlp_model, allow):
    """allow= without "recompute" and no mechanism left (compress is lossy, max_error
    None): save is the only plan, so a budget below it fails instead of recomputing."""
    full = save_peak(mlp, mlp_model)
    with pytest.raises(P.BudgetError, match=f"{full:,}"):
        tg.grad(mlp, policy=P.budget(full // 2, allow=allow))(*mlp_model)
    pol = P.budget(full, allow=allow)
    tg.grad(mlp, policy=pol)(*mlp_model)
    assert pol.last["recompute_flops"] == 0 and pol.last["peak_bytes"] == full


def test_default_budget_is_unchanged_save_recompute(mlp_model):
    full = save_peak(mlp, mlp_model)
    pol = P.budget(full // 2)
    tg.grad(mlp, policy=pol)(*mlp_model)
    assert pol.last["plan"] == "chain DP" and not pol.packs


def test_cost_model_bytes():
    from tapegrad.core.tape import Var

    v = Var(0, (32, 64), np.dtype(np.float32))
    assert device_nbytes(v) == v.nbytes
    assert compressed_nbytes("bf16", v.shape, v.dtype, v.nbytes) == v.nbytes // 2
    n = 32 * 64  # int8 blocks: one byte a value, one code per 16, one float32 scale
    assert compressed_nbytes("int8", v.shape, v.dtype, v.nbytes) == n + n // 16 + 4
    assert compressed_nbytes("int8", (4,), np.dtype(np.int32), 16) is None
    packed = P.compress("int8").pack(jnp.ones((32, 64)), _info(v))
    assert sum(x.nbytes for x in jax.tree.leaves(packed)) == n + n // 16 + 4
    c = P.calibrate(size=128, mbytes=1, repeats=2)
    assert c.measured and c.flops_per_s > 0 and c.d2h_bytes_per_s > 0
    assert P.calibrate() is c  # cached per backend


def test_calibrate_grows_the_matmul_past_launch_latency(monkeypatch):
    """A small product measures launch latency on an accelerator (an H100: 3.5e12 flop/s
    from a 512-square product, ~100x under its rate); calibrate() doubles the size until
    a product takes a millisecond. Here a fake clock: 20 us latency + 1e14 flop/s."""
    from tapegrad.planner import cost as _cost

    def fake_best_of(fn, repeats):
        a = (getattr(fn, "__defaults__", None) or (None,))[0]
        if getattr(a, "ndim", 0) == 2:  # the matmul probe: 8 products back to back
            n = a.shape[0]
            return 8 * (20e-6 + 2.0 * n**3 / 1e14)
        return 1e-3

    monkeypatch.setattr(_cost, "_best_of", fake_best_of)
    monkeypatch.setattr(_cost, "_CALIBRATED", {})
    c = _cost.calibrate()
    assert 0.95e14 < c.flops_per_s <= 1e14  # 4096-square: 1.37 ms a product
    fixed = _cost.calibrate(force=True, size=512)
    assert fixed.flops_per_s < 0.15e14  # what the 512-square probe alone reads


def test_segment_cost_trades_flops_for_fewer_segments():
    """Under jit each recomputed segment is a kernel of its own (its barrier splits the
    fusion): on an H100 a 0.27 GFLOP plan in 36 segments cost 5% of the step, and with
    `CostModel.segment_s` = 5 us the 50%-budget plan went from 1.16x to 1.07x save()'s
    step. With the cost, the planner takes fewer segments for more flops, and its plan
    is the cheaper one by flops + segments x the cost."""
    ks = iter(jax.random.split(jax.random.key(1), 20))
    d, f = 32, 64
    shapes = [(d, d), (d, d), (d, d), (d, d), (d, f), (f, d)]
    ps = [tuple(jax.random.normal(next(ks), s) / np.sqrt(s[0]) for s in shapes) for _ in range(3)]
    x = jax.random.normal(next(ks), (16, d))
    tape = tg.trace(block)(ps, x)
    save = tg.memory_report(block, policy=P.save())(ps, x).beyond_inputs_bytes
    n = len(tape.records)
    got = {}
    for seg_s in (0.0, 5e-6):
        costs = CostModel(1e12, 1e10, 1e10, 1e11, "gpu", segment_s=seg_s)
        pol = P.budget(bytes=int(0.75 * save), costs=costs)
        dec = tuple(pol.plan(tape, [None] * n))
        plain = Scorer(tape, [None] * n, pol.bytes)  # no segment cost: raw flops
        peak, flops = plain.score(dec)
        segs = len(plain.planned(dec).segments)
        assert peak <= pol.bytes
        assert pol.last["recompute_flops"] == pytest.approx(flops)
        assert pol.last["recompute_segments"] == segs
        got[seg_s] = (segs, flops)
    (n0, f0), (n5, f5) = got[0.0], got[5e-6]
    assert n5 < n0 and f5 > f0
    per_seg = 5e-6 * 1e12
    assert f5 + n5 * per_seg < f0 + n0 * per_seg


def _info(v):
    from tapegrad.core.tape import Saved

    s = Saved("out", 0, v.shape, v.dtype)
    return P.ResidualInfo(None, s, v.shape, v.dtype)


# ---------------------------------------------------------------- greedy vs exact


def layered_dag(seed: int, layers: int, width: int, fan: int = 2):
    """A random layered DAG: each node combines nodes of earlier layers (matmul, tanh,
    products, sums), like residual streams and U-Net skips."""
    rng = np.random.default_rng(seed)
    plan = []
    for li in range(layers):
        row = []
        for _ in range(width):
            srcs = rng.integers(0, li + 1, size=fan)  # layer index (0 = input)
            picks = [int(rng.integers(0, width if s > 0 else 1)) for s in srcs]
            row.append((list(zip(srcs.tolist(), picks)), int(rng.integers(0, 3))))
        plan.append(row)

    def f(w, x):
        nodes = [[x]]
        for row in plan:
            out = []
            for srcs, op in row:
                a, b = (nodes[s][p] for s, p in srcs)
                if op == 0:
                    out.append(jnp.tanh(a @ w) + b)
                elif op == 1:
                    out.append(jnp.sin(a) * b)
                else:
                    out.append(jnp.tanh(a + b))
            nodes.append(out)
        return sum(jnp.sum(n**2) for n in nodes[-1])

    return f


def _layer(tape, sc, dec, mechanisms):
    tl = joint.timeline(sc.planned(dec), prefetch=1)
    return tl, joint.options(tl, mechanisms, COSTS)


def test_greedy_is_within_five_percent_of_brute_force_on_a_small_dag():
    f = layered_dag(0, 2, 2)
    w, x = jnp.eye(8) * 0.5, jnp.ones((4, 8))
    tape = tg.trace(f)(w, x)
    sc = Scorer(tape, [None] * len(tape.records), 1 << 60)
    tl, opts = _layer(tape, sc, ("save",) * len(tape.records), ("offload", "bf16"))
    K = len(tl.keys)
    assert 5 <= K <= 10
    choices = [
        np.array(c) for c in itertools.product(*[np.nonzero(opts.valid[k])[0] for k in range(K)])
    ]
    scored = [joint.evaluate(tl, opts, c) for c in choices]
    peaks = sorted({p for p, _ in scored})
    for b in peaks[:: max(1, len(peaks) // 12)]:
        best = min(s for p, s in scored if p <= b)
        got = joint.assign_greedy(tl, opts, b)
        assert got is not None
        peak, secs = joint.evaluate(tl, opts, got)
        assert peak <= b and secs <= best * 1.05 + 1e-12, (b, secs, best)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_greedy_is_within_five_percent_of_the_ilp_on_random_dags(seed):
    pytest.importorskip("highspy")
    from tapegrad.planner.ilp import mechanisms as ilp

    f = layered_dag(seed, layers=5, width=3)
    w, x = jnp.eye(16) * 0.5, jnp.ones((8, 16))
    tape = tg.trace(f)(w, x)
    assert 30 <= len(tape.records) <= 60
    n = len(tape.records)
    sc = Scorer(tape, [None] * n, 1 << 60)
    for dec in [
        ("save",) * n,
        tuple("save" if r.primitive == "dot_general" else "recompute" for r in tape.records),
    ]:
        tl, opts = _layer(tape, sc, dec, ("offload", "bf16", "int8"))
        lo = joint.least_bytes(tl, opts)
        hi = joint.evaluate(tl, opts, np.zeros(len(tl.keys), np.int64))[0]
        for b in np.linspace(hi, lo, 6).astype(int)[1:]:
            exact = ilp.solve(tl, opts, int(b))
            greedy = joint.assign_greedy(tl, opts, int(b))
            if exact is None:
                assert greedy is None
                continue
            assert greedy is not None, b
            pe, se = joint.evaluate(tl, opts, exact)
            pg, sg = joint.evaluate(tl, opts, greedy)
            assert pe <= b and pg <= b
            assert sg <= se * 1.05 + 1e-12, (b, sg, se)


def _random_instance(rng, K=7, T=12):
    """A synthetic timeline: K residuals of 1..64 KiB, held over random intervals, with
    save / offload / bf16 (/ int8 on some) at seconds proportional to their bytes (the
    ratios of `COSTS`: offload frees a byte for less time than compression)."""
    full = (2 ** rng.integers(0, 7, K)) * 1024
    release = rng.integers(1, T, K)
    unpack = np.array([rng.integers(1, r + 2) for r in release])
    fixed = rng.integers(0, 4, T) * 1024
    tl = joint.Timeline(list(range(K)), [None] * K, full, release, unpack, fixed, 0.0)
    M = len(joint.COLUMNS)
    S, C = np.zeros((K, M), np.int64), np.zeros((K, M), np.int64)
    sec, ok = np.zeros((K, M)), np.zeros((K, M), bool)
    S[:, 0], ok[:, 0] = full, True
    S[:, 1], C[:, 1], sec[:, 1], ok[:, 1] = 0, full, full * 4e-10, True
    S[:, 2], C[:, 2], sec[:, 2], ok[:, 2] = full // 2, full, full * 5e-10, True
    S[:, 3], C[:, 3], sec[:, 3], ok[:, 3] = full // 4, full, full * 6e-10, rng.random(K) < 0.5
    return tl, joint.Options(S, C, sec, ok)


def _every_choice(tl, opts):
    """(peak, seconds) of every assignment (brute force)."""
    K = len(tl.keys)
    combos = np.array(list(itertools.product(*[np.nonzero(opts.valid[k])[0] for k in range(K)])))
    t = np.arange(tl.points)
    held = (t <= tl.release[:, None])[:, None, :]
    copy = ((t >= tl.unpack[:, None]) & (t <= tl.release[:, None]))[:, None, :]
    per = opts.stored[:, :, None] * held + opts.copied[:, :, None] * copy  # (K, M, T)
    live = tl.fixed + per[np.arange(K), combos].sum(axis=1)
    return live.max(axis=1), opts.seconds[np.arange(K), combos].sum(axis=1)


def test_greedy_is_near_brute_force_where_little_must_move():
    """Budgets a little under a plan's peak: bytes per second ties between residuals of
    one mechanism, and the greedy took the largest (offloading a 64 KiB residual where
    1 KiB over the budget needed moving: up to 64x the optimum, 3.1x on average here).
    It counts freed bytes only up to the excess now, and exchanges pairs of changes
    after: within 2% of brute force on average, 35% at worst. And it fits whenever
    `least_bytes` does."""
    rng = np.random.default_rng(0)
    ratios = []
    for _ in range(40):
        tl, opts = _random_instance(rng)
        peaks, secs = _every_choice(tl, opts)
        floor = joint.least_bytes(tl, opts)
        budgets = np.unique(peaks)
        for b in budgets[:: max(1, len(budgets) // 10)].tolist() + [floor]:
            got = joint.assign_greedy(tl, opts, int(b))
            if b < floor:
                continue  # None allowed (only there)
            assert got is not None, b
            peak, s = joint.evaluate(tl, opts, got)
            assert peak <= b
            best = secs[peaks <= b].min()
            ratios.append(s / best if best > 0 else (1.0 if s <= 0 else np.inf))
    ratios = np.array(ratios)
    assert len(ratios) > 300
    assert ratios.mean() <= 1.02 and ratios.max() <= 1.35, (ratios.mean(), ratios.max())


def test_greedy_alone_fits_whenever_a_plan_can(monkeypatch):
    """Without highspy (as in CI) the greedy completion is all there is: under costs where
    its steps trade bytes at one point for bytes at another, it stalled and the budget
    raised BudgetError below a peak it had itself found (seen with calibrated figures).
    Now it falls back to every residual at its fewest bytes and buys time back."""
    import sys

    monkeypatch.setattr(sys.modules["tapegrad.planner.candidates"], "_ilp_solver", lambda t: None)
    # nor the exact chain program (this model is a chain): the greedy alone must fit
    monkeypatch.setattr(sys.modules["tapegrad.planner.candidates"], "_chain_joint", lambda *a: [])

    def model(params, x):
        for w in params:
            x = jnp.tanh(x @ w)
        return jnp.mean(x**2)

    keys = jax.random.split(jax.random.key(0), 9)
    params = [jax.random.normal(k, (64, 64)) / 8 for k in keys[:8]]
    x = jax.random.normal(keys[8], (32, 64))
    tape = tg.trace(model)(params, x)
    full = tg.memory_report(model)(params, x).beyond_inputs_bytes
    rng = np.random.RandomState(0)
    for _ in range(60):
        fl, d2h, h2d, cb = 10.0 ** rng.uniform(2, 18, size=4)
        costs = CostModel(
            flops_per_s=fl, d2h_bytes_per_s=d2h, h2d_bytes_per_s=h2d, compress_bytes_per_s=cb
        )
        budget = int(full * rng.choice(np.linspace(1.0, 0.25, 12)))
        pol = tg.policies.budget(
            bytes=budget,
            allow=("save", "recompute", "offload", "compress"),
            max_error="bf16",
            costs=costs,
        )
        pol.plan(tape, [None] * len(tape.records))
        assert pol.last["peak_bytes"] <= budget, (pol.last, budget)


def test_least_seconds_is_a_lower_bound_on_every_fitting_choice():
    """`least_seconds` lets the joint descent skip completing plans that cannot beat the
    best so far: it must be at most the fastest choice that fits (brute force), and
    infinite only where none fits; and it is not trivially zero."""
    rng = np.random.default_rng(1)
    ratios, infinite = [], 0
    for _ in range(40):
        tl, opts = _random_instance(rng)
        peaks, secs = _every_choice(tl, opts)
        for b in np.unique(peaks)[::3].tolist() + [int(peaks.min()) - 1]:
            bound = joint.least_seconds(tl, opts, int(b))
            fits = peaks <= b
            if not fits.any():
                continue  # any bound holds (inf or not)
            best = secs[fits].min()
            assert bound <= best * (1 + 1e-12), (b, bound, best)
            if best > 0:
                ratios.append(bound / best)
            got = joint.assign_greedy(tl, opts, int(b))
            assert bound <= joint.evaluate(tl, opts, got)[1] * (1 + 1e-12)
        below = joint.least_seconds(tl, opts, int(peaks.min()) - 1)  # nothing fits
        infinite += below == np.inf
    ratios = np.array(ratios)
    # here: 956 budgets, the bound at 0.79 of the optimum on average; 2 infeasible seen
    assert len(ratios) > 500 and ratios.mean() > 0.6, (len(ratios), ratios.mean())
    assert infinite > 0


def test_live_bytes_is_the_sum_over_held_keys_at_every_point():
    """`joint.live_bytes` against its definition, point by point: a key's stored bytes
    are held from forward's end to its release, its copy's from its unpack point to its
    release; byte counts up to 2**44 (it sums in float64, exact below 2**53)."""
    import types

    rng = np.random.default_rng(0)
    for _ in range(200):
        K, T = int(rng.integers(0, 12)), int(rng.integers(1, 16))
        release = rng.integers(0, T, K)
        unpack = np.minimum(rng.integers(0, T + 1, K), release + 1)  # never: release + 1
        tl = types.SimpleNamespace(
            points=T, release=release, unpack=unpack, fixed=rng.integers(0, 2**40, T)
        )
        stored, copied = rng.integers(0, 2**44, K), rng.integers(0, 2**44, K)
        t = np.arange(T)[:, None]
        want = tl.fixed + (stored * (t <= release)).sum(1)
        np.testing.assert_array_equal(joint.live_bytes(tl, stored), want)
        want += (copied * ((unpack <= t) & (t <= release))).sum(1)
        got = joint.live_bytes(tl, stored, copied)
        assert got.dtype == np.int64
        np.testing.assert_array_equal(got, want)
