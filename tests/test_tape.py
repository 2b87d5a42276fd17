"""The tape as data: printing, HTML rendering, immutability, which jaxpr equations become records.

Nested ``jit`` calls are inlined; ``custom_jvp_call`` (as a ``custom_jvp_rule`` record,
differentiated by its linearized rule), ``custom_vjp_call``,
``cond``, ``scan`` and ``while`` stay records of their own; ``jax.checkpoint``
is inlined as a checkpoint region whose records are recomputed in backward.
"""

from __future__ import annotations

import dataclasses
import html.parser
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import tapegrad as tg

THIS_FILE = os.path.basename(__file__)
X = jnp.linspace(-1.0, 1.0, 3)


def _line_of(marker: str) -> int:
    """Line number in this file of the source line ending with ``# <marker>``."""
    with open(__file__) as fh:
        for i, line in enumerate(fh, 1):
            if line.rstrip().endswith("# " + marker):
                return i
    raise AssertionError(marker)


def mlp_like(w, x):
    h = jnp.tanh(x @ w)  # L-TANH
    return jnp.sum(h * 2.0 + jnp.sin(h))  # L-SUM


W = jnp.linspace(-0.5, 0.5, 6).reshape(3, 2)
XB = jnp.linspace(0.0, 1.0, 12).reshape(4, 3)


@pytest.fixture(scope="module")
def tape():
    return tg.trace(mlp_like)(W, XB)


def _body_lines(tape) -> list[str]:
    """The lines of the tape's own records: one each (a loop or branch record's body is
    printed under it, indented further, and is not among them)."""
    lines = str(tape).splitlines()
    n = len(tape.records)
    assert lines[0].lstrip().startswith("{ lambda")
    assert lines[-2].startswith("  in ("), lines[-2]
    assert f"{n} records" in lines[-1]
    own = [ln for ln in lines[1:-2] if len(ln) - len(ln.lstrip(" ")) == 4]
    assert len(own) == n
    return own


# ---------------------------------------------------------------- printing


def test_str_has_one_line_per_record(tape):
    body = _body_lines(tape)
    assert len(body) == len(tape.records) == len(tape) > 0
    for line, rec in zip(body, tape.records):
        assert f"= {rec.primitive}" in line, (line, rec.primitive)


def test_str_contains_primitive_names_in_order(tape):
    prims = [r.primitive for r in tape.records]
    for name in ("dot_general", "tanh", "sin", "mul", "add", "reduce_sum"):
        assert name in prims
    text = str(tape)
    positions = [text.index(f"= {p}") for p in ("dot_general", "tanh", "reduce_sum")]
    assert positions == sorted(positions)


def test_str_shows_saves_annotations(tape):
    body = _body_lines(tape)
    assert any("saves[" in line for line in body)
    for line, rec in zip(body, tape.records):
        if rec.saves:
            assert f"saves[{','.join(str(s) for s in rec.saves)}]" in line, line
        else:
            assert "saves[" not in line, line
    tanh = next(r for r in tape.records if r.primitive == "tanh")
    assert [s.ref for s in tanh.saves] == [("out", 0)]  # tanh' = 1 - y^2 needs only its output


def test_str_shows_this_files_source_lines(tape):
    body = _body_lines(tape)
    for line in body:
        assert THIS_FILE in line, line
    tanh_line = next(l for l, r in zip(body, tape.records) if r.primitive == "tanh")
    assert f"{THIS_FILE}:{_line_of('L-TANH')}" in tanh_line, tanh_line
    sum_line = next(l for l, r in zip(body, tape.records) if r.primitive == "reduce_sum")
    assert f"{THIS_FILE}:{_line_of('L-SUM')}" in sum_line, sum_line
    tanh = next(r for r in tape.records if r.primitive == "tanh")
    assert tanh.source.endswith(f"{THIS_FILE}:{_line_of('L-TANH')} (mlp_like)")


def test_repr_is_str(tape):
    assert repr(tape) == str(tape)


class _TableParser(html.parser.HTMLParser):
    """Rows and header cells of the one table with class ``cls`` (other tables ignored)."""

    def __init__(self, cls: str = "tapegrad-tape"):
        super().__init__()
        self.cls = cls
        self.tables = 0  # tables with class ``cls``
        self.rows: list[list[str]] = []
        self.header_cells = 0
        self.roots: list[str] = []  # top-level elements
        self._depth = 0
        self._inside = 0  # nesting depth of tables, counted from the wanted one
        self._cell: list[str] | None = None

    def handle_starttag(self, tag, attrs):
        if self._depth == 0:
            self.roots.append(tag)
        self._depth += 1
        if tag == "table":
            if self._inside:
                self._inside += 1
            elif (dict(attrs).get("class") or "").split().count(self.cls):
                self.tables += 1
                self._inside = 1
        if self._inside != 1:
            return
        if tag == "tr":
            self.rows.append([])
        elif tag == "td":
            self._cell = []
        elif tag == "th":
            self.header_cells += 1

    def handle_endtag(self, tag):
        self._depth -= 1
        if tag == "table" and self._inside:
            self._inside -= 1
        if tag == "td" and self._cell is not None:
            self.rows[-1].append("".join(self._cell))
            self._cell = None

    def handle_data(self, data):
        if self._cell is not None:
            self._cell.append(data)


def test_repr_html_is_a_table_with_one_row_per_record(tape):
    out = tape._repr_html_()
    assert isinstance(out, str)
    p = _TableParser()
    p.feed(out)
    assert p.roots == ["div"]  # one self-contained element: totals, the table, by-source view
    assert p.tables == 1
    data_rows = [r for r in p.rows if r]  # the header row holds <th>, not <td>
    assert len(p.rows) == len(tape.records) + 1  # a short tape folds nothing
    assert len(data_rows) == len(tape.records)
    for row, rec in zip(data_rows, tape.records):
        assert len(row) == p.header_cells
        assert row[0] == str(rec.index)
        assert row[1] == rec.primitive
        assert THIS_FILE in row[-1]


def test_repr_html_escapes_source(tape):
    # Function names such as "<lambda>" must not leak raw "<" into the HTML.
    t = tg.trace(lambda x: jnp.sum(jnp.sin(x)))(X)
    out = t._repr_html_()
    assert "&lt;lambda&gt;" in out
    assert "<lambda>" not in out


# ---------------------------------------------------------------- immutability


def test_tape_and_record_are_frozen(tape):
    rec = tape.records[0]
    with pytest.raises(dataclasses.FrozenInstanceError):
        tape.records = ()
    with pytest.raises(dataclasses.FrozenInstanceError):
        del rec.primitive
    # A new attribute cannot be added either. (CPython 3.10/3.11 raise TypeError rather than
    # FrozenInstanceError here for frozen slots=True dataclasses; either way nothing is stored.)
    with pytest.raises((dataclasses.FrozenInstanceError, TypeError, AttributeError)):
        tape.new_attribute = 1
    assert not hasattr(tape, "new_attribute")
    with pytest.raises(dataclasses.FrozenInstanceError):
        rec.primitive = "cos"
    with pytest.raises(dataclasses.FrozenInstanceError):
        rec.saves = ()
    with pytest.raises(dataclasses.FrozenInstanceError):
        rec.outputs[0].shape = (1,)
    saved = next(r for r in tape.records if r.saves).saves[0]
    with pytest.raises(dataclasses.FrozenInstanceError):
        saved.index = 3
    assert isinstance(tape.records, tuple)
    assert isinstance(rec.inputs, tuple) and isinstance(rec.outputs, tuple)


def test_record_params_are_read_only(tape):
    rec = next(r for r in tape.records if r.params)
    with pytest.raises(TypeError):
        rec.params["extra"] = 1


def test_trace_argnums_decides_what_is_saved():
    def f(x, y):
        return jnp.sum(jnp.sin(x) * y)

    both = tg.trace(f)(X, X)
    only_y = tg.trace(f, argnums=1)(X, X)
    sin_both = next(r for r in both.records if r.primitive == "sin")
    sin_y = next(r for r in only_y.records if r.primitive == "sin")
    assert sin_both.saves and sin_both.in_backward
    assert sin_y.saves == () and not sin_y.in_backward  # x is not differentiated
    assert only_y.saved_bytes < both.saved_bytes


# ---------------------------------------------------------------- which equations become records

CALL_PRIMITIVES = {"jit", "pjit", "closed_call", "core_call"}


def test_nested_jit_is_inlined():
    inner = jax.jit(lambda z: jnp.tanh(z) * 3.0)

    @jax.jit
    def f(x):
        return jnp.sum(inner(jax.jit(jnp.sin)(x)) ** 2)

    t = tg.trace(f)(X)
    prims = [r.primitive for r in t.records]
    assert not CALL_PRIMITIVES & set(prims), prims
    for name in ("sin", "tanh", "mul", "integer_pow", "reduce_sum"):
        assert name in prims, prims
    np.testing.assert_allclose(tg.grad(f)(X), jax.grad(f)(X), rtol=1e-6)


@jax.custom_jvp
def _cj(x):
    return jnp.sin(x)


_cj.defjvp(lambda p, t: (_cj(p[0]), jnp.cos(p[0]) * t[0]))


@jax.custom_vjp
def _cv(x):
    return jnp.cos(x)


_cv.defvjp(lambda x: (jnp.cos(x), x), lambda r, g: (-jnp.sin(r) * g,))


def control(x):
    y = jax.jit(lambda z: jnp.tanh(z) * 2.0)(x)
    y = _cj(y) + _cv(y)  # L-CUSTOM
    y = jax.checkpoint(lambda z: jnp.sin(z) * z)(y)  # L-REMAT
    y = lax.cond(jnp.sum(y) > 0, jnp.sin, jnp.cos, y)  # L-COND
    y, _ = lax.scan(lambda c, _: (c * 1.1, None), y, None, length=3)  # L-SCAN
    n = lax.while_loop(lambda c: c < 3, lambda c: c + 1, 0)  # L-WHILE
    return jnp.sum(y) * n


@pytest.fixture(scope="module")
def control_tape():
    return tg.trace(control)(X)


@pytest.mark.parametrize(
    "prim, marker",
    [
        ("custom_jvp_rule", "L-CUSTOM"),
        ("custom_vjp_call", "L-CUSTOM"),
        ("cond", "L-COND"),
        ("scan", "L-SCAN"),
        ("while", "L-WHILE"),
    ],
)
def test_higher_order_primitives_are_records_of_their_own(control_tape, prim, marker):
    recs = [r for r in control_tape.records if r.primitive == prim]
    assert len(recs) == 1, [r.primitive for r in control_tape.records]
    assert recs[0].source.split(" ")[0].endswith(f"{THIS_FILE}:{_line_of(marker)}"), recs[0].source
    # Their bodies are not inlined: the primal sin/cos of _cj/_cv stay inside the records.
    assert not CALL_PRIMITIVES & {r.primitive for r in control_tape.records}


def test_higher_order_records_print_one_line_each(control_tape):
    body = _body_lines(control_tape)
    for name in ("custom_jvp_rule", "custom_vjp_call", "cond", "scan", "while"):
        assert sum(f"= {name}[" in line for line in body) == 1, name


def test_checkpoint_is_a_region_of_recomputed_records(control_tape):
    # jax.checkpoint (remat2) is inlined as a checkpoint *region*: its body's records appear on
    # the tape, marked "recompute", and a segment recomputes them in backward from its inputs.
    prims = {r.primitive for r in control_tape.records}
    assert not {"remat2", "checkpoint", "remat"} & prims, prims
    line = _line_of("L-REMAT")
    recs = [r for r in control_tape.records if f"{THIS_FILE}:{line} " in r.source]
    assert [r.primitive for r in recs] == ["sin", "mul"]
    assert all(r.decision == "recompute" and r.region is not None for r in recs)
    assert len(control_tape.regions) == 1
    assert control_tape.regions[0].source.split(" ")[0].endswith(f"{THIS_FILE}:{line}")
    assert any(set(seg.records) == {r.index for r in recs} for seg in control_tape.segments)
    others = [r for r in control_tape.records if r not in recs]
    assert all(r.decision == "save" and r.region is None for r in others)
    body = _body_lines(control_tape)
    assert sum("(recompute)" in b for b in body) == len(recs)


def test_custom_vjp_record_saves_user_residuals(control_tape):
    rec = next(r for r in control_tape.records if r.primitive == "custom_vjp_call")
    assert rec.saves and all(s.kind == "aux" for s in rec.saves)


def test_grad_through_the_control_tape_matches_jax():
    # The while loop computes an integer count only, so the function is differentiable.
    np.testing.assert_allclose(tg.grad(control)(X), jax.grad(control)(X), rtol=1e-5, atol=1e-6)
