"""`JaxResiduals`' pictures (`tapegrad.report.jax_residuals` measures them): a text table
that fits 100 columns and a self-contained HTML table with a per-source-line summary,
repeated rows (a deep network's layers) folded as `memory_report`'s are. Reads the report
by its attributes only."""

from __future__ import annotations

from typing import Any

from tapegrad.core.tape import aval_str
from tapegrad.display.common import (
    WIDTH,
    _fold_html,
    _fold_text,
    clip,
    fold_runs,
    human_bytes,
    sharding_lines,
    short_source,
)
from tapegrad.display.html import (
    by_source_table,
    cell,
    e,
    folded_rows,
    header,
    page,
    prim_counts,
    stat,
    width,
)
from tapegrad.display.memory import report_decision

__all__ = ["jax_residuals_html", "jax_residuals_text"]


def _kept_as(r: Any, short: bool = False) -> str:
    """How a row is kept: ``argument ws[1]``, ``named 'act'``, ``in scan ×200``."""
    what = r.what
    if short and what.startswith("argument "):
        what = "arg " + what[len("argument ") :]
    parts = [what] if what else []
    if r.where:
        parts.append(f"in {r.where}")
    if r.read_by and not short:
        parts.append(f"read by {r.read_by}")
    return ", ".join(parts)


def _sig(r: Any) -> tuple:
    return (
        r.primitive,
        aval_str(r.shape, r.dtype),
        r.device_bytes,
        r.host_bytes,
        r.is_input,
        "" if r.is_input else r.what,
        r.where,
        short_source(r.source, 36),
    )


def _head(jr: Any) -> list[str]:
    nums = jr.argnums[0] if len(jr.argnums) == 1 else jr.argnums
    per = " per device" if jr.devices > 1 else ""
    lines = [
        f"jax_residuals({jr.fun}, argnums={nums}): what jax.vjp keeps for backward",
        f"  backward holds {jr.beyond_inputs_bytes:,} B{per} beyond the inputs",
        f"  + the inputs themselves {jr.inputs_bytes:,} B, kept as they are (the caller holds "
        f"them) = {jr.total_bytes:,} B",
        f"  in {_count(len(jr.rows), 'array')} (vjp_fn's {_count(jr.leaves, 'leaf')}); "
        f"by kind: device {jr.device_bytes:,}, host {jr.host_bytes:,}",
    ]
    lines += sharding_lines(jr.devices, jr.processes)
    lines = [clip(line, WIDTH) for line in lines]
    for note in jr.notes:
        lines.append(clip(f"  note: {note}", WIDTH))
    return lines


def _count(n: int, what: str) -> str:
    plural = {"leaf": "leaves"}.get(what, what + "s")
    return f"{n:,} {what if n == 1 else plural}"


def jax_residuals_text(jr: Any) -> str:
    rows = jr.rows

    def row(i: int) -> str:
        r = rows[i]
        head = (
            f"{r.index:>5} {clip(r.primitive, 14):<14} {clip(aval_str(r.shape, r.dtype), 16):<16} "
            f"{r.bytes:>11,}  {clip(_kept_as(r, True), 18):<18} "
        )
        return head + short_source(r.source, WIDTH - len(head))

    lines = _head(jr)
    lines.append(f"{'#':>5} {'primitive':<14} {'array':<16} {'bytes':>11}  {'kept as':<18} source")
    for start, p, n in fold_runs([_sig(r) for r in rows], _fold_text):
        if n == 1:
            lines.append(row(start))
            continue
        lines.extend(row(i) for i in range(start, start + p))
        hidden = rows[start + p : start + (n - 1) * p]
        what = "row" if p == 1 else f"{p} rows"
        lines.append(
            clip(
                f"    ⋮ {n - 2} × the {what} above again (#{hidden[0].index}–"
                f"#{hidden[-1].index}): {sum(x.bytes for x in hidden):,} B",
                WIDTH,
            )
        )
        lines.extend(row(i) for i in range(start + (n - 1) * p, start + n * p))
    return "\n".join(lines)


_COLS = (
    ("#", "n", 6),
    ("primitive", "", 14),
    ("array", "", 18),
    ("bytes", "n", 12),
    ("decision", "", 9),
    ("kept as", "", 34),
    ("source", "", 40),
)


def jax_residuals_html(jr: Any) -> str:
    rows = jr.rows

    def row(i: int) -> str:
        r = rows[i]
        dec = report_decision(r)
        return (
            "<tr>"
            + cell(r.index, "n", r.index)
            + cell(r.primitive)
            + cell(aval_str(r.shape, r.dtype), limit=18)
            + cell(f"{r.bytes:,}", "n", r.bytes)
            + cell(dec, "d-" + dec.split("+")[-1])
            + cell(_kept_as(r), limit=34)
            + cell(short_source(r.source, 40), title=r.source)
            + "</tr>"
        )

    def summary(start: int, p: int, n: int) -> str:
        run = rows[start : start + p * n]
        what = f"{p} rows" if p > 1 else "row"
        return (
            f"<b>{n} ×</b> the same {what} (#{run[0].index}–#{run[-1].index}): "
            f"{e(clip(' '.join(x.primitive for x in run[:p]), 80))} · "
            f"<b>{sum(x.bytes for x in run):,}</b> B · {e(short_source(run[0].source, 40))}"
        )

    colgroup, thead = header(_COLS)
    body = "".join(folded_rows(fold_runs([_sig(r) for r in rows], _fold_html), row, summary, _COLS))
    table = (
        f'<table class="tapegrad-jax-residuals" {width(_COLS)}>{colgroup}{thead}'
        f"<tbody>{body}</tbody></table>"
    )
    nums = jr.argnums[0] if len(jr.argnums) == 1 else jr.argnums
    totals = [
        stat("jax.vjp of", f"{jr.fun}, argnums={nums}", "fun"),
        stat(
            "held beyond the inputs",
            jr.beyond_inputs_bytes,
            "beyond_inputs_bytes",
            human_bytes(jr.beyond_inputs_bytes),
        ),
        stat("the inputs themselves", jr.inputs_bytes, "inputs_bytes", "the caller holds them"),
        stat("residual bytes", jr.total_bytes, "total_bytes", human_bytes(jr.total_bytes)),
        stat("device", jr.device_bytes, "device_bytes"),
        stat("host", jr.host_bytes, "host_bytes"),
        stat("arrays", len(rows), "rows", f"in {jr.leaves:,} leaves of vjp_fn"),
    ]
    groups: dict[str, dict[str, Any]] = {}
    for r in rows:
        g = groups.setdefault(r.source, {"rows": 0, "bytes": 0, "inputs": 0, "prims": []})
        g["rows"] += 1
        g["bytes"] += r.bytes
        g["inputs"] += r.bytes if r.is_input else 0
        g["prims"].append(r.primitive)

    def src_cells(src: str, g: dict[str, Any]) -> str:
        return (
            cell(short_source(src, 44), title=src)
            + cell(g["rows"], "n", g["rows"])
            + "".join(cell(f"{g[k]:,}", "n", g[k]) for k in ("bytes", "inputs"))
            + cell(prim_counts(g["prims"]), limit=50)
        )

    extra = by_source_table(
        groups,
        (
            ("source", "", 46),
            ("arrays", "n", 7),
            ("bytes", "n", 12),
            ("of inputs", "n", 12),
            ("primitives", "", 40),
        ),
        src_cells,
    )
    return page("tg-jax-residuals", totals, table, extra, [f"note: {n}" for n in jr.notes])
