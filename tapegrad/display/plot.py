"""`MemoryReport.plot` and `MemoryReport.plot_plan` (matplotlib, an optional dependency)."""

from __future__ import annotations

from typing import Any

from tapegrad.display.common import clip, human_bytes

__all__ = ["plot_report", "plot_plan"]


def plot_report(rep: Any, ax: Any, label: str | None, by_kind: bool) -> Any:
    """`MemoryReport.plot`."""
    try:
        import matplotlib.pyplot as plt
        from matplotlib.ticker import FuncFormatter
    except ImportError as e:
        raise ImportError(
            "MemoryReport.plot needs matplotlib, an optional dependency: pip install matplotlib"
        ) from e
    if ax is None:
        _, ax = plt.subplots(figsize=(8, 3))
    xs = list(range(len(rep.timeline)))
    prefix = f"{label}: " if label else ""
    kinds = (
        [
            (name, [k[i] for k in rep.timeline_kinds])
            for i, name in enumerate(("device", "host", "compressed"))
        ]
        if by_kind
        else []
    )
    kinds = [(n, ys) for n, ys in kinds if any(ys)]
    if len(kinds) != 1:  # one kind is the total; several need the total beside them
        ax.plot(
            xs,
            [b for _, b in rep.timeline],
            drawstyle="steps-post",
            lw=2,
            label=prefix + "total",
            gid="total",
        )
    for name, ys in kinds:
        ax.plot(
            xs,
            ys,
            drawstyle="steps-post",
            lw=1.2 if len(kinds) > 1 else 2,
            ls="-" if len(kinds) == 1 else "--",
            label=prefix + name,
            gid=name,
        )
    n_fwd = sum(1 for s, _ in rep.timeline if s.startswith("fwd"))
    drawn = {(ln.get_gid(), tuple(ln.get_xdata())) for ln in ax.get_lines()}
    if ("backward", (n_fwd - 0.5,) * 2) not in drawn:  # once per Axes when overlaid
        ax.axvline(
            n_fwd - 0.5, color="gray", lw=0.8, ls="--", label="backward starts", gid="backward"
        )
    if rep.budget_bytes is not None:
        note = (
            f" + {human_bytes(rep.input_residual_bytes)} inputs" if rep.input_residual_bytes else ""
        )
        ax.axhline(
            rep.budget_bytes + rep.input_residual_bytes,
            color="tab:red",
            lw=1,
            ls=":",
            label=f"{prefix}budget {human_bytes(rep.budget_bytes)}{note}",
            gid="budget",
        )
    ax.yaxis.set_major_locator(_binary_locator())
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: human_bytes(v).replace(".0 ", " ")))
    ax.set_xlabel("tape step (forward records, then backward)")
    ax.set_ylabel("live residual bytes")
    if not ax.get_title():
        ax.set_title(clip(label or repr(rep.policy), 60), fontsize="medium")
    top = max([b for _, b in rep.timeline] + [1])
    if rep.budget_bytes is not None:  # axhline does not widen the y range by itself
        top = max(top, rep.budget_bytes + rep.input_residual_bytes)
    ax.set_ylim(0, max(ax.get_ylim()[1], top * 1.05))
    ax.legend(fontsize="small")
    return ax


def plot_plan(rep: Any, ax: Any) -> Any:
    """`MemoryReport.plot_plan`."""
    if rep.planned_timeline is None or rep.measured_plan_timeline is None:
        raise ValueError(
            "plot_plan needs a report of a function planned by tg.policies.budget "
            "(memory_report(f, policy=tg.policies.budget(...)))."
        )
    try:
        import matplotlib.pyplot as plt
        from matplotlib.ticker import FuncFormatter
    except ImportError as e:
        raise ImportError(
            "MemoryReport.plot_plan needs matplotlib, an optional dependency: "
            "pip install matplotlib"
        ) from e
    if ax is None:
        _, ax = plt.subplots(figsize=(8, 3))
    for series, style in (
        (rep.measured_plan_timeline, dict(lw=2, label="measured", gid="measured")),
        (rep.planned_timeline, dict(lw=1.2, ls="--", label="predicted", gid="predicted")),
    ):
        ax.plot(range(len(series)), [b for _, b in series], drawstyle="steps-mid", **style)
    if rep.budget_bytes is not None:
        ax.axhline(rep.budget_bytes, color="tab:red", lw=1, ls=":", label="budget", gid="budget")
    ax.yaxis.set_major_locator(_binary_locator())
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: human_bytes(v).replace(".0 ", " ")))
    ax.set_xlabel("end of forward, then backward (records and recomputations)")
    ax.set_ylabel("device bytes of activations")
    top = max([b for _, b in rep.measured_plan_timeline + rep.planned_timeline] + [1])
    ax.set_ylim(0, max(top, rep.budget_bytes or 0) * 1.05)
    ax.legend(fontsize="small")
    return ax


def _binary_locator() -> Any:
    """Ticks at round numbers of KiB / MiB / GiB rather than of bytes."""
    from matplotlib.ticker import MaxNLocator

    class BinaryLocator(MaxNLocator):
        def tick_values(self, vmin, vmax):
            unit = 1.0
            while max(abs(vmin), abs(vmax)) >= 1024 * unit and unit < 1024**3:
                unit *= 1024
            return super().tick_values(vmin / unit, vmax / unit) * unit

    return BinaryLocator(nbins=6, steps=[1, 2, 2.5, 5, 10])
