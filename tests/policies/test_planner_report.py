"""`memory_report` under a budget shows each residual's planned decision and predicted
cost (`rep.decisions`, a ``plan`` column per row) and the plan's predicted peak beside
the report's; both equal the peak measured from `jax.live_arrays()`."""

from __future__ import annotations

import jax
import pytest

import tapegrad as tg
from tapegrad.planner.measure import measured_peak
from tests.policies.test_planner_joint import ALL, COSTS, mlp, save_peak


@pytest.fixture(scope="module")
def model():
    ks = jax.random.split(jax.random.key(0), 9)
    return [jax.random.normal(k, (64, 64)) / 8 for k in ks[:8]], jax.random.normal(ks[8], (32, 64))


@pytest.mark.parametrize(
    "frac,kw",
    [(0.45, dict(allow=ALL, max_error="bf16")), (0.7, dict(allow=ALL)), (0.7, {})],
    ids=["joint-45%", "offload-70%", "recompute-70%"],
)
def test_report_shows_the_planned_decisions(model, frac, kw):
    full = save_peak(mlp, model)
    pol = tg.policies.budget(int(full * frac), costs=COSTS, **kw)
    rep = tg.memory_report(mlp, policy=pol)(*model)
    assert rep.decisions == pol.last["residuals"] and rep.decisions
    # every row charged a planned residual names its mechanisms and their seconds
    by_rec: dict[int, list] = {}
    tape = rep.tape
    producer = {o.id: r.index for r in tape.records for o in r.outputs}
    for key, (mech, _, secs) in rep.decisions.items():
        by_rec.setdefault(producer.get(key, -1), []).append((mech, secs))
    rows = {r.index: r for r in rep.records}
    for i, got in by_rec.items():
        row = rows[i]
        assert set(row.planned.split("+")) == {m for m, _ in got}
        assert row.planned_seconds == pytest.approx(sum(s for _, s in got))
    mechs = {m for m, _, _ in rep.decisions.values()}
    if kw:
        assert mechs - {"save"}, mechs  # the plan moves something off the device
    text = str(rep)
    assert "plan: predicted peak" in text and " plan " in text
    for m in mechs:
        assert m in text
    # predicted peak == this report's device peak == measured from live arrays
    assert rep.planned_peak_bytes == pol.last["peak_bytes"] <= pol.bytes
    assert rep.measured_device_peak_bytes == rep.planned_peak_bytes
    assert measured_peak(mlp, model, pol) == rep.planned_peak_bytes


def test_report_without_a_budget_has_no_plan(model):
    rep = tg.memory_report(mlp, policy=tg.policies.offload())(*model)
    assert rep.decisions is None and rep.planned_peak_bytes is None
    assert "plan: predicted" not in str(rep)
    assert all(r.planned == "" for r in rep.records)


def _block_model():
    import numpy as np

    ks = iter(jax.random.split(jax.random.key(1), 7))
    d, f = 32, 64
    shapes = [(d, d), (d, d), (d, d), (d, d), (d, f), (f, d)]
    ps = [tuple(jax.random.normal(next(ks), s) / np.sqrt(s[0]) for s in shapes)]
    return ps, jax.random.normal(next(ks), (16, d))


@pytest.mark.parametrize("name", ["mlp", "block"])
def test_predicted_schedule_is_the_measured_one(model, name):
    """At every point of the plan's schedule (end of forward, each recomputation, each
    record's backward), the device bytes of activations the planner predicted are the
    ones this run held: offloaded copies brought back ahead (prefetch), recomputed
    segments and their unpacked inputs included."""
    from tests.policies.test_planner_joint import block

    f, args = (mlp, model) if name == "mlp" else (block, _block_model())
    full = save_peak(f, args)
    checked = plans = 0
    for allow, max_error in [(("save", "recompute"), None), (("save", "offload"), None),
                             (ALL, "bf16"), (ALL, "int8")]:  # fmt: skip
        for frac in (0.8, 0.5):
            pol = tg.policies.budget(
                int(full * frac), allow=allow, max_error=max_error, costs=COSTS
            )
            try:
                rep = tg.memory_report(f, policy=pol)(*args)
            except tg.policies.BudgetError:
                assert frac == 0.5, allow  # below what these mechanisms reach
                continue
            plans += 1
            assert rep.planned_timeline == pol.last["timeline"]
            assert rep.measured_plan_timeline == rep.planned_timeline, (allow, max_error, frac)
            assert max(b for _, b in rep.planned_timeline) == pol.last["peak_bytes"]
            assert "as predicted at every one" in str(rep)
            checked += any(p == "recompute" for p, _ in rep.planned_timeline)
    assert checked and plans >= 6  # some plans recompute


def test_plot_plan_draws_both_schedules(model):
    import matplotlib

    matplotlib.use("Agg")
    pol = tg.policies.budget(int(save_peak(mlp, model) * 0.5), allow=ALL, costs=COSTS)
    rep = tg.memory_report(mlp, policy=pol)(*model)
    ax = rep.plot_plan()
    lines = {ln.get_gid(): ln for ln in ax.get_lines()}
    assert list(lines["measured"].get_ydata()) == [b for _, b in rep.measured_plan_timeline]
    assert list(lines["predicted"].get_ydata()) == [b for _, b in rep.planned_timeline]
    with pytest.raises(ValueError, match="budget"):
        tg.memory_report(mlp, policy=tg.policies.save())(*model).plot_plan()
