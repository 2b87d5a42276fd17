"""`memory_report` under a budget shows each residual's planned decision and predicted
cost (`rep.decisions`, a ``plan`` column per row) and the plan's predicted peak beside
the report's; both equal the peak measured from `jax.live_arrays()`."""

from __future__ import annotations

import jax
import pytest

import tapegrad as tg
from tapegrad.policies._planner_measure import measured_peak
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
