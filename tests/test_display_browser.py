"""The tape's and the memory report's HTML rendered by a real browser (headless Chromium):
the tables and totals are in the rendered DOM, folded groups line up with the table's
columns when opened, the by-source table sorts on click, and a screenshot is not blank.

Needs the ``chromium`` binary (Debian: ``apt-get install -y chromium``); without it the
test fails and says so, rather than skipping, so CI cannot pass without looking.
"""

from __future__ import annotations

import html.parser
import shutil
import subprocess

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tapegrad as tg
from tapegrad import policies as P

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars"]

# Run in the page after load: open every fold, measure, click a sort header, and write
# the results into <body data-*> so that --dump-dom carries them out.
PROBE = """<script>
window.addEventListener('load', function () {
  var out = document.body.dataset;
  document.querySelectorAll('details').forEach(function (d) { d.open = true; });
  ['tapegrad-tape', 'tapegrad-memory'].forEach(function (cls) {
    var t = document.querySelector('table.' + cls);
    var heads = t.tHead.rows[0].cells;
    var inner = t.querySelector('table.tg-inner');
    var cells = inner.rows[0].cells, worst = 0;
    for (var i = 0; i < heads.length; i++)
      worst = Math.max(worst, Math.abs(heads[i].getBoundingClientRect().left
                                       - cells[i].getBoundingClientRect().left));
    out[cls.replace('tapegrad-', '') + 'Misalign'] = worst.toFixed(1);
    out[cls.replace('tapegrad-', '') + 'Width'] = t.getBoundingClientRect().width.toFixed(0);
  });
  var src = document.querySelector('table.tg-by-source');
  var th = src.tHead.rows[0].cells[2];
  th.click(); th.click();  // twice: descending
  out.sorted = Array.from(src.tBodies[0].rows).map(function (r) {
    return r.cells[2].dataset.v; }).join(',');
});
</script>"""


def chromium() -> str:
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if exe is None:
        pytest.fail(
            "headless Chromium is needed to check the HTML tables: "
            "apt-get update && apt-get install -y chromium  (Debian's package)"
        )
    return exe


def chain(ws, x):
    for w in ws:
        x = jnp.tanh(x @ w) + 0.5 * x
    return jnp.sum(x**2) + jnp.sum(jnp.sin(x))


class _Body(html.parser.HTMLParser):
    def __init__(self):
        super().__init__()
        self.body: dict[str, str] = {}
        self.classes: list[str] = []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "body":
            self.body = a
        if a.get("class"):
            self.classes.extend(f"{tag}.{c}" for c in a["class"].split())


def dump_dom(path, profile) -> tuple[str, _Body]:
    """The DOM Chromium builds from ``path`` (after the page's scripts ran), parsed."""
    dom = subprocess.run(
        [chromium(), *FLAGS, f"--user-data-dir={profile}", "--dump-dom", path.as_uri()],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert dom.returncode == 0, dom.stderr[-2000:]
    p = _Body()
    p.feed(dom.stdout)
    return dom.stdout, p


def screenshot_ink(path, profile, png, size: str) -> float:
    """Screenshot ``path`` into ``png``; the fraction of pixels unlike the background."""
    run = subprocess.run(
        [
            chromium(),
            *FLAGS,
            f"--user-data-dir={profile}",
            f"--window-size={size}",
            f"--screenshot={png}",
            path.as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert png.exists()
    import matplotlib.image

    img = matplotlib.image.imread(str(png))[..., :3]
    return float(np.mean(np.any(np.abs(img - img[0, 0]) > 0.2, axis=-1)))


@pytest.fixture(scope="module")
def page(tmp_path_factory):
    ws = [jnp.full((8, 8), 0.01 * (i % 3 + 1)) for i in range(60)]
    x = jnp.ones((4, 8))
    tape = tg.trace(chain)(ws, x)
    rep = tg.memory_report(
        chain, policy=P.route(lambda i: P.offload() if i.primitive == "dot_general" else P.save())
    )(ws, x)
    path = tmp_path_factory.mktemp("html") / "page.html"
    path.write_text(
        '<!doctype html><html><head><meta charset="utf-8"></head><body>'
        f"{tape._repr_html_()}<hr>{rep._repr_html_()}{PROBE}</body></html>",
        encoding="utf-8",
    )
    return path, tape, rep


def test_chromium_renders_the_tables(page, tmp_path):
    path, tape, rep = page
    out, p = dump_dom(path, tmp_path / "profile")
    for el in (
        "table.tapegrad-tape",
        "table.tapegrad-memory",
        "tr.tg-fold",
        "table.tg-inner",
        "table.tg-by-source",
    ):
        assert el in p.classes, el
    # the totals, as the browser parsed them
    assert f'data-key="records" data-v="{len(tape.records)}"' in out
    assert f'data-key="saved_bytes" data-v="{tape.saved_bytes}"' in out
    assert f'data-key="host_bytes" data-v="{rep.host_bytes}"' in out
    assert f"{rep.residual_bytes:,}" in out
    # laid out: tables have a width, an opened fold's columns line up with the header's
    b = p.body
    assert int(b["data-tape-width"]) > 400 and int(b["data-memory-width"]) > 400, b
    assert float(b["data-tape-misalign"]) <= 2 and float(b["data-memory-misalign"]) <= 2, b
    # the inline sort ran: the by-source table is now in descending byte order
    got = [int(v) for v in b["data-sorted"].split(",")]
    assert len(got) >= 2 and got == sorted(got, reverse=True), got


def test_chromium_screenshot_is_not_blank(page, tmp_path):
    path, _, _ = page
    png = tmp_path / "shot.png"
    ink = screenshot_ink(path, tmp_path / "profile", png, "1300,900")
    assert png.stat().st_size > 10_000
    assert 0.01 < ink < 0.6, ink  # text on a background: neither empty nor a solid block


GRAPH_PROBE = """<script>
window.addEventListener('load', function () {
  var out = document.body.dataset, svg = document.querySelector('div.tg-graph svg');
  var box = svg.getBoundingClientRect();
  out.graphNodes = svg.querySelectorAll('g.node').length;
  out.graphEdges = svg.querySelectorAll('g.edge').length;
  out.graphWidth = box.width.toFixed(0);
  out.graphHeight = box.height.toFixed(0);
  out.bodies = document.querySelectorAll('div.tg-graph details').length;
  var worst = 0;  // how far any label's text runs past its box
  svg.querySelectorAll('g.node').forEach(function (g) {
    var b = g.querySelector('rect,path,polygon').getBBox();
    g.querySelectorAll('text').forEach(function (t) {
      var r = t.getBBox();
      worst = Math.max(worst, b.x - r.x, r.x + r.width - b.x - b.width);
    });
  });
  out.textOverflow = worst.toFixed(1);
});
</script>"""


@pytest.mark.parametrize("engine", ["dot", "python"])
def test_chromium_draws_the_tape_graph(tmp_path, engine):
    """A 300-record tape's graph (folded) and a scan body under <details>, in a browser,
    laid out by Graphviz and by the Python back end."""
    if engine == "dot" and shutil.which("dot") is None:
        pytest.fail("Graphviz's dot is needed to draw tapes: apt-get install -y graphviz")

    def deep(ws, x):
        for w in ws:
            x = jnp.tanh(x @ w) * 0.5 + jnp.sin(x)

        def step(h, _):
            return jnp.tanh(h @ ws[0]), None

        x, _ = jax.lax.scan(step, x, None, length=5)
        return jnp.sum(x**2)

    ws = [jnp.eye(8) * 0.1] * 80
    tape = tg.trace(deep)(ws, jnp.ones((4, 8)))
    assert len(tape.records) > 300
    g = tape.graph(bodies=False, engine=engine)
    path = tmp_path / "graph.html"
    path.write_text(
        '<!doctype html><html><head><meta charset="utf-8"></head><body>'
        f"{g._repr_html_()}{GRAPH_PROBE}</body></html>",
        encoding="utf-8",
    )
    _, p = dump_dom(path, tmp_path / "p1")
    b = p.body
    # every box drawn (top level, then the body's graph under its <details>)
    assert int(b["data-graph-nodes"]) == g.nodes, b
    assert int(b["data-graph-edges"]) > g.nodes // 2
    assert int(b["data-bodies"]) == 1
    assert int(b["data-graph-width"]) > 200 and int(b["data-graph-height"]) > 400, b
    assert float(b["data-text-overflow"]) <= (1 if engine == "python" else 4), b
    ink = screenshot_ink(path, tmp_path / "p2", tmp_path / "graph.png", "1000,1400")
    assert 0.005 < ink < 0.6, ink
