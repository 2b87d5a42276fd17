"""Pictures of the tape and of memory reports: HTML tables that stay small and well formed on
a 2,000-record tape, plain text that fits 100 columns, and the memory timeline plot.

Totals are checked against sums computed here from ``tape.records`` and the report's rows;
folding is checked by re-expanding every folded group onto the records it stands for.
"""

from __future__ import annotations

import html.parser
import os
import re
import sys

import jax
import jax.numpy as jnp
import matplotlib
import pytest
from conftest import tanh_mlp as mlp
from jax import lax

import tapegrad as tg
from tapegrad import policies as P

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

THIS_FILE = os.path.basename(__file__)
LAYERS = 500


def chain(ws, x):
    for w in ws:
        x = jnp.tanh(x @ w) + 0.5 * x  # L-LAYER
    return jnp.sum(x**2)


@pytest.fixture(scope="module")
def deep():
    ws = [jnp.full((8, 8), 0.01) for _ in range(LAYERS)]
    x = jnp.ones((4, 8))
    return ws, x


@pytest.fixture(scope="module")
def deep_tape(deep):
    return tg.trace(chain)(*deep)


@pytest.fixture(scope="module")
def small():
    ks = jax.random.split(jax.random.key(0), 7)
    return [jax.random.normal(k, (16, 16)) / 4 for k in ks[:6]], jax.random.normal(ks[6], (8, 16))


# ------------------------------------------------------------------ HTML structure

VOID = {"col", "br", "hr", "img", "input", "meta", "link", "wbr"}


class Doc(html.parser.HTMLParser):
    """Checks nesting while it parses; keeps elements as (tag, attrs, parent tag, children)."""

    def __init__(self, text: str):
        super().__init__(convert_charrefs=True)
        self.stack: list[dict] = [{"tag": "#root", "attrs": {}, "children": [], "text": []}]
        self.errors: list[str] = []
        self.feed(text)
        self.close()
        if len(self.stack) != 1:
            self.errors.append(f"unclosed: {[n['tag'] for n in self.stack[1:]]}")
        self.root = self.stack[0]

    def handle_starttag(self, tag, attrs):
        node = {
            "tag": tag,
            "attrs": dict(attrs),
            "children": [],
            "text": [],
            "parent": self.stack[-1],
        }
        self.stack[-1]["children"].append(node)
        if tag not in VOID:
            self.stack.append(node)

    def handle_endtag(self, tag):
        if tag in VOID:
            return
        if self.stack[-1]["tag"] != tag:
            self.errors.append(f"</{tag}> closes <{self.stack[-1]['tag']}>")
            return
        self.stack.pop()

    def handle_data(self, data):
        for n in self.stack[1:]:
            n["text"].append(data)

    def find(self, tag, cls=None, node=None):
        out = []
        for c in (node or self.root)["children"]:
            if c["tag"] == tag and (cls is None or cls in (c["attrs"].get("class") or "").split()):
                out.append(c)
            out.extend(self.find(tag, cls, c))
        return out


def text(node) -> str:
    return "".join(node["text"])


def rows_of(table) -> list[dict]:
    """The table's own rows (not those of tables nested in its cells)."""
    return [
        tr
        for sec in table["children"]
        if sec["tag"] in ("thead", "tbody")
        for tr in sec["children"]
        if tr["tag"] == "tr"
    ]


def check_structure(doc: Doc, table_cls: str) -> dict:
    assert doc.errors == []
    assert [c["tag"] for c in doc.root["children"]] == ["div"]  # one self-contained element
    top = doc.root["children"][0]
    assert [c["tag"] for c in top["children"][:2]] == ["style", "div"]
    assert doc.find("div", "tg-totals")
    (table,) = doc.find("table", table_cls)
    n_cols = len(doc.find("th", node=table["children"][1]))  # thead
    assert [c["tag"] for c in table["children"]] == ["colgroup", "thead", "tbody"]
    for tr in doc.find("tr"):
        assert tr["parent"]["tag"] in ("thead", "tbody")
        for td in tr["children"]:
            assert td["tag"] in ("td", "th")
    for d in doc.find("details"):
        assert d["children"][0]["tag"] == "summary"
    for tr in rows_of(table)[1:]:
        if {"tg-fold", "tg-body"} & set(tr["attrs"].get("class", "").split()):
            assert tr["children"][0]["attrs"]["colspan"] == str(n_cols)
        else:
            assert len(tr["children"]) == n_cols
    assert doc.find("table", "tg-by-source")
    return table


def totals(doc: Doc) -> dict[str, int]:
    return {
        d["attrs"]["data-key"]: int(d["attrs"]["data-v"])
        for d in doc.find("div", "tg-stat")
        if "data-v" in d["attrs"]
    }


def expand(doc: Doc, table, n_items: int) -> list[tuple[int, dict]]:
    """(item position, row) for every item, folded groups re-expanded (the block's rows
    stand for each repeat; their ``#`` is the first repeat's); checks the cover."""
    out, pos = [], 0
    for tr in rows_of(table)[1:]:
        if "tg-body" in tr["attrs"].get("class", ""):
            continue  # a loop/branch body under the row before: not one of the items
        if "tg-fold" not in tr["attrs"].get("class", ""):
            out.append((pos, tr))
            pos += 1
            continue
        start, p, r = (int(tr["attrs"][k]) for k in ("data-start", "data-period", "data-repeats"))
        assert start == pos and r >= 3
        inner = rows_of(doc.find("table", "tg-inner", tr)[0])
        assert len(inner) == p  # the block shows once
        for k in range(r):
            out.extend((start + k * p + j, inner[j]) for j in range(p))
        pos += p * r
    assert pos == n_items
    return out


def test_tape_html_is_well_formed_and_escaped():
    tape = tg.trace(lambda x: jnp.sum(jnp.sin(x) * 2.0))(jnp.ones(3))
    doc = Doc(tape._repr_html_())
    table = check_structure(doc, "tapegrad-tape")
    assert len(rows_of(table)) == len(tape.records) + 1
    out = tape._repr_html_()
    assert "&lt;lambda&gt;" in out and "<lambda>" not in out


def test_tape_html_folds_a_2000_record_tape(deep_tape):
    tape = deep_tape
    assert len(tape.records) >= 2000
    out = tape._repr_html_()
    assert len(out.encode()) < 200_000, len(out)
    doc = Doc(out)
    table = check_structure(doc, "tapegrad-tape")
    assert len(rows_of(table)) < 40  # 500 layers fold into one group row

    # Re-expanded, the rows name every record in order, with its primitive and bytes.
    rows = expand(doc, table, len(tape.records))
    for i, tr in rows:
        rec = tape.records[i]
        cells = tr["children"]
        assert text(cells[1]) == rec.primitive
        assert int(cells[5]["attrs"]["data-v"]) == sum(s.nbytes for s in rec.saves)
        assert THIS_FILE in text(cells[-1])

    # Totals, against sums computed here: distinct residuals (a value saved by several
    # records counts once; the residual stream x, rebuilt in backward, not at all).
    kept = {k: v.nbytes for k, v in tape.residual_keys()[0].items()}
    input_ids = {v.id for v in tape.inputs}
    t = totals(doc)
    assert t["records"] == len(tape.records)
    assert t["saved_bytes"] == sum(kept.values())
    assert t["input_bytes"] == sum(b for k, b in kept.items() if k in input_ids)
    assert t["activation_bytes"] == sum(b for k, b in kept.items() if k not in input_ids)
    fold = doc.find("tr", "tg-fold")[0]
    assert f"{LAYERS} ×" in text(fold) or f"{LAYERS - 1} ×" in text(fold)


def test_memory_report_html_folds_and_totals(deep):
    rep = tg.memory_report(
        chain, policy=P.route(lambda i: P.save() if i.primitive == "dot_general" else P.offload())
    )(*deep)
    out = rep._repr_html_()
    assert len(out.encode()) < 200_000, len(out)
    doc = Doc(out)
    table = check_structure(doc, "tapegrad-memory")
    assert len(rows_of(table)) < 40
    rows = expand(doc, table, len(rep.records))
    for i, tr in rows:
        r = rep.records[i]
        got = [int(tr["children"][k]["attrs"]["data-v"]) for k in (4, 5, 6)]
        assert got == [r.device_bytes, r.host_bytes, r.compressed_bytes]
        assert text(tr["children"][1]) == r.primitive
        assert text(tr["children"][3]) == ("offload" if r.host_bytes else "save")
    t = totals(doc)
    assert t["device_bytes"] == sum(r.device_bytes for r in rep.records) == rep.device_bytes
    assert t["host_bytes"] == sum(r.host_bytes for r in rep.records) == rep.host_bytes > 0
    assert t["compressed_bytes"] == sum(r.compressed_bytes for r in rep.records)
    assert t["residual_bytes"] == rep.residual_bytes
    assert t["peak_bytes"] == rep.peak_bytes and t["rows"] == len(rep.records)
    assert "route(&lt;lambda&gt;)" in out and "<lambda>" not in out


# ------------------------------------------------------------------ plain text


def a_function_whose_name_is_far_too_long_to_print_whole_in_a_hundred_columns(x, y):
    xs = [jnp.sin(x) * i for i in range(40)]  # sin(x) is not kept: nothing here is rebuilt
    c = jnp.concatenate(xs + [y], axis=0)  # L-CONCAT
    k = lax.conv_general_dilated(c[None, None, :, None], jnp.ones((1, 1, 3, 1)), (1, 1), "SAME")
    return jnp.sum(jnp.tanh(k))


def _check_width(s: str) -> list[str]:
    lines = s.splitlines()
    assert all(len(line) <= 100 for line in lines), [line for line in lines if len(line) > 100]
    return lines


def test_str_fits_100_columns_and_keeps_file_line():
    f = a_function_whose_name_is_far_too_long_to_print_whole_in_a_hundred_columns
    tape = tg.trace(f)(jnp.ones(3), jnp.ones(3))
    lines = _check_width(str(tape))
    with open(__file__) as fh:
        line_no = next(i for i, ln in enumerate(fh, 1) if ln.rstrip().endswith("# L-CONCAT"))
    concat = next(ln for ln in lines if "= concatenate" in ln)
    assert f"{THIS_FILE}:{line_no} (a_function" in concat and "…" in concat
    assert "concatenate[dimension=0]" in concat  # short params stay; the 41 operands are cut
    conv = next(ln for ln in lines if "= conv_general_dilated" in ln)
    assert "…" in conv  # long params shortened
    for line, rec in zip(lines[1:], tape.records):  # nothing folds here: one line per record
        assert f"= {rec.primitive}" in line
        if rec.saves:  # what a record saves is never cut
            assert f"saves[{','.join(map(str, rec.saves))}]" in line, line


def test_str_folds_a_2000_record_tape(deep, deep_tape):
    lines = _check_width(str(deep_tape))
    assert len(lines) < 30
    (fold,) = [ln for ln in lines if "⋮" in ln]
    n, p = map(int, re.search(r"(\d+) × the (\d+) records above", fold).groups())
    shown = [ln for ln in lines[1:-2] if "⋮" not in ln]
    assert len(shown) + n * p == len(deep_tape.records)
    assert lines[0].startswith("{ lambda") and "…" in lines[0]  # 501 inputs abbreviated
    rep = tg.memory_report(chain, policy=P.offload())(*deep)
    lines = _check_width(str(rep))
    assert len(lines) < 30 and "offload" in lines[0]
    # the headline: what backward holds beyond the inputs, and its peak; then the inputs
    assert f"{rep.beyond_inputs_bytes:,} B beyond" in lines[1]
    assert f"peak {rep.peak_beyond_inputs_bytes:,} B beyond" in lines[1]
    assert f"{rep.input_bytes:,}" in lines[2] and f"{rep.residual_bytes:,}" in lines[2]
    assert f"{rep.peak_bytes:,}" in lines[4]


# ------------------------------------------------------------------ loops and branches

STEPS = 1000


def rnn_cond(w, u, h0, xs):
    def step(h, x):
        z = h @ w + x @ u
        h = lax.cond(jnp.sum(z) > 0, lambda z: jnp.tanh(z), lambda z: jnp.sin(z) * 0.5, z)
        return h, jnp.sum(h)

    h, ys = lax.scan(step, h0, xs)
    return jnp.sum(h**2) + jnp.sum(ys)


@pytest.fixture(scope="module")
def rnn_args():
    k = jax.random.split(jax.random.key(1), 4)
    return (
        jax.random.normal(k[0], (4, 4)) / 2,
        jax.random.normal(k[1], (3, 4)),
        jnp.zeros((2, 4)),
        jax.random.normal(k[3], (STEPS, 2, 3)),
    )


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip(" "))


def test_str_shows_loop_and_branch_bodies_indented(rnn_args):
    from tapegrad.engine.loops.saves import loop_residual_bytes

    tape = tg.trace(rnn_cond, argnums=(0, 1))(*rnn_args)
    lines = _check_width(str(tape))
    (scan,) = [r for r in tape.records if r.bodies]
    (cond,) = [r for r in scan.bodies[0].records if r.bodies]
    k = next(i for i, ln in enumerate(lines) if "= scan[" in ln)
    assert "scan[length=1000" in lines[k] and "jaxpr" not in lines[k]
    assert lines[k + 1].lstrip().startswith(f"scan ×{STEPS:,} body: {{ lambda")
    top = _indent(lines[k])
    assert _indent(lines[k + 1]) > top
    # the body's records, one per line, indented under the header, saves marked per step
    end = next(
        i for i in range(k + 2, len(lines)) if _indent(lines[i]) <= _indent(lines[k + 1]) + 2
    )
    assert lines[end].strip().startswith("in (k l) }")  # the body's footer
    body = lines[k + 2 : end]
    body_rec = [ln for ln in body if " = " in ln and _indent(ln) == _indent(lines[k + 2])]
    assert [ln.split(" = ")[1].split("[")[0].split(" ")[0] for ln in body_rec] == [
        r.primitive for r in scan.bodies[0].records
    ]
    assert _indent(lines[k + 2]) > _indent(lines[k + 1])
    assert any("saves/step[in0,in1]" in ln for ln in body_rec)  # the cond: index, operand
    assert all("saves[" not in ln for ln in body_rec)
    # the cond's branches nest one level further, each with its own records and bytes
    heads = [i for i, ln in enumerate(lines) if "cond branch" in ln]
    assert [lines[i].lstrip()[:13] for i in heads] == ["cond branch 0", "cond branch 1"]
    cond_line = next(ln for ln in body_rec if "= cond[branches=2] " in ln)
    assert all(_indent(lines[i]) > _indent(cond_line) for i in heads)
    assert "tanh" in lines[heads[1] + 1] and "saves/step[out0]" in lines[heads[1] + 1]
    assert _indent(lines[heads[1] + 1]) > _indent(lines[heads[1]])
    assert lines[heads[1] + 2].strip().startswith("in (") and "32 B per step" in lines[heads[1] + 2]
    step = loop_residual_bytes(scan) // STEPS
    assert any(f"{step:,} B per step × {STEPS:,} = {step * STEPS:,} B" in ln for ln in lines)
    # the footer counts the loop's bytes, all steps
    assert f"{tape.saved_bytes:,} bytes saved" in lines[-1]
    assert tape.saved_bytes > step * STEPS > 0
    assert lines[-1].startswith(f"  # {len(tape.records)} records (+")


def test_str_folds_repeated_records_inside_a_body():
    def f(w, xs):
        def step(h, x):
            for _ in range(12):
                h = jnp.tanh(h @ w) + x  # L-LOOP-LAYER
            return h, None

        h, _ = lax.scan(step, jnp.zeros((2, 4)), xs)
        return jnp.sum(h)

    tape = tg.trace(f)(jnp.eye(4), jnp.ones((50, 2, 4)))
    lines = _check_width(str(tape))
    assert len(lines) < 30
    (fold,) = [ln for ln in lines if "⋮" in ln]
    assert _indent(fold) > 4 and fold.endswith("bytes saved per step")
    head = next(ln for ln in lines if "scan ×50 body" in ln)
    assert _indent(fold) > _indent(head)


def test_tape_html_nests_bodies_and_escapes(rnn_args):
    from tapegrad.engine.loops.saves import forwarded_ids, loop_residual_bytes

    tape = tg.trace(rnn_cond, argnums=(0, 1))(*rnn_args)
    out = tape._repr_html_()
    doc = Doc(out)
    table = check_structure(doc, "tapegrad-tape")
    (scan,) = [r for r in tape.records if r.bodies]
    top_bodies = [tr for tr in rows_of(table) if "tg-body" in tr["attrs"].get("class", "")]
    assert len(top_bodies) == 1 and top_bodies[0]["attrs"]["data-trip-count"] == str(STEPS)
    (inner,) = doc.find("table", "tg-body", top_bodies[0])[:1]
    assert "scan ×1,000 body" in text(doc.find("summary", node=top_bodies[0])[0])
    rows = rows_of(inner)
    plain = [tr for tr in rows if "tg-body" not in tr["attrs"].get("class", "")]
    assert [text(tr["children"][1]) for tr in plain] == [
        r.primitive for r in scan.bodies[0].records
    ]
    branches = [tr for tr in rows if "tg-body" in tr["attrs"].get("class", "")]
    assert [tr["attrs"]["data-branch"] for tr in branches] == ["0", "1"]
    assert "cond branch 1" in text(branches[1])
    # the branch functions are lambdas: their source escaped, at every depth
    assert "&lt;lambda&gt;" in out and "<lambda>" not in out
    for tr in doc.find("tr"):  # every row of every nested table is well formed
        assert tr["parent"]["tag"] in ("thead", "tbody")
    t = totals(doc)
    assert t["saved_bytes"] == tape.saved_bytes
    assert t["loop_bytes"] == loop_residual_bytes(scan)
    assert t["records"] == len(tape.records)
    assert t["body_records"] == len(scan.bodies[0].records) + sum(
        len(b.records) for r in scan.bodies[0].records for b in r.bodies
    )
    step_cells = [int(tr["children"][5]["attrs"]["data-v"]) for tr in plain]
    # per step: a record's saves but those the scan keeps once (w, u, the x slice), and a
    # nested cond's branches (one run each) on top; they add up to the body's summary
    fwd = forwarded_ids(scan)
    want = [
        sum(s.nbytes for s in r.saves if r.residual_key(s) not in fwd)
        + (loop_residual_bytes(r) if r.bodies else 0)
        for r in scan.bodies[0].records
    ]
    assert step_cells == want
    assert top_bodies[0]["attrs"]["data-step-bytes"] == str(loop_residual_bytes(scan) // STEPS)


def test_memory_report_shows_loop_and_body_rows(rnn_args):
    rep = tg.memory_report(rnn_cond, argnums=(0, 1), policy=P.offload())(*rnn_args)
    lines = _check_width(str(rep))
    k = next(i for i, ln in enumerate(lines) if f"scan ×{STEPS:,}" in ln)
    assert lines[k + 1].strip().startswith(f"scan ×{STEPS:,} body:")
    (row,) = [r for r in rep.records if r.body]
    body = [ln for ln in lines[k + 2 :] if "B/step" in ln]
    assert len(body) == sum(1 for r in row.walk()) - 1
    for r in row.walk():
        if r.depth:  # per step and in all, for every body row
            assert any(
                f"{r.host_bytes:,}" in ln and f"{r.step_bytes:,} B/step" in ln for ln in body
            )
    assert any(ln.strip().startswith("cond branch") for ln in lines)

    out = rep._repr_html_()
    doc = Doc(out)
    table = check_structure(doc, "tapegrad-memory")
    t = totals(doc)
    assert t["host_bytes"] == sum(r.host_bytes for r in rep.records) == rep.host_bytes
    assert t["loop_bytes"] == row.body_bytes > 0
    (tr,) = [x for x in rows_of(table) if "tg-body" in x["attrs"].get("class", "")]
    assert tr["attrs"]["data-runs"] == str(STEPS)
    nested = [x for x in doc.find("tr", node=tr) if "tg-body" in x["attrs"].get("class", "")]
    assert nested and "cond branch" in text(nested[0])
    assert "&lt;lambda&gt;" in out and "<lambda>" not in out


# ------------------------------------------------------------------ plot


def _lines(ax) -> dict[str, object]:
    return {ln.get_gid(): ln for ln in ax.get_lines()}


def test_plot_draws_one_line_per_memory_kind(small):
    ws, x = small
    pol = P.route(
        lambda i: (
            P.offload(inputs=True) if i.primitive == "dot_general" else P.compress(jnp.bfloat16)
        )
    )
    rep = tg.memory_report(mlp, policy=pol)(ws, x)
    fig, axs = plt.subplots(1, 2)
    try:
        assert rep.plot(ax=axs[1]) is axs[1]  # draws into the Axes it is given
        lines = _lines(axs[1])
        assert set(lines) == {"total", "device", "host", "compressed", "backward"}
        assert list(lines["total"].get_ydata()) == [b for _, b in rep.timeline]
        for k, name in enumerate(("device", "host", "compressed")):
            assert list(lines[name].get_ydata()) == [t[k] for t in rep.timeline_kinds]
        # the split is a partition of the existing timeline's bytes
        assert [sum(t) for t in rep.timeline_kinds] == [b for _, b in rep.timeline]
        n_fwd = sum(s.startswith("fwd") for s, _ in rep.timeline)
        assert list(lines["backward"].get_xdata()) == [n_fwd - 0.5] * 2
        assert rep.budget_bytes is None and not axs[0].get_lines()
    finally:
        plt.close(fig)


def test_plot_shows_the_budget_line(small):
    ws, x = small
    full = tg.memory_report(mlp)(ws, x)
    budget = (full.residual_bytes - full.input_bytes) // 2
    rep = tg.memory_report(mlp, policy=P.budget(bytes=budget))(ws, x)
    assert rep.budget_bytes == budget
    assert rep.input_residual_bytes == rep.input_bytes  # save(): the inputs are kept as they are
    ax = rep.plot()
    try:
        lines = _lines(ax)
        assert set(lines) == {"device", "backward", "budget"}  # one kind: no separate total
        assert list(lines["budget"].get_ydata()) == [budget + rep.input_bytes] * 2
        assert ax.get_ylim()[1] >= budget + rep.input_bytes
        assert "budget" in ax.get_legend_handles_labels()[1][-1]
    finally:
        plt.close(ax.figure)
    assert f"budget {budget:,}" in str(rep)
    assert f'data-key="budget_bytes" data-v="{budget}"' in rep._repr_html_()


def test_plot_without_matplotlib_says_how_to_install(small, monkeypatch):
    rep = tg.memory_report(mlp)(*small)
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", None)
    with pytest.raises(ImportError, match="pip install matplotlib"):
        rep.plot()
