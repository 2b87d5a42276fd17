"""``tape.graph()`` and ``memory_report(...).graph()``: a tape drawn as a graph.

The oracle is the tape itself: every value a record keeps appears on its box with its
bytes and decision, every record's source line is on the drawing, each edge joins a
value's producer to a reader, and long tapes fold to about `MAX_NODES` boxes. The SVG
comes from Graphviz's ``dot`` (Debian: ``apt-get install -y graphviz``); without it the
SVG tests fail and say so, as the browser tests do.
"""

from __future__ import annotations

import re
import shutil

import jax
import jax.numpy as jnp
import pytest

import tapegrad as tg
from tapegrad import policies as P
from tapegrad.display.common import human_bytes, short_source
from tapegrad.display.graph import MAX_NODES, TapeGraph


def needs_dot() -> None:
    if shutil.which("dot") is None:
        pytest.fail("Graphviz's dot is needed to draw tapes: apt-get install -y graphviz")


def mlp(ws, x):
    for w in ws:
        x = jnp.tanh(x @ w)
    return jnp.mean(x**2)


WS = [jnp.full((16, 16), 0.05 * (i + 1)) for i in range(8)]
X = jnp.ones((4, 16))


def _labels(g: TapeGraph) -> dict[str, str]:
    return dict(re.findall(r"^\s+(\w+) \[label=<(.*)>", g.dot(), flags=re.M))


def test_every_kept_value_is_on_its_records_box_with_bytes_and_line():
    tape = tg.trace(mlp)(WS, X)
    g = tape.graph()
    labels = _labels(g)
    assert g.nodes == len(tape.records) + len(tape.inputs) + len(tape.outputs)
    for rec in tape.records:
        box = labels[f"nr{rec.index}"]
        assert rec.primitive in box
        assert short_source(rec.source, 44).split(" (")[0] in box  # file:line
        for s in rec.saves:
            assert f"keeps {s} " in box and human_bytes(s.nbytes) in box, (rec, box)
    assert sum(len(r.saves) for r in tape.records) == g.dot().count("keeps ")


def test_edges_join_producers_to_readers():
    tape = tg.trace(mlp)(WS, X)
    edges = set(re.findall(r"^\s+(\w+) -> (\w+)", tape.graph().dot(), flags=re.M))
    made = {v.id: f"nin{k}" for k, v in enumerate(tape.inputs)}
    for rec in tape.records:
        made.update({o.id: f"nr{rec.index}" for o in rec.outputs})
    want = {
        (made[v.id], f"nr{rec.index}")
        for rec in tape.records
        for v in rec.inputs
        if isinstance(v, tg.Var) and v.id in made
    }
    want.add((made[tape.outputs[0].id], "nout0"))
    assert edges == want


def test_kept_values_ride_thick_coloured_edges():
    tape = tg.trace(mlp)(WS, X)
    src = tape.graph().dot()
    kept, _ = tape.residual_keys()
    thick = re.findall(r"-> \w+ \[color=\"(#\w+)\", penwidth", src)
    assert thick and set(thick) == {"#2b6cb0"}  # save's colour: nothing else kept
    # a dot_general keeps its weight input: the input's edge into it is thick
    d = next(r for r in tape.records if r.primitive == "dot_general")
    w = next(k for k, v in enumerate(tape.inputs) if v.id == d.inputs[1].id)
    assert d.inputs[1].id in kept
    assert re.search(rf"nin{w} -> nr{d.index} \[color=", src)


def test_a_scan_body_is_a_box_labelled_with_its_trip_count():
    def rnn(w, xs):
        def step(h, x):
            h = jnp.tanh(h @ w + x)
            return h, jnp.sum(h)

        h, ys = jax.lax.scan(step, jnp.zeros(8), xs)
        return jnp.sum(ys) + jax.lax.cond(h[0] > 0, jnp.sin, jnp.cos, h).sum()

    tape = tg.trace(rnn)(jnp.eye(8) * 0.3, jnp.ones((12, 8)))
    g = tape.graph()
    assert "scan body ×12" in g.dot() and "cond branch 1" in g.dot()
    assert "subgraph cluster_" in g.dot()
    body = next(r for r in tape.records if r.primitive == "scan").bodies[0]
    assert g.records == len(tape.records) + sum(
        len(b.records) for r in tape.records for b in r.bodies
    )
    # apart: the top level alone, each body its own graph under <details>
    apart = tape.graph(bodies=False)
    assert "subgraph cluster_n" not in apart.dot()
    assert [label.split(" ·")[0] for label, _ in apart.bodies] == [
        "scan body ×12",
        "cond branch 0",
        "cond branch 1",
    ]
    assert apart.bodies[0][1].nodes == len(body.records) + len(body.inputs) + len(body.outputs)


def test_checkpoint_regions_are_boxes_and_recompute_is_marked():
    def f(w, x):
        y = tg.checkpoint(lambda a: jnp.sin(jnp.tanh(a @ w)))(x)
        return jnp.sum(y**2)

    tape = tg.trace(f)(WS[0], X)
    src = tape.graph().dot()
    assert re.search(r'subgraph cluster_ng\d+ \{ style="dashed,rounded".*label="checkpoint', src)
    assert "recompute in backward" in src


def test_long_tapes_fold_to_about_max_nodes():
    def deep(ws, x):
        for w in ws:
            x = jnp.tanh(x @ w) * 0.5 + jnp.sin(x)
        return jnp.sum(x)

    ws = [jnp.eye(16) * 0.1] * 80
    tape = tg.trace(deep)(ws, X)
    assert len(tape.records) > 300
    g = tape.graph()
    assert g.nodes <= MAX_NODES and g.folded > 250
    assert "more of the" in g.dot()  # the repeated layer shows once, with a count

    def chaos(x):  # nothing repeats: every step a different literal, one source line
        for i in range(120):
            x = jnp.sin(x * (i + 1.0)) + jnp.cos(x[::-1]) if i % 2 else jnp.tanh(x * i)
        return jnp.sum(x)

    tape = tg.trace(chaos)(X)
    assert len(tape.records) > 300
    g = tape.graph()
    assert 0.3 * MAX_NODES <= g.nodes <= MAX_NODES * 1.1


def test_memory_report_graph_shows_the_policys_decisions():
    rep = tg.memory_report(mlp, policy=P.offload())(WS, X)
    g = rep.graph()
    src = g.dot()
    assert "host · offload" in src and "#6b46c1" in src  # offload's colour on kept edges
    for row in rep.records:
        if row.host_bytes:
            assert human_bytes(row.host_bytes) + " host" in _labels(g)[f"nr{row.index}"]
    rep = tg.memory_report(mlp, policy=P.compress(bits=4, key=jax.random.PRNGKey(0)))(WS, X)
    assert "compressed" in rep.graph().dot()


def test_svg_draws_within_size():
    needs_dot()
    tape = tg.trace(mlp)(WS, X)
    svg = tape.graph().svg()
    assert svg.startswith("<svg") and svg.count('class="node"') == len(tape.records) + 10
    assert len(svg) < 1_000_000
    html = tape.graph()._repr_html_()
    assert "<svg" in html and "kept for backward" in html


def test_without_graphviz_the_error_says_what_to_install(monkeypatch):
    monkeypatch.setattr(shutil, "which", lambda name: None)
    g = tg.trace(mlp)(WS, X).graph()
    with pytest.raises(RuntimeError, match="install Graphviz"):
        g.svg()
    assert "install Graphviz" in g._repr_html_() and "digraph" in g._repr_html_()
    assert g.dot().startswith("digraph")
