"""`str(tape)`: a tape as text that fits 100 columns, records shortened to fit beside their
source lines, loop and branch bodies printed under their records, repeated runs folded.
Registered as the tape's ``"text"`` printer on import."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tapegrad.core.tape import register_printer
from tapegrad.display.common import (
    WIDTH,
    _bytes_with_bodies,
    _fold_text,
    _record_sig,
    _walk,
    body_label,
    clip,
    fold_runs,
    loop_bytes_text,
    param_items,
    short_source,
)

__all__ = ["tape_text"]


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


register_printer("text", tape_text)
