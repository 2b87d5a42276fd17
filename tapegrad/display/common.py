"""Pictures of a `Tape` and a `MemoryReport`: plain text that fits 100 columns, and
self-contained HTML tables for Jupyter and browsers.

Both fold long runs: a block of records (or report rows) repeated many times in a
row — the layers of a deep network — shows once with a count, so a 2,000-record
tape stays a screenful. In HTML the fold is a ``<details>`` row (no JavaScript
needed to expand it); a per-source-line summary follows the table.

This module holds what every picture shares: clipping, source lines and byte counts as
text, the folding of repeated runs, and how a record (or a loop's body) is labelled and
what it keeps. `tapegrad.display.text` and `tapegrad.display.html` draw the tape and
register its printers (`tapegrad.core.tape.register_printer`); `tapegrad.display.memory`
draws a `MemoryReport`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Hashable, Sequence

from tapegrad.engine.loops.saves import loop_bytes, loop_residual_bytes, step_residual_vars

WIDTH = 100  # every line of str(tape) / str(report) fits in this many columns
MAX_PERIOD = 64  # longest repeated block looked for (a transformer layer is ~40 records)


def sharding_lines(devices: int, processes: int = 1) -> list[str]:
    """What a report's bytes mean when its values span several devices (and processes)."""
    if devices <= 1:
        return []
    if processes <= 1:
        return [
            f"  (values sharded over {devices} devices: each counts the shard one device "
            "holds, all of it if replicated)"
        ]
    return [
        f"  (values sharded over {devices} devices of {processes} processes: each counts the "
        "shard one of",
        "   this process's devices holds, all of it if replicated; each process reports its "
        "own shards)",
    ]


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


def _fold_text(p: int, r: int) -> bool:
    """Text shows a folded run's first and last block: fold when that hides ≥ 4 lines."""
    return r >= 3 and (r - 2) * p >= 4


def _fold_html(p: int, r: int) -> bool:
    return r >= 3 and p * r >= 8


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


def _levels_text(rec) -> str:
    """A scan's segment lengths, outermost first: ``16`` or ``100/10``."""
    return "/".join(f"{k:,}" for k in (rec.schedule, *rec.inner_schedule))


def _walk(tape, mult: int = 1, depth: int = 0):
    """(record, how many times its saves are held, depth) over ``tape`` and its bodies."""
    for rec in tape.records:
        yield rec, mult, depth
        for body in rec.bodies:
            yield from _walk(body, mult * rec.trip_count, depth + 1)
