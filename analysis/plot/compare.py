"""Compared cases: each case stacked by category at its own peak, with reserved and device total marks and
whether it fits the budget."""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch

from ..units import UNITS
from .style import (
    BASE_FONT,
    CATEGORY_COLOURS,
    CATEGORY_HATCHES,
    OVER_COLOUR,
    STACK_ORDER,
    axis_unit,
    budget_lines,
    category_label,
    plot_style,
    save_figure,
    set_titles,
    size_text,
)


def compare_figure(cases, unit: str = "GiB", *, budget: int | None = None, title: str = "",
                   setup: str = "") -> Figure:
    """One bar per case (name, analysis/report.py Report): the allocated bytes at its peak stacked by category,
    and on a CUDA profile the reserved bytes and the device total at the device's peak as marks; the budget."""
    unit = axis_unit(unit, max([max(r.peaks.overall.bytes, r.capacity_needed) for _, r in cases] + [budget or 0]))
    scale = UNITS[unit]
    cats = [c for c in STACK_ORDER if any(r.peaks.overall.live_by_category.get(c, 0) for _, r in cases)]
    gpu = any(r.gpu is not None for _, r in cases)
    tops = [max(r.peaks.overall.bytes, r.capacity_needed) for _, r in cases] + ([budget] if budget is not None else [])
    ymax = max(tops + [1]) / scale * 1.18
    n = len(cases)
    with plt.rc_context(plot_style()):
        fig = Figure(figsize=(max(10.0, 5.0 + 2.1 * n), 6.4), dpi=100, layout="constrained")
        ax = fig.add_subplot()
        xs = np.arange(n)
        bottom = np.zeros(n)
        for c in cats:
            vals = np.asarray([r.peaks.overall.live_by_category.get(c, 0) for _, r in cases], dtype=float) / scale
            ax.bar(xs, vals, 0.6, bottom=bottom, color=CATEGORY_COLOURS[c], hatch=CATEGORY_HATCHES.get(c),
                   edgecolor="white", lw=0.5, label=category_label(c), gid=f"category:{c.value}", zorder=3)
            bottom += vals
        for i, (_, r) in enumerate(cases):
            lines = [f"{size_text(r.peaks.overall.bytes, unit)} allocated"]
            top = r.peaks.overall.bytes
            if r.gpu is not None:
                reserved, total = r.gpu.reserved_peak.reserved, r.gpu.total_peak.total
                ax.plot([i - 0.36, i + 0.36], [reserved / scale] * 2, color="black", lw=1.6, zorder=5, gid="reserved")
                ax.plot([i - 0.36, i + 0.36], [total / scale] * 2, color="black", lw=1.4, ls=(0, (1, 1)), zorder=5,
                        gid="device_total")
                lines.append(f"{size_text(total, unit)} device total")
                top = max(top, total)
            if r.capacity_needed != top:  # the scenario's headroom
                lines.append(f"{size_text(r.capacity_needed, unit)} with headroom")
            over = budget is not None and r.capacity_needed > budget
            if budget is not None:
                lines.append("over the budget" if over else "fits")
            ax.text(i, max(top, r.capacity_needed) / scale + ymax * 0.012, "\n".join(lines), ha="center", va="bottom",
                    fontsize=BASE_FONT - 1, color=OVER_COLOUR if over else "black", zorder=7,
                    fontweight="bold" if over else "normal",
                    bbox=dict(boxstyle="square,pad=0.15", fc="white", ec="none"))
        handles = budget_lines(ax, budget, scale, unit)
        ax.set_xticks(xs, [_case_tick(name, r) for name, r in cases])
        ax.set_xlim(-0.6, n - 0.4)
        ax.set_ylim(0, ymax * (1.08 if gpu else 1.0))
        ax.set_ylabel(f"peak per rank ({unit})")
        ax.grid(True, axis="y", lw=0.3, color="#cccccc", zorder=0)
        ax.set_axisbelow(True)
        legend = [Patch(facecolor=CATEGORY_COLOURS[c], hatch=CATEGORY_HATCHES.get(c), edgecolor="white",
                        label=category_label(c)) for c in reversed(cats)]
        if gpu:
            legend += [Line2D([], [], color="black", lw=1.6, label="reserved (caching allocator) peak"),
                       Line2D([], [], color="black", lw=1.4, ls=(0, (1, 1)),
                              label="device total peak\n(+ CUDA context, NCCL)")]
        ax.legend(handles=legend + handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0,
                  frameon=False, title="at each case's peak", title_fontsize=BASE_FONT - 1, alignment="left")
        set_titles(fig, title or "compared cases: allocated memory at the peak, by category", setup)
    return fig


def _case_tick(name: str, report) -> str:
    e = report.peaks.overall.event
    return f"{name}\npeak in {e.phase.value}, step {e.step}" if e is not None else name


def plot_compare(cases, path: str, unit: str = "GiB", **options) -> None:
    """Write `compare_figure` to `path` (PNG) atomically."""
    save_figure(compare_figure(cases, unit, **options), path)


# -- sweeps --------------------------------------------------------------------------------------------
