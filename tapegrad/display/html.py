"""HTML pictures: the building blocks every HTML table shares (the stylesheet, cells,
totals, fixed-width headers, folded runs as ``<details>`` rows, loop bodies as nested
tables, the sortable per-source-line table), and the tape's own table (Jupyter's
``_repr_html_``), registered as the tape's ``"html"`` printer on import."""

from __future__ import annotations

import html
import re
from collections.abc import Callable, Sequence
from typing import Any

from tapegrad.core.tape import aval_str, register_printer
from tapegrad.display.common import (
    _bytes_with_bodies,
    _fold_html,
    _record_sig,
    _walk,
    body_label,
    clip,
    fold_runs,
    human_bytes,
    loop_bytes_text,
    param_items,
    short_source,
)
from tapegrad.engine.loops.saves import forwarded_ids, step_residual_vars

__all__ = ["tape_html"]


_CSS = """
.tg-view{font:12px/1.4 ui-monospace,SFMono-Regular,Menlo,Consolas,monospace;color:inherit;
 max-width:100%;overflow-x:auto;margin:4px 0}
.tg-view .tg-totals{display:flex;flex-wrap:wrap;gap:6px;margin:2px 0 8px}
.tg-view .tg-stat{border:1px solid rgba(127,127,127,.35);border-radius:4px;padding:3px 8px}
.tg-view .tg-stat b{display:block;font-size:13px}
.tg-view .tg-stat small{opacity:.7}
.tg-view table{border-collapse:collapse;table-layout:fixed;margin:0}
.tg-view th,.tg-view td{padding:2px 6px;border-bottom:1px solid rgba(127,127,127,.2);
 white-space:nowrap;overflow:hidden;text-overflow:ellipsis;text-align:left;vertical-align:top}
.tg-view th{border-bottom:2px solid rgba(127,127,127,.5);font-weight:600}
.tg-view thead.tg-sort th{cursor:pointer}
.tg-view td.n,.tg-view th.n{text-align:right}
.tg-view tbody tr:hover{background:rgba(127,127,127,.12)}
.tg-view tr.tg-fold>td{padding:0;background:rgba(90,140,230,.10)}
.tg-view summary{cursor:pointer;padding:3px 6px;white-space:normal}
.tg-view summary b{color:#3b7dd8}
.tg-view table.tg-inner{margin:0 0 4px 0}
.tg-view .d-recompute{color:#8a5cf6}.tg-view .d-offload{color:#0e9f8e}
.tg-view .d-compress{color:#d97706}.tg-view .fallback{color:#d9480f}
.tg-view details.tg-by-source{margin-top:8px}
.tg-view tr.tg-body>td{padding:0;box-shadow:inset 3px 0 rgba(14,159,142,.45)}
.tg-view tr.tg-body summary{padding-left:calc(6px + 2ch)}
.tg-view table.tg-body{margin:0}
.tg-view .tg-notes{margin:6px 0;color:#d9480f;white-space:normal}
"""

# Clicking a header sorts that column (numbers by their data-v value); toggles direction.
_SORT_JS = (
    "var t=event.target;if(t.tagName!='TH')return;var b=this.parentNode.tBodies[0],"
    "i=t.cellIndex,d=t.dataset.d=-(t.dataset.d||-1),r=Array.from(b.rows);"
    "r.sort(function(x,y){x=x.cells[i];y=y.cells[i];var u=x.dataset.v,v=y.dataset.v;"
    "if(u!==undefined)return d*(u-v);u=x.textContent;v=y.textContent;"
    "return d*(u<v?-1:u>v?1:0)});r.forEach(function(e){b.appendChild(e)})"
)

e = html.escape


def cell(
    text: Any,
    cls: str = "",
    num: int | None = None,
    title: str | None = None,
    limit: int = 0,
    style: str = "",
) -> str:
    """A ``<td>``; long text is clipped with its full value in the tooltip."""
    s = str(text)
    if limit and len(s) > limit:
        title, s = title or s, clip(s, limit)
    attrs = f' class="{cls}"' if cls else ""
    attrs += f' style="{e(style)}"' if style else ""
    attrs += f' data-v="{num}"' if num is not None else ""
    attrs += f' title="{e(title)}"' if title else ""
    return f"<td{attrs}>{e(s)}</td>"


def stat(label: str, value: int | str, key: str, note: str = "") -> str:
    """One total at the top, machine-readable in ``data-key`` / ``data-v``."""
    shown = f"{value:,}" if isinstance(value, int) else e(value)
    v = f' data-v="{value}"' if isinstance(value, int) else ""
    note = f" <small>{e(note)}</small>" if note else ""
    return (
        f'<div class="tg-stat" data-key="{key}"{v}><small>{e(label)}</small>'
        f"<b>{shown}{note}</b></div>"
    )


def width(cols: Sequence[tuple[str, str, int]]) -> str:
    """The style attribute giving a fixed-layout table the sum of its column widths."""
    return f'style="width:calc({sum(w for _, _, w in cols)}ch + {12 * len(cols)}px)"'


def header(cols: Sequence[tuple[str, str, int]], sortable: bool = False) -> tuple[str, str]:
    """``(colgroup, thead)`` for columns ``(title, 'n' for numbers or '', width in ch)``.
    Fixed widths keep the rows of a folded group aligned with the table's."""
    # Columns are w ch of text plus 12px of padding; a fixed-layout table needs its width.
    colgroup = (
        "<colgroup>"
        + "".join(f'<col style="width:calc({w}ch + 12px)">' for _, _, w in cols)
        + "</colgroup>"
    )
    ths = "".join(f'<th class="{c}">{e(t)}</th>' if c else f"<th>{e(t)}</th>" for t, c, _ in cols)
    onclick = (
        f' class="tg-sort" onclick="{e(_SORT_JS)}" title="click a column to sort"'
        if sortable
        else ""
    )
    return colgroup, f"<thead{onclick}><tr>{ths}</tr></thead>"


def folded_rows(
    runs,
    row: Callable[[int], str],
    summary: Callable[[int, int, int], str],
    cols: Sequence[tuple[str, str, int]],
) -> list[str]:
    """Table rows; each folded run becomes one ``<details>`` row holding its block once."""
    colgroup, _ = header(cols)
    out = []
    for start, p, r in runs:
        if r == 1:
            out.append(row(start))
            continue
        inner = "".join(row(i) for i in range(start, start + p))
        out.append(
            f'<tr class="tg-fold" data-start="{start}" data-period="{p}" data-repeats="{r}">'
            f'<td colspan="{len(cols)}"><details><summary>'
            f'{summary(start, p, r)}</summary><table class="tg-inner" {width(cols)}>'
            f"{colgroup}"
            f"<tbody>{inner}</tbody></table></details></td></tr>"
        )
    return out


def by_source_table(
    groups: dict[str, dict[str, Any]],
    cols: Sequence[tuple[str, str, int]],
    cells: Callable[[str, dict[str, Any]], str],
) -> str:
    """A sortable table, one row per source line (``groups`` in display order)."""
    colgroup, thead = header(cols, sortable=True)
    rows = "".join(f"<tr>{cells(src, g)}</tr>" for src, g in groups.items())
    return (
        f'<details class="tg-by-source"><summary>By source line '
        f"({len(groups)} lines; click a column to sort)</summary>"
        f'<table class="tg-by-source" {width(cols)}>{colgroup}{thead}<tbody>{rows}</tbody>'
        "</table></details>"
    )


def page(
    cls: str, totals: Sequence[str], table: str, extra: str = "", notes: Sequence[str] = ()
) -> str:
    """A view: its totals, its table, then ``notes`` (one line each) and ``extra``."""
    if notes:
        lines = "".join(f"<div>{e(n)}</div>" for n in notes)
        extra = f'<div class="tg-notes">{lines}</div>{extra}'
    return (
        f'<div class="tg-view {cls}"><style>{_CSS}</style>'
        f'<div class="tg-totals">{"".join(totals)}</div>{table}{extra}</div>'
    )


def prim_counts(prims: Sequence[str], limit: int = 4) -> str:
    counts: dict[str, int] = {}
    for p in prims:
        counts[p] = counts.get(p, 0) + 1
    top = sorted(counts.items(), key=lambda kv: -kv[1])
    s = ", ".join(f"{p}×{n}" if n > 1 else p for p, n in top[:limit])
    return s + (f", +{len(top) - limit} more" if len(top) > limit else "")


def body_row(summary: str, rows: str, cols: Sequence[tuple[str, str, int]], attrs: str) -> str:
    """A row holding a loop/branch body: an open ``<details>`` with the body's rows in a
    table of the same columns (nested bodies nest further)."""
    colgroup, _ = header(cols)
    return (
        f'<tr class="tg-body" {attrs}><td colspan="{len(cols)}"><details open>'
        f'<summary>{summary}</summary><table class="tg-body" {width(cols)}>{colgroup}'
        f"<tbody>{rows}</tbody></table></details></td></tr>"
    )


# ------------------------------------------------------------------ tape: HTML

_TAPE_COLS = (
    ("#", "n", 6),
    ("primitive", "", 15),
    ("inputs", "", 22),
    ("outputs", "", 14),
    ("saves", "", 27),
    ("saves B", "n", 11),
    ("decision", "", 11),
    ("source", "", 40),
)


def _decision(rec) -> tuple[str, str]:
    """(text, css class) of a record's decision column."""
    if rec.decision == "recompute":
        text = "recompute"
    else:
        text = "save" if rec.saves else ""
    if rec.rule == "fallback":
        return (text + " · fallback").lstrip(" ·"), "fallback"
    return text, f"d-{text}" if text else ""


def _body_summary(rec, b: int, n_records: int, per_step: bool) -> str:
    what = f"{n_records} record{'s' if n_records != 1 else ''}"
    nbytes = re.sub(r"([\d,]+ B)", r"<b>\1</b>", e(loop_bytes_text(rec, b, per_step)))
    return f"<b>{e(body_label(rec, b))}</b>: {what} · {nbytes} kept for backward"


def _tape_rows(tape, per_step: bool, depth: int, fwd=frozenset()) -> list[str]:
    """Rows of ``tape``'s records; in a body (``depth`` > 0), ``fwd`` are the residuals
    the loop record keeps once, not counted in the records' per-step bytes."""
    recs = tape.records
    indent = f"padding-left:calc(6px + {2 * depth}ch)" if depth else ""

    def row(i: int) -> str:
        r = recs[i]
        ins = ", ".join(getattr(x, "aval", str(x)) for x in r.inputs)
        outs = ", ".join(o.aval for o in r.outputs)
        saves = ", ".join(f"{s} {aval_str(s.shape, s.dtype)}" for s in r.saves)
        if saves and per_step:
            saves = f"per step: {saves}"
        dec, cls = _decision(r)
        params = " ".join(param_items(r))
        once = sum(x.nbytes for x in r.saves if r.residual_key(x) in fwd)
        own = r.saved_bytes - once
        nbytes = _bytes_with_bodies(r) - once
        notes = []
        if depth and r.saves:
            notes.append("bytes of one step" if per_step else "bytes of one run")
        if r.bodies and nbytes != own:
            notes.append(f"{own:,} B its own saves, {nbytes - own:,} B its bodies'")
        if once:
            notes.append(f"not counting {once:,} B the loop record keeps once")
        note = "; ".join(notes) or None
        out = (
            "<tr>"
            + cell(r.index, "n", r.index)
            + cell(r.primitive, title=clip(params, 300) if params else None, style=indent)
            + cell(ins, limit=60)
            + cell(outs, limit=60)
            + cell(saves, limit=80)
            + cell(f"{nbytes:,}", "n", nbytes, title=note)
            + cell(dec, cls)
            + cell(short_source(r.short_source, 40), title=r.source)
            + "</tr>"
        )
        looped = per_step or r.primitive == "scan"
        for b, body in enumerate(r.bodies):
            step = sum(step_residual_vars(r, b).values()) if r.in_backward else 0
            out += body_row(
                _body_summary(r, b, len(body.records), per_step),
                "".join(_tape_rows(body, looped, depth + 1, forwarded_ids(r))),
                _TAPE_COLS,
                f'data-record="{r.index}" data-branch="{b}" data-trip-count="{r.trip_count}" '
                f'data-step-bytes="{step}"',
            )
        return out

    def summary(start: int, p: int, r: int) -> str:
        block = recs[start : start + p]
        nbytes = sum(_bytes_with_bodies(x) for x in recs[start : start + p * r])
        srcs = sorted({short_source(x.short_source, 40) for x in block})
        what = f"{p} records" if p > 1 else "record"
        return (
            f"<b>{r} ×</b> the same {what} (#{start}–#{start + p * r - 1}): "
            f"{e(clip(' '.join(x.primitive for x in block), 80))} · "
            f"<b>{nbytes:,}</b> B in saves{' per step' if per_step else ''} · "
            f"{e(clip(', '.join(srcs), 90))}"
        )

    runs = fold_runs([_record_sig(r) for r in recs], _fold_html)
    return folded_rows(runs, row, summary, _TAPE_COLS)


def tape_html(tape) -> str:
    recs = tape.records
    colgroup, thead = header(_TAPE_COLS)
    body = "".join(_tape_rows(tape, False, 0))
    table = (
        f'<table class="tapegrad-tape" {width(_TAPE_COLS)}>{colgroup}{thead}'
        f"<tbody>{body}</tbody></table>"
    )

    kept = tape.residual_vars()
    input_ids = {v.id for v in tape.inputs}
    in_bytes = sum(b for k, b in kept.items() if isinstance(k, int) and k in input_ids)
    loop_bytes = sum(b for k, b in kept.items() if type(k) is tuple and k[0] == "body")
    walked = list(_walk(tape))
    n_re = sum(r.decision == "recompute" for r, _, _ in walked)
    n_fb = sum(r.rule == "fallback" for r, _, _ in walked)
    totals = [
        stat("records", len(recs), "records"),
        stat(
            "kept for backward (distinct)",
            tape.saved_bytes,
            "saved_bytes",
            human_bytes(tape.saved_bytes),
        ),
        stat("of which the inputs", in_bytes, "input_bytes"),
        stat("activations", tape.saved_bytes - in_bytes, "activation_bytes"),
        stat("recomputed records", n_re, "recompute"),
        stat("fallback rules", n_fb, "fallback"),
    ]
    n_inner = sum(1 for _, _, d in walked if d)
    if n_inner:
        totals[1:1] = [stat("records in loop/branch bodies", n_inner, "body_records")]
        totals.insert(
            -2, stat("of which loop bodies (all steps)", loop_bytes, "loop_bytes", "per step × T")
        )

    # Per source line: a loop record's own saves, its body records' saves × their steps.
    groups: dict[str, dict[str, Any]] = {}
    for r, mult, _ in walked:
        g = groups.setdefault(
            r.short_source, {"records": 0, "bytes": 0, "prims": [], "full": r.source}
        )
        g["records"] += 1
        g["bytes"] += r.saved_bytes * mult
        g["prims"].append(r.primitive)

    def src_cells(src: str, g: dict[str, Any]) -> str:
        return (
            cell(short_source(src, 44), title=g["full"])
            + cell(g["records"], "n", g["records"])
            + cell(f"{g['bytes']:,}", "n", g["bytes"])
            + cell(prim_counts(g["prims"]), limit=60)
        )

    extra = by_source_table(
        groups,
        (("source", "", 46), ("records", "n", 9), ("saves B", "n", 13), ("primitives", "", 48)),
        src_cells,
    )
    return page("tg-tape", totals, table, extra)


register_printer("html", tape_html)
