"""``tape.graph()`` and ``memory_report(...).graph()``: a tape drawn as a graph.

The oracle is the tape itself: every value a record keeps appears on its box with its
bytes and decision, every record's source line is on the drawing, each edge joins a
value's producer to a reader, and long tapes fold to about `MAX_NODES` boxes. Each
check runs on both engines' SVG, read back alike (`_svg.read`): Graphviz's ``dot``
(Debian: ``apt-get install -y graphviz``; without it those cases fail and say so, as the
browser tests do) and the pure-Python layout, which also draws with ``dot`` off PATH.
Every drawing is checked for boxes that overlap and clusters that miss a member or cover
a node that is not one.
"""

from __future__ import annotations

import re
import shutil
import time

import jax
import jax.numpy as jnp
import pytest
from _svg import Drawing, inside, overlap, read

import tapegrad as tg
from tapegrad import policies as P
from tapegrad.display.common import human_bytes, short_source
from tapegrad.display.graph import MAX_NODES, TapeGraph

ENGINES = ["dot", "python"]


def needs(engine: str) -> None:
    if engine == "dot" and shutil.which("dot") is None:
        pytest.fail("Graphviz's dot is needed to draw tapes: apt-get install -y graphviz")


def drawn(g: TapeGraph, engine: str) -> Drawing:
    """``g`` drawn by ``engine``, read back; every drawing checked alike: one box per
    node, no two boxes overlapping, each cluster around its members and clear of the rest."""
    needs(engine)
    d = read(g.svg(engine))
    assert set(d.nodes) == {n.name for n in g.model.nodes}
    boxes = sorted(d.nodes.items(), key=lambda kv: kv[1].box[0])
    for i, (a, sa) in enumerate(boxes):
        for b, sb in boxes[i + 1 :]:
            if sb.box[0] >= sa.box[2]:
                break
            assert not overlap(sa.box, sb.box), (engine, a, b, sa.box, sb.box)
    for c in g.model.walk_clusters():
        members = set(_members(c))
        box = d.clusters[c.name].box
        for name, shape in d.nodes.items():
            if name in members:
                assert inside(shape.box, box), (engine, c.name, name)
            else:
                assert not overlap(shape.box, box), (engine, c.name, name)
    return d


def _members(c):
    yield from c.nodes
    for sub in c.clusters:
        yield from _members(sub)


def mlp(ws, x):
    for w in ws:
        x = jnp.tanh(x @ w)
    return jnp.mean(x**2)


WS = [jnp.full((16, 16), 0.05 * (i + 1)) for i in range(8)]
X = jnp.ones((4, 16))


@pytest.mark.parametrize("engine", ENGINES)
def test_every_kept_value_is_on_its_records_box_with_bytes_and_line(engine):
    tape = tg.trace(mlp)(WS, X)
    g = tape.graph()
    d = drawn(g, engine)
    assert g.nodes == len(tape.records) + len(tape.inputs) + len(tape.outputs) == len(d.nodes)
    for rec in tape.records:
        box = d.nodes[f"nr{rec.index}"].text
        assert rec.primitive in box
        assert short_source(rec.source, 44).split(" (")[0] in box  # file:line
        for s in rec.saves:
            assert f"keeps {s} " in box and human_bytes(s.nbytes) in box, (rec, box)
    kept = sum(shape.text.count("keeps ") for shape in d.nodes.values())
    assert sum(len(r.saves) for r in tape.records) == kept == g.dot().count("keeps ")
    assert d.nodes["nin0"].fill == "#e6f4ea" and d.nodes["nout0"].fill == "#fdebd3"


@pytest.mark.parametrize("engine", ENGINES)
def test_edges_join_producers_to_readers(engine):
    tape = tg.trace(mlp)(WS, X)
    g = tape.graph()
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
    assert set(drawn(g, engine).edges) == want
    assert set(re.findall(r"^\s+(\w+) -> (\w+)", g.dot(), flags=re.M)) == want


@pytest.mark.parametrize("engine", ENGINES)
def test_kept_values_ride_thick_coloured_edges(engine):
    tape = tg.trace(mlp)(WS, X)
    edges = drawn(tape.graph(), engine).edges
    kept, _ = tape.residual_keys()
    thick = {e.stroke for e in edges.values() if e.width > 2}
    assert thick == {"#2b6cb0"}  # save's colour: nothing else kept
    # a dot_general keeps its weight input: the input's edge into it is thick
    d = next(r for r in tape.records if r.primitive == "dot_general")
    w = next(k for k, v in enumerate(tape.inputs) if v.id == d.inputs[1].id)
    assert d.inputs[1].id in kept
    edge = edges[(f"nin{w}", f"nr{d.index}")]
    assert edge.stroke == "#2b6cb0" and edge.width > 2


def rnn(w, xs):
    def step(h, x):
        h = jnp.tanh(h @ w + x)
        return h, jnp.sum(h)

    h, ys = jax.lax.scan(step, jnp.zeros(8), xs)
    return jnp.sum(ys) + jax.lax.cond(h[0] > 0, jnp.sin, jnp.cos, h).sum()


@pytest.mark.parametrize("engine", ENGINES)
def test_a_scan_body_is_a_box_labelled_with_its_trip_count(engine):
    tape = tg.trace(rnn)(jnp.eye(8) * 0.3, jnp.ones((12, 8)))
    g = tape.graph()
    d = drawn(g, engine)  # each body's nodes inside its box, the other nodes outside
    labels = [c.text for c in d.clusters.values()]
    assert len(d.clusters) == 3
    assert any("scan body ×12" in t for t in labels) and any("cond branch 1" in t for t in labels)
    body = next(r for r in tape.records if r.primitive == "scan").bodies[0]
    assert g.records == len(tape.records) + sum(
        len(b.records) for r in tape.records for b in r.bodies
    )
    # apart: the top level alone, each body its own graph under <details>
    apart = tape.graph(bodies=False)
    assert not apart.model.clusters and not drawn(apart, engine).clusters
    assert [label.split(" ·")[0] for label, _ in apart.bodies] == [
        "scan body ×12",
        "cond branch 0",
        "cond branch 1",
    ]
    assert apart.bodies[0][1].nodes == len(body.records) + len(body.inputs) + len(body.outputs)


def ckpt(w, x):
    y = tg.checkpoint(lambda a: jnp.sin(jnp.tanh(a @ w)))(x)
    return jnp.sum(y**2)


@pytest.mark.parametrize("engine", ENGINES)
def test_checkpoint_regions_are_boxes_and_recompute_is_marked(engine):
    tape = tg.trace(ckpt)(WS[0], X)
    g = tape.graph()
    d = drawn(g, engine)  # the region's records inside its box, the rest outside
    (name, region) = next(iter(d.clusters.items()))
    assert "checkpoint" in region.text and region.dashed and region.stroke == "#2f855a"
    members = g.model.clusters[0].nodes
    assert len(members) == 3 and all("recompute in backward" in d.nodes[n].text for n in members)
    assert all(d.nodes[n].dashed for n in members)


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
    drawn(g, "python")

    def chaos(x):  # nothing repeats: every step a different literal, one source line
        for i in range(120):
            x = jnp.sin(x * (i + 1.0)) + jnp.cos(x[::-1]) if i % 2 else jnp.tanh(x * i)
        return jnp.sum(x)

    tape = tg.trace(chaos)(X)
    assert len(tape.records) > 300
    g = tape.graph()
    assert 0.3 * MAX_NODES <= g.nodes <= MAX_NODES * 1.1
    t0 = time.perf_counter()
    drawn(g, "python")
    assert time.perf_counter() - t0 < 10  # ~0.3 s on one core; generous for a shared CI


@pytest.mark.parametrize("engine", ENGINES)
def test_memory_report_graph_shows_the_policys_decisions(engine):
    rep = tg.memory_report(mlp, policy=P.offload())(WS, X)
    d = drawn(rep.graph(), engine)
    assert any("host · offload" in n.text for n in d.nodes.values())
    assert "#6b46c1" in {e.stroke for e in d.edges.values()}  # offload's colour, kept edges
    for row in rep.records:
        if row.host_bytes:
            assert human_bytes(row.host_bytes) + " host" in d.nodes[f"nr{row.index}"].text
    rep = tg.memory_report(mlp, policy=P.compress(bits=4, key=jax.random.PRNGKey(0)))(WS, X)
    d = drawn(rep.graph(), engine)
    assert any("compressed" in n.text for n in d.nodes.values())


@pytest.mark.parametrize("engine", ENGINES)
def test_svg_draws_within_size(engine):
    needs(engine)
    tape = tg.trace(mlp)(WS, X)
    svg = tape.graph(engine=engine).svg()
    assert svg.startswith("<svg") and svg.count('class="node"') == len(tape.records) + 10
    assert len(svg) < 1_000_000
    html = tape.graph(engine=engine)._repr_html_()
    assert "<svg" in html and "kept for backward" in html
    # the README's picture: a 3-layer MLP under offload()
    ws = [jnp.full((64, 64), 0.01)] * 3
    rep = tg.memory_report(mlp, policy=P.offload())(ws, jnp.ones((16, 64)))
    assert len(rep.graph().svg(engine)) < 20_000


def test_without_dot_on_path_python_draws_it(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # a folder with no `dot` in it
    assert shutil.which("dot") is None
    for f, args in ((rnn, (jnp.eye(8) * 0.3, jnp.ones((12, 8)))), (ckpt, (WS[0], X))):
        tape = tg.trace(f)(*args)
        g = tape.graph()  # engine="auto": Python, since there is no dot
        d = drawn(g, "python")  # boxes apart, clusters around their members
        assert read(g.svg()).nodes.keys() == d.nodes.keys()
        assert len(d.edges) == len(g.model.edges) and d.clusters
        fills = {n.fill for n in d.nodes.values()}
        assert {"#e6f4ea", "#fdebd3"} <= fills  # inputs green, outputs orange
        assert "<svg" in g._repr_html_()
        assert d.size[0] > 100 and d.size[1] > 100
    g = tape.graph(engine="dot")
    with pytest.raises(RuntimeError, match="install Graphviz.*engine='python'"):
        g.svg()
    assert "install Graphviz" in g._repr_html_() and "digraph" in g._repr_html_()
    assert g.dot().startswith("digraph")
    path = tmp_path / "g.svg"
    tape.graph().save(str(path))
    read(path.read_text())


def test_an_unknown_engine_is_refused():
    with pytest.raises(ValueError, match="'auto'.*'dot'.*'python'"):
        tg.trace(mlp)(WS, X).graph(engine="neato")
