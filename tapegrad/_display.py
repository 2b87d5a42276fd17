"""Pictures of a `Tape` and a `MemoryReport`: plain text that fits 100 columns, and
self-contained HTML tables for Jupyter and browsers.

Both fold long runs: a block of records (or report rows) repeated many times in a
row — the layers of a deep network — shows once with a count, so a 2,000-record
tape stays a screenful. In HTML the fold is a ``<details>`` row (no JavaScript
needed to expand it); a per-source-line summary follows the table.
"""

from __future__ import annotations

import html
import re
from collections.abc import Callable, Hashable, Sequence
from typing import Any

from tapegrad._loop_records import (
    forwarded_ids,
    loop_bytes,
    loop_residual_bytes,
    step_residual_vars,
)
from tapegrad._tape import aval_str, register_printer

WIDTH = 100  # every line of str(tape) / str(report) fits in this many columns
MAX_PERIOD = 64  # longest repeated block looked for (a transformer layer is ~40 records)


def clip(s: str, n: int) -> str:
    """``s`` cut to ``n`` characters, ending in an ellipsis when cut."""
    return s if len(s) <= n else (s[: n - 1] + "…" if n > 0 else "")


_SRC = re.compile(r"^(.*):(\d+) \((.*)\)$")


def short_source(src: str, limit: int = 40) -> str:
    """``file:line (function)`` with the directory dropped, shortened to ``limit``.

    The line number is never cut; the function name is shortened first, then the
    middle of the file name (its extension kept), so the location stays findable.
    """
    m = _SRC.match(src)
    if m is None:
        return clip(src.rsplit("/", 1)[-1], limit)
    file, line, fn = m.group(1).rsplit("/", 1)[-1], m.group(2), m.group(3)
    s = f"{file}:{line} ({fn})"
    if len(s) <= limit:
        return s
    room = limit - len(f"{file}:{line} ()")
    if room >= 8:
        return f"{file}:{line} ({clip(fn, room)})"
    fn = clip(fn, 8)
    room = max(limit - len(f":{line} ({fn})"), 6)
    if len(file) > room:
        head = (room - 1) // 2
        file = file[:head] + "…" + file[len(file) - (room - 1 - head) :]
    return f"{file}:{line} ({fn})"


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1024
    return f"{n:,.1f} TiB"  # pragma: no cover


# ------------------------------------------------------------------ folding


def fold_runs(
    sigs: Sequence[Hashable], fold: Callable[[int, int], bool], max_period: int = MAX_PERIOD
) -> list[tuple[int, int, int]]:
    """Cover ``sigs`` by ``(start, period, repeats)`` pieces, left to right.

    At each position the block length (≤ ``max_period``) whose back-to-back repeats cover
    the most items wins (the shorter block on ties); ``fold(period, repeats)`` says
    whether that run is worth folding, else the item stands alone as ``(i, 1, 1)``.
    """
    ids: dict[Hashable, int] = {}
    s = [ids.setdefault(x, len(ids)) for x in sigs]
    n, i, out = len(s), 0, []
    while i < n:
        cover, period = 0, 0
        for p in range(1, min(max_period, (n - i) // 2) + 1):
            if s[i + p] != s[i]:
                continue
            block, r = s[i : i + p], 1
            while s[i + r * p : i + (r + 1) * p] == block:
                r += 1
            if r >= 2 and r * p > cover:
                cover, period = r * p, p
        if period and fold(period, cover // period):
            out.append((i, period, cover // period))
            i += cover
        else:
            out.append((i, 1, 1))
            i += 1
    return out


# ------------------------------------------------------------------ tape: text


def _fold_text(p: int, r: int) -> bool:
    """Text shows a folded run's first and last block: fold when that hides ≥ 4 lines."""
    return r >= 3 and (r - 2) * p >= 4


def _fold_html(p: int, r: int) -> bool:
    return r >= 3 and p * r >= 8


def _fit_params(items: list[str], room: int) -> str:
    """Params shortened to ``room`` columns: ``=None`` defaults dropped first, then
    whole items from the end (ending in ``…``); a first item is cut only if long."""
    s = " ".join(items)
    if len(s) <= room:
        return s
    items = [i for i in items if not i.endswith("=None")] or items[:1]
    s = " ".join(items)
    if len(s) <= room:
        return s
    while len(s) > room and len(items) > 1:
        items = items[:-1]
        s = " ".join(items) + " …"
    if len(s) > room:
        s = clip(items[0], room) if room >= 14 else "…"
    return s


# Params a loop record shows: its sub-programs are printed as bodies under it.
_SCAN_PARAMS = ("length", "reverse", "unroll")


def param_items(rec) -> list[str]:
    """A record's params as shown: a scan's length / reverse / unroll only (its body is
    printed under it), a cond's number of branches (printed under it)."""
    if rec.primitive == "scan" and rec.bodies:
        return [f"{k}={rec.params[k]}" for k in _SCAN_PARAMS if k in rec.params]
    items = rec.param_items()
    if rec.primitive == "cond" and rec.bodies:  # the branches printed under it: their count
        return [f"branches={len(rec.bodies)}" if i.startswith("branches=") else i for i in items]
    return items


def body_label(rec, b: int) -> str:
    """``scan ×1000 body`` / ``cond branch 0``."""
    if rec.primitive == "cond":
        return f"cond branch {b}"
    return f"{rec.primitive} ×{rec.trip_count:,} body"


def _bytes_with_bodies(rec) -> int:
    """What a record keeps: its own saves, and its bodies' per-step residuals × steps."""
    return rec.saved_bytes + (loop_residual_bytes(rec) if rec.bodies and rec.in_backward else 0)


def _tail(rec, per_step: bool = False) -> str:
    tag = "saves/step" if per_step else "saves"
    tail = f"   {tag}[{','.join(map(str, rec.saves))}]" if rec.saves else ""
    tail += " (fallback)" if rec.rule == "fallback" else ""
    return tail + (" (recompute)" if rec.decision == "recompute" else "")


def _fit_record(rec, budget: int, per_step: bool = False) -> str:
    """One record as ``outs = prim[params] ins   saves[..]``, shortened to ``budget`` columns:
    params first, then the inputs, then the outputs; the primitive and saves stay whole."""
    outs = " ".join(f"{o}:{o.aval}" for o in rec.outputs)
    ins = " ".join(str(i) for i in rec.inputs)
    items = param_items(rec)
    params = " ".join(items)
    tail = _tail(rec, per_step)

    def render() -> str:
        return f"{outs} = {rec.primitive}{f'[{params}]' if params else ''} {ins}{tail}"

    line = render()
    if len(line) > budget and params:  # =None defaults go first, long params down to 24
        params = _fit_params(items, max(budget - (len(line) - len(params)), 24))
        line = render()
    if len(line) > budget:
        ins = clip(ins, max(budget - (len(line) - len(ins)), 16))
        line = render()
    if len(line) > budget and params:
        params = _fit_params(items, budget - (len(line) - len(params)))
        line = render()
    if len(line) > budget:
        outs = clip(outs, max(budget - (len(line) - len(outs)), 12))
        line = render()
    return clip(line, budget)


def _record_sig(rec) -> tuple:
    return (
        rec.primitive,
        " ".join(param_items(rec)),
        tuple(getattr(i, "aval", str(i)) for i in rec.inputs),
        tuple(o.aval for o in rec.outputs),
        tuple(map(str, rec.saves)),
        rec.rule,
        rec.decision,
        rec.short_source,
        tuple(tuple(_record_sig(r) for r in body.records) for body in rec.bodies),
    )


def _var_list(vs: Sequence[Any], limit: int) -> str:
    """``a:f32[3] b:f32[3]``; runs of ≥3 same-shaped values as ``a…sf:f32[8,8]``."""
    full = " ".join(f"{v}:{v.aval}" for v in vs)
    if len(full) <= limit:
        return full
    parts, i = [], 0
    while i < len(vs):
        j = i
        while j + 1 < len(vs) and vs[j + 1].aval == vs[i].aval:
            j += 1
        if j - i >= 2:
            parts.append(f"{vs[i]}…{vs[j]}:{vs[i].aval}")
        else:
            parts.extend(f"{v}:{v.aval}" for v in vs[i : j + 1])
        i = j + 1
    s = " ".join(parts)
    count = f" ({len(vs)} values)"
    return s if len(s) <= limit else clip(s, limit - len(count)) + count


# A body is printed under its record: its header two columns right of the record's text,
# its records four further (as the tape's own records sit under ``{ lambda``).
BODY_INDENT = 6


def _head(tape, col: int, label: str = "") -> str:
    consts = " ".join(str(v) for v, _ in tape.consts)
    consts = clip(consts, 30) if consts else ""
    head = f"{' ' * col}{label}{{ lambda {consts} ; "
    return head + _var_list(tape.inputs, WIDTH - len(head) - len(". let")) + ". let"


def _record_lines(tape, col: int, per_step: bool) -> list[str]:
    """The records of ``tape`` at column ``col`` + 4, each loop/branch record followed by
    its bodies (nested further); repeated runs folded."""
    recs = tape.records
    pad = " " * (col + 4)
    avail = WIDTH - len(pad) - 4  # the record and its source comment, after "  # "
    srcs = [short_source(r.short_source, min(36, max(16, avail - 48))) for r in recs]
    # One column for every source comment: bodies shrink to fit beside the longest.
    room = avail - max((len(s) for s in srcs), default=0)
    texts = [_fit_record(r, room, per_step) for r in recs]
    width = max((len(b) for b in texts), default=0)
    for i, r in enumerate(recs):
        if not texts[i].endswith(_tail(r, per_step)) or (r.bodies and "[…]" in texts[i]):
            # Too long even shortened (the saves, or a loop's length, would be cut): this
            # line takes room from its source comment, which keeps at least file:line.
            texts[i] = _fit_record(r, avail - 22, per_step)
            srcs[i] = short_source(r.short_source, avail - max(len(texts[i]), width))

    def rows(i: int) -> list[str]:
        r = recs[i]
        out = [f"{pad}{texts[i].ljust(width)}  # {srcs[i]}"]
        for b, body in enumerate(r.bodies):
            out.extend(_body_lines(r, b, body, col + BODY_INDENT, per_step))
        return out

    lines: list[str] = []
    for start, p, r in fold_runs([_record_sig(r) for r in recs], _fold_text):
        if r == 1:
            lines.extend(rows(start))
            continue
        for i in range(start, start + p):
            lines.extend(rows(i))
        hidden = range(start + p, start + (r - 1) * p)
        nbytes = sum(_bytes_with_bodies(recs[i]) for i in hidden)
        what = "record" if p == 1 else f"{p} records"
        lines.append(
            clip(
                f"{pad}⋮ {r - 2} × the {what} above again (#{hidden[0]}–#{hidden[-1]}), "
                f"{nbytes:,} bytes saved{' per step' if per_step else ''}",
                WIDTH,
            )
        )
        for i in range(start + (r - 1) * p, start + r * p):
            lines.extend(rows(i))
    return lines


def loop_bytes_text(rec, b: int, per_step: bool = False) -> str:
    """What body ``b`` of a loop/branch record keeps, in words: ``2,048 B per step × 200
    = 409,600 B``; a shared carry, a checkpoint schedule and a cond's branch say so."""
    if not rec.in_backward:
        return "0 B"
    if rec.primitive != "scan":
        step = sum(step_residual_vars(rec, b).values())
        return f"{step:,} B{' per step' if per_step else ''}"
    lb = loop_bytes(rec)
    T = rec.trip_count
    if lb.checkpoints:
        rest = lb.total - lb.checkpoints * lb.carry
        where = (
            f"revolve carries ({rec.snapshots:,} snapshots)"
            if rec.snapshots
            else f"carries every {_levels_text(rec)}"
        )
        return (
            f"{where}: {lb.checkpoints:,} × {lb.carry:,} B + "
            f"last {lb.steps:,} steps {rest:,} B = {lb.total:,} B"
        )
    if lb.shared:  # a carry saved as input is the step before's output: the first once
        return f"{lb.step - lb.shared:,} B per step × {T:,} + {lb.shared:,} B once = {lb.total:,} B"
    return f"{lb.step:,} B per step × {T:,} = {lb.total:,} B"


def _body_lines(rec, b: int, body, col: int, per_step: bool) -> list[str]:
    """One body of a loop/branch record: header, records, and a footer with its bytes."""
    looped = per_step or rec.primitive == "scan"
    n = len(body.records)
    lines = [_head(body, col, body_label(rec, b) + ": ")]
    lines.extend(_record_lines(body, col, looped))
    outs = " ".join(str(o) for o in body.outputs)
    foot = f"  # {n} record{'s' if n != 1 else ''}, {loop_bytes_text(rec, b, per_step)}"
    lines.append(clip(f"{' ' * (col + 2)}in ({clip(outs, 40)}) }}{foot}", WIDTH))
    return lines


def _walk(tape, mult: int = 1, depth: int = 0):
    """(record, how many times its saves are held, depth) over ``tape`` and its bodies."""
    for rec in tape.records:
        yield rec, mult, depth
        for body in rec.bodies:
            yield from _walk(body, mult * rec.trip_count, depth + 1)


def tape_text(tape) -> str:
    lines = [_head(tape, 0)]
    lines.extend(_record_lines(tape, 0, False))
    outs = " ".join(str(o) for o in tape.outputs)
    lines.append(f"  in ({clip(outs, WIDTH - 9)}) }}")
    inner = sum(1 for _, _, d in _walk(tape) if d)
    kept = tape.residual_vars()
    loops = sum(n for k, n in kept.items() if type(k) is tuple and k[0] == "body")
    foot = f"  # {len(tape.records)} records"
    foot += f" (+{inner:,} in bodies)" if inner else ""
    foot += f", {sum(kept.values()):,} bytes saved for backward"
    foot += f" ({loops:,} of them per step × steps)" if loops else ""
    lines.append(clip(foot, WIDTH))
    return "\n".join(lines)


# ------------------------------------------------------------------ HTML pieces

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


def page(cls: str, totals: Sequence[str], table: str, extra: str = "") -> str:
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


def body_row(summary: str, rows: str, cols: Sequence[tuple[str, str, int]], attrs: str) -> str:
    """A row holding a loop/branch body: an open ``<details>`` with the body's rows in a
    table of the same columns (nested bodies nest further)."""
    colgroup, _ = header(cols)
    return (
        f'<tr class="tg-body" {attrs}><td colspan="{len(cols)}"><details open>'
        f'<summary>{summary}</summary><table class="tg-body" {width(cols)}>{colgroup}'
        f"<tbody>{rows}</tbody></table></details></td></tr>"
    )


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


def _levels_text(rec) -> str:
    """A scan's segment lengths, outermost first: ``16`` or ``100/10``."""
    return "/".join(f"{k:,}" for k in (rec.schedule, *rec.inner_schedule))


register_printer("text", tape_text)
register_printer("html", tape_html)
