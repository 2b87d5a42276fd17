"""`MemoryReport`'s pictures (`tapegrad.display.text` and `_display_html` draw tapes): a
text table that fits 100 columns and a self-contained HTML table, with the report's
totals, its planned decisions and costs, and loops folded like the tape's."""

from __future__ import annotations

import textwrap
from typing import Any

from tapegrad.core.tape import aval_str
from tapegrad.display.common import (
    _SRC,
    WIDTH,
    _fold_html,
    _fold_text,
    _levels_text,
    body_label,
    clip,
    fold_runs,
    human_bytes,
    sharding_lines,
    short_source,
)
from tapegrad.display.html import (
    body_row,
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
from tapegrad.engine.loops.saves import schedule_text

__all__ = ["report_text", "report_html", "report_decision"]


def report_decision(r) -> str:
    """How a report row's residuals are kept, read off where their bytes live."""
    parts = []
    if r.device_bytes > r.compressed_bytes or not (r.host_bytes or r.compressed_bytes):
        parts.append("save")
    if r.host_bytes:
        parts.append("offload")
    if r.compressed_bytes:
        parts.append("compress")
    return "+".join(parts)


def _report_sig(r) -> tuple:
    return (
        r.primitive,
        r.saves,
        r.device_bytes,
        r.host_bytes,
        r.compressed_bytes,
        short_source(r.source, 36),
        tuple(_report_sig(x) for x in r.body),
    )


def _bodies_of(r, rec) -> list[tuple[int, list]]:
    """A report row's body rows grouped by body: ``(branch or 0, rows)`` in order."""
    groups: dict[int, list] = {}
    for x in r.body:
        groups.setdefault(x.branch or 0, []).append(x)
    return sorted(groups.items())


def _report_body_label(r, rec, b: int, rows: list) -> tuple[str, str]:
    """(label, ``100 B per step × 5 steps held = 500 B``) of one body of a report row."""
    runs = max((x.steps for x in rows), default=1)
    total = sum(x.bytes for x in rows)
    if rec is not None:
        label = body_label(rec, b)
    else:
        label = f"{r.primitive} branch {b}" if r.primitive == "cond" else f"{r.primitive} body"
    run = "step" if (rec is not None and rec.primitive == "scan") else "run"
    # runs of a cond differ by branch: a body's records can hold different numbers of runs
    per = f"{total // max(runs, 1):,}" if total % max(runs, 1) == 0 else f"{total / runs:,.1f}"
    return label, f"{per} B per {run} × {runs:,} {run}{'s' if runs != 1 else ''} held = {total:,} B"


def report_head(rep) -> list[str]:
    """The headline (what backward holds beyond the caller's inputs, and its peak), then
    the inputs' bytes, the split by kind and the peak with the inputs."""
    lines = [clip(f"memory_report(policy={rep.policy!r}):", WIDTH)]
    comp = sum(r.compressed_bytes for r in rep.records)
    beyond = rep.residual_bytes - rep.input_bytes
    peak_beyond = getattr(rep, "peak_beyond_inputs_bytes", rep.peak_bytes - rep.input_bytes)
    ndev = getattr(rep, "devices", 1)
    per = " per device" if ndev > 1 else ""
    lines.append(
        clip(
            f"  backward holds {beyond:,} B{per} beyond the inputs; peak {peak_beyond:,} B "
            "beyond the inputs",
            WIDTH,
        )
    )
    lines += [clip(line, WIDTH) for line in sharding_lines(ndev, getattr(rep, "processes", 1))]
    lines.append(
        clip(
            f"  + the inputs themselves {rep.input_bytes:,} B, kept as they are (the caller "
            f"holds them) = {rep.residual_bytes:,} B",
            WIDTH,
        )
    )
    lines.append(
        clip(
            f"  residuals by kind: device {rep.device_bytes:,}, host {rep.host_bytes:,}, "
            f"compressed {comp:,} (of those)",
            WIDTH,
        )
    )
    tail = f"  peak {rep.peak_bytes:,} B live over forward + backward, the inputs included"
    if rep.budget_bytes is not None:
        tail += f"; budget {rep.budget_bytes:,} B (inputs not counted)"
    lines.append(clip(tail, WIDTH))
    if rep.recompute_flops or rep.plan:
        why = f"  recompute {rep.recompute_flops / 1e6:,.2f} MFLOP in backward"
        if rep.plan:
            why += f"; planner chose {rep.plan}"
        lines.append(clip(why, WIDTH))
    if getattr(rep, "planned_peak_bytes", None) is not None:
        what = (
            f"  plan: predicted peak {rep.planned_peak_bytes:,} B on device, this run "
            f"{rep.measured_device_peak_bytes:,} B (activations, inputs not counted)"
        )
        if rep.planned_seconds is not None:
            what += f"; predicted +{_us(rep.planned_seconds)} a step"
        lines.append(clip(what, WIDTH))
        pt, mt = (
            getattr(rep, "planned_timeline", None),
            getattr(rep, "measured_plan_timeline", None),
        )
        if pt and mt:
            gap = max(abs(a[1] - b[1]) for a, b in zip(pt, mt)) if len(pt) == len(mt) else None
            tail = (
                "as predicted at every one"
                if gap == 0
                else f"largest gap {gap:,} B"
                if gap is not None
                else f"predicted {len(pt)} points, measured {len(mt)}"
            )
            lines.append(clip(f"  schedule: {len(mt)} points (plot_plan()); {tail}", WIDTH))
    if getattr(rep, "average_bits", None) is not None:
        counts: dict[int, int] = {}
        for b in rep.bits.values():
            counts[b] = counts.get(b, 0) + 1
        widths = ", ".join(f"{n} at {b}" for b, n in sorted(counts.items()))
        lines.append(
            clip(
                f"  bits: {rep.average_bits:.2f} a value on average (budget "
                f"{rep.budget_bits:g}); residuals {widths}",
                WIDTH,
            )
        )
    for note in getattr(rep, "notes", ()):
        lines.extend(
            textwrap.wrap(note, WIDTH, initial_indent="  note: ", subsequent_indent="        ")
        )
    for note in getattr(rep, "policy_notes", ()):
        lines.extend(
            textwrap.wrap(note, WIDTH, initial_indent="  policy: ", subsequent_indent="          ")
        )
    return lines


def _report_lines(rows, tape, depth: int, planned: bool = False, bits: bool = False) -> list[str]:
    """Report rows as text; a loop/branch record's body rows follow it, indented, each
    body under a line with its bytes per step."""
    pad = "  " * depth

    def row(i: int) -> list[str]:
        r = rows[i]
        rec = tape.records[r.index] if tape is not None and r.index < len(tape.records) else None
        saves = "(seg. input)" if r.saves == "(segment input)" else r.saves
        prim = r.primitive
        if r.body and rec is not None and rec.primitive == "scan":
            prim += f" ×{rec.trip_count:,}"
        src = short_source(r.source, 30)
        if depth:  # bytes of one run, then the source (its line, at least)
            per = f"{r.step_bytes:,} B/step · "
            src = short_source(r.source, 30 - len(per))
            m = _SRC.match(short_source(r.source, 99))
            if m is not None and ("…" in src or src.endswith("()")):
                src = clip(f"{m.group(1)}:{m.group(2)}", 30 - len(per))
            src = per + src
        plan = f"{clip(_planned_cell(r), 15):<15} " if planned else ""
        plan += f"{clip(r.bits, 5):<5} " if bits else ""
        out = [
            f"{r.index:>5} {clip(pad + prim, 14):<14} {clip(saves, 12):<12} "
            f"{r.device_bytes:>11,} {r.host_bytes:>11,} {r.compressed_bytes:>10,}  {plan}{src}"
        ]
        if r.checkpoint_bytes:
            every = _every_text(rec)
            out.append(f"{'':>5} {pad}  carries kept{every}: {r.checkpoint_bytes:,} B")
            if rec is not None:
                out.append(f"{'':>5} {pad}  schedule: {_schedule_text(rec)}")
        for b, body_rows in _bodies_of(r, rec):
            label, what = _report_body_label(r, rec, b, body_rows)
            out.append(f"{'':>5} {pad}  {label}: {what}")
            body = rec.bodies[b] if rec is not None and b < len(rec.bodies) else None
            out.extend(_report_lines(body_rows, body, depth + 1, bits=bits))
        return out

    lines: list[str] = []
    for start, p, r in fold_runs([_report_sig(x) for x in rows], _fold_text):
        if r == 1:
            lines.extend(row(start))
            continue
        for i in range(start, start + p):
            lines.extend(row(i))
        hidden = rows[start + p : start + (r - 1) * p]
        what = "row" if p == 1 else f"{p} rows"
        lines.append(
            clip(
                f"    {pad}⋮ {r - 2} × the {what} above again (#{hidden[0].index}–"
                f"#{hidden[-1].index}): {sum(x.device_bytes for x in hidden):,} device, "
                f"{sum(x.host_bytes for x in hidden):,} host bytes",
                WIDTH,
            )
        )
        for i in range(start + (r - 1) * p, start + r * p):
            lines.extend(row(i))
    return lines


def _us(seconds: float) -> str:
    return f"{seconds * 1e6:,.1f} µs"


def _planned_cell(r) -> str:
    """A row's planned decision and predicted cost, e.g. ``offload 3.3µs`` (text)."""
    if not r.planned:
        return ""
    return r.planned + (f" {r.planned_seconds * 1e6:.1f}µs" if r.planned_seconds else "")


def report_text(rep) -> str:
    lines = report_head(rep)
    planned = getattr(rep, "decisions", None) is not None
    bits = getattr(rep, "bits", None) is not None
    lines.append(
        f"{'#':>5} {'primitive':<14} {'saves':<12} {'device':>11} {'host':>11} "
        f"{'compressed':>10}  "
        + (f"{'plan':<15} " if planned else "")
        + (f"{'bits':<5} " if bits else "")
        + "source"
    )
    lines.extend(_report_lines(rep.records, rep.tape, 0, planned, bits))
    return "\n".join(line if len(line) <= WIDTH else clip(line, WIDTH) for line in lines)


_REPORT_COLS = (
    ("#", "n", 6),
    ("primitive", "", 15),
    ("saves", "", 26),
    ("decision", "", 14),
    ("device B", "n", 12),
    ("host B", "n", 12),
    ("compressed B", "n", 13),
    ("source", "", 40),
)


def _report_rows_html(rows, tape, depth: int) -> list[str]:
    indent = f"padding-left:calc(6px + {2 * depth}ch)" if depth else ""

    def rec_of(r):
        if tape is None or r.index >= len(tape.records):
            return None
        return tape.records[r.index]

    def saves_of(r, rec) -> str:
        if rec is None or r.saves == "(segment input)":
            s = r.saves
        else:
            named = r.saves.split(",")  # in a body: less what the loop record keeps once
            s = ", ".join(f"{x} {aval_str(x.shape, x.dtype)}" for x in rec.saves if str(x) in named)
            own = {str(x) for x in rec.saves}
            rest = [p for p in named if p not in own]
            s = ", ".join(p for p in (s, ",".join(rest)) if p)
        if depth:
            s = f"{r.step_bytes:,} B per run: {s}"
        return s

    def row(i: int) -> str:
        r = rows[i]
        rec = rec_of(r)
        dec = report_decision(r)
        if getattr(r, "planned", ""):  # the planner's decision and its predicted cost
            dec = r.planned + (f" {r.planned_seconds * 1e6:.1f} µs" if r.planned_seconds else "")
        cls = "d-" + dec.split("+")[-1].split(" ")[0]
        if getattr(r, "bits", ""):  # compress(bits="auto"): the widths it packed at
            dec = f"{dec} {r.bits} bits"
        prim = r.primitive
        if r.body and rec is not None and rec.primitive == "scan":
            prim += f" ×{rec.trip_count:,}"
        out = (
            "<tr>"
            + cell(r.index, "n", r.index)
            + cell(prim, style=indent)
            + cell(saves_of(r, rec), limit=80)
            + cell(dec, cls)
            + cell(f"{r.device_bytes:,}", "n", r.device_bytes)
            + cell(f"{r.host_bytes:,}", "n", r.host_bytes)
            + cell(f"{r.compressed_bytes:,}", "n", r.compressed_bytes)
            + cell(short_source(r.source, 40), title=r.source)
            + "</tr>"
        )
        for b, body_rows in _bodies_of(r, rec):
            label, what = _report_body_label(r, rec, b, body_rows)
            body = rec.bodies[b] if rec is not None and b < len(rec.bodies) else None
            runs = max((x.steps for x in body_rows), default=1)
            total = sum(x.bytes for x in body_rows)
            summary = (
                f"<b>{e(label)}</b>: {e(what)} (device "
                f"{sum(x.device_bytes for x in body_rows):,}, host "
                f"{sum(x.host_bytes for x in body_rows):,})"
            )
            if r.checkpoint_bytes and b == _bodies_of(r, rec)[0][0]:
                every = _every_text(rec)
                summary += f" · carries kept{every}: <b>{r.checkpoint_bytes:,}</b> B"
                summary += f" ({e(_schedule_text(rec))})" if rec is not None else ""
            out += body_row(
                summary,
                "".join(_report_rows_html(body_rows, body, depth + 1)),
                _REPORT_COLS,
                f'data-record="{r.index}" data-branch="{b}" data-runs="{runs}" '
                f'data-bytes="{total}"',
            )
        return out

    def summary(start: int, p: int, r: int) -> str:
        run = rows[start : start + p * r]
        what = f"{p} rows" if p > 1 else "row"
        return (
            f"<b>{r} ×</b> the same {what} (records #{run[0].index}–#{run[-1].index}): "
            f"{e(clip(' '.join(x.primitive for x in run[:p]), 80))} · device "
            f"<b>{sum(x.device_bytes for x in run):,}</b> · host "
            f"<b>{sum(x.host_bytes for x in run):,}</b> · compressed "
            f"<b>{sum(x.compressed_bytes for x in run):,}</b> B · "
            f"{e(short_source(run[0].source, 40))}"
        )

    runs = fold_runs([_report_sig(x) for x in rows], _fold_html)
    return folded_rows(runs, row, summary, _REPORT_COLS)


def report_html(rep) -> str:
    rows = rep.records
    tape = rep.tape
    colgroup, thead = header(_REPORT_COLS)
    body = "".join(_report_rows_html(rows, tape, 0))
    table = (
        f'<table class="tapegrad-memory" {width(_REPORT_COLS)}>{colgroup}{thead}'
        f"<tbody>{body}</tbody></table>"
    )

    comp = sum(r.compressed_bytes for r in rows)
    n_re = sum(r.decision == "recompute" for r in tape.records) if tape is not None else 0
    beyond = rep.residual_bytes - rep.input_bytes
    peak_beyond = getattr(rep, "peak_beyond_inputs_bytes", rep.peak_bytes - rep.input_bytes)
    totals = [
        stat("policy", clip(repr(rep.policy), 60), "policy"),
        stat(
            "held beyond the inputs",
            beyond,
            "beyond_inputs_bytes",
            human_bytes(beyond),
        ),
        stat(
            "peak beyond the inputs",
            peak_beyond,
            "peak_beyond_inputs_bytes",
            human_bytes(peak_beyond),
        ),
        stat("the inputs themselves", rep.input_bytes, "input_bytes", "the caller holds them"),
        stat(
            "residual bytes", rep.residual_bytes, "residual_bytes", human_bytes(rep.residual_bytes)
        ),
        stat("device", rep.device_bytes, "device_bytes"),
        stat("host", rep.host_bytes, "host_bytes"),
        stat("compressed", comp, "compressed_bytes"),
        stat("peak live", rep.peak_bytes, "peak_bytes", "inputs included"),
        stat("records keeping residuals", len(rows), "rows"),
        stat("records recomputed", n_re, "recompute"),
        stat("recompute MFLOP", f"{rep.recompute_flops / 1e6:,.2f}", "recompute_flops"),
    ]
    loop_bytes = sum(x.bytes for r in rows for x in r.body)
    if loop_bytes or any(r.body for r in rows):
        totals.insert(8, stat("in loop/branch bodies", loop_bytes, "loop_bytes", "all steps held"))
    if rep.plan:
        totals.append(stat("planner chose", rep.plan, "plan"))
    if getattr(rep, "average_bits", None) is not None:
        totals.append(
            stat(
                "bits a value",
                f"{rep.average_bits:.2f}",
                "average_bits",
                f"budget {rep.budget_bits:g}",
            )
        )
    if rep.budget_bytes is not None:
        totals.append(
            stat(
                "budget (activations)",
                rep.budget_bytes,
                "budget_bytes",
                human_bytes(rep.budget_bytes),
            )
        )

    # Per source line; a loop record's row counts its own saves only, its body rows the
    # rest (so the lines add up to the totals).
    groups: dict[str, dict[str, Any]] = {}
    for r in rep.rows():
        g = groups.setdefault(r.source, {"rows": 0, "device": 0, "host": 0, "comp": 0, "prims": []})
        g["rows"] += 1
        g["device"] += r.device_bytes - sum(x.device_bytes for x in r.body)
        g["host"] += r.host_bytes - sum(x.host_bytes for x in r.body)
        g["comp"] += r.compressed_bytes - sum(x.compressed_bytes for x in r.body)
        g["prims"].append(r.primitive)

    def src_cells(src: str, g: dict[str, Any]) -> str:
        return (
            cell(short_source(src, 44), title=src)
            + cell(g["rows"], "n", g["rows"])
            + "".join(cell(f"{g[k]:,}", "n", g[k]) for k in ("device", "host", "comp"))
            + cell(prim_counts(g["prims"]), limit=50)
        )

    extra = by_source_table(
        groups,
        (
            ("source", "", 46),
            ("rows", "n", 7),
            ("device B", "n", 12),
            ("host B", "n", 12),
            ("compressed B", "n", 13),
            ("primitives", "", 40),
        ),
        src_cells,
    )
    notes = [f"note: {n}" for n in getattr(rep, "notes", ())]
    notes += [f"policy: {n}" for n in getattr(rep, "policy_notes", ())]
    return page("tg-memory", totals, table, extra, notes)


def _schedule_text(rec) -> str:
    """A scheduled scan's costs in words (`_loops.schedule_text`)."""
    return schedule_text(rec)


def _every_text(rec) -> str:
    """Where a scheduled scan keeps its carries: `` every 100/10 steps`` or, for a
    binomial schedule, `` (revolve, 10 snapshots)``."""
    if rec is None:
        return ""
    if rec.snapshots:
        return f" (revolve, {rec.snapshots:,} snapshots)"
    return f" every {_levels_text(rec)} steps"
