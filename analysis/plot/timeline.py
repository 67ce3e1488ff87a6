"""A run's occupancy over time: allocated by category, reserved and the device total, the budget, the first OOM
and the peak, with zoom panels on the last optimizer step and the peak; and measured vs predicted overlays."""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch

from ...simulator.events import Phase
from ...simulator.timeline import Timeline
from ..units import UNITS, Scale
from .style import (
    BASE_FONT,
    BUDGET_COLOUR,
    CATEGORY_COLOURS,
    CATEGORY_HATCHES,
    PHASE_COLOURS,
    PHASE_SHORT,
    STACK_ORDER,
    axis_unit,
    budget_lines,
    category_label,
    plot_style,
    save_figure,
    set_titles,
    short_label,
    size_text,
    time_unit,
)


def _phase_spans(tl: Timeline, x: np.ndarray) -> list[tuple[float, float, Phase, int]]:
    """(start, end, phase, step) of each run of consecutive events in one phase."""
    spans = []
    start = 0
    n = len(tl.events)
    for i in range(1, n + 1):
        if i == n or tl.events[i].phase is not tl.events[start].phase or tl.events[i].step != tl.events[start].step:
            end = x[i] if i < n else x[-1]
            spans.append((float(x[start]), float(end), tl.events[start].phase, tl.events[start].step))
            start = i
    return spans


def _merge_spans(spans):
    """Consecutive spans of the same phase and step (micro-batches alternate forward and backward) stay apart;
    spans of one phase in a row are joined."""
    out = []
    for s in spans:
        if out and out[-1][2] is s[2] and out[-1][3] == s[3]:
            out[-1] = (out[-1][0], s[1], s[2], s[3])
        else:
            out.append(s)
    return out


def _draw_occupancy(ax, tl: Timeline, x: np.ndarray, scale: float, spans, label_phases: bool,
                    window: tuple[float, float]) -> list:
    """Phase bands, the stacked categories and their labels on `ax`; returns the stack's polygons."""
    lo, hi = window
    width = max(hi - lo, 1e-30)
    for a, b, phase, step in spans:
        if b < lo or a > hi:
            continue
        ax.axvspan(a, b, color=PHASE_COLOURS[phase], lw=0, zorder=0)
        if label_phases:
            shown = (min(b, hi) - max(a, lo)) / width
            text = (f"{phase.value} {step}" if shown > 0.09 else PHASE_SHORT[phase] if shown > 0.035 else "")
            if text:
                ax.text((max(a, lo) + min(b, hi)) / 2, 0.985, text, transform=ax.get_xaxis_transform(), ha="center",
                        va="top", fontsize=BASE_FONT - 2, color="#444444", zorder=7, clip_on=True)
    cats = [c for c in STACK_ORDER if c in tl.by_category]
    polys = []
    if cats and len(x):
        ys = [np.asarray(tl.by_category[c], dtype=float) / scale for c in cats]
        polys = ax.stackplot(x, *ys, step="post", colors=[CATEGORY_COLOURS[c] for c in cats], lw=0, zorder=2)
        for poly, c in zip(polys, cats):
            poly.set_gid(f"category:{c.value}")
            if c in CATEGORY_HATCHES:
                poly.set_hatch(CATEGORY_HATCHES[c])
                poly.set_edgecolor("white")
    return polys


def timeline_figure(tl: Timeline, title: str = "", unit: str = "GiB",
                    reserved: list[tuple[float, int, int]] | None = None, *, budget: int | None = None,
                    capacity: tuple[str, int] | None = None, headroom: float = 0.0, setup: str = "",
                    outside: int = 0, oom: tuple[float, str] | None = None, zoom: bool = True) -> Figure:
    """The occupancy figure: allocated bytes stacked by category over time (phase bands labelled, the peak
    marked), the budget, and below it zoomed panels on the last optimizer step and on the peak.

    `reserved`: (time, allocated, reserved) after each event on a CUDA profile (analysis/device.py), drawn as
    a black line; `outside` (the CUDA context and what else the device holds outside the allocator) adds the
    device total, which is what a budget holds there. `capacity`: (name, bytes) of the device, drawn when it is
    near the data. `oom`: (time, text) of the first OOM under the budget."""
    reserved_top = max((float(r) for _, _, r in reserved or []), default=0.0)
    unit = axis_unit(unit, max(float(max(tl.total, default=0)), reserved_top + outside, budget or 0))
    scale = UNITS[unit]
    x = np.asarray(tl.times, dtype=float)
    end = float(x[-1]) if len(x) else 1.0
    tmul, tname = time_unit(end)
    x = x * tmul
    end *= tmul
    total = np.asarray(tl.total, dtype=float) / scale
    spans = _merge_spans(_phase_spans(tl, x)) if len(x) else []
    windows = _zoom_windows(tl, x, spans, end) if zoom and len(x) > 1 else []
    with plt.rc_context(plot_style()):
        fig = Figure(figsize=(14, 8.6 if windows else 5.8), dpi=100, layout="constrained")
        if windows:
            grid = fig.add_gridspec(2, len(windows), height_ratios=[3, 2])
            main = fig.add_subplot(grid[0, :])
            zooms = [fig.add_subplot(grid[1, i], sharey=main) for i in range(len(windows))]
        else:
            main, zooms = fig.add_subplot(), []
        top = float(total.max()) if len(total) else 0.0
        res = gpu_total = None
        if reserved:
            rx = np.asarray([t for t, _, _ in reserved], dtype=float) * tmul
            ry = np.asarray([r for _, _, r in reserved], dtype=float) / scale
            res = (rx, ry)
            top = max(top, float(ry.max()))
            if outside:
                gpu_total = (rx, ry + outside / scale)
                top = max(top, float(gpu_total[1].max()))
        limits = [top]
        if budget is not None:
            limits.append(budget / scale)
        near_budget = budget is not None and capacity is not None and abs(capacity[1] - budget) < 0.05 * budget
        if capacity is not None and capacity[1] / scale <= 1.5 * max(limits) and not near_budget:
            limits.append(capacity[1] / scale)
        else:
            capacity = None
        ymax = max(limits) * 1.1 or 1.0
        handles: list = []
        for k, (ax, window) in enumerate([(main, (0.0, end))] + list(zip(zooms, [w[:2] for w in windows]))):
            polys = _draw_occupancy(ax, tl, x, scale, spans, True, window)
            if k == 0:
                cats = [c for c in STACK_ORDER if c in tl.by_category]
                peak_i = int(np.argmax(total)) if len(total) else -1
                at_peak = {c: float(tl.by_category[c][peak_i]) for c in cats} if peak_i >= 0 else {}
                legend = Scale.of(at_peak.values(), unit)  # the categories' sizes in the axis' unit, one decimals
                handles += [Patch(facecolor=p.get_facecolor()[0], hatch=CATEGORY_HATCHES.get(c), edgecolor="white",
                                  label=f"{category_label(c)}: {legend.text(at_peak.get(c, 0))}")
                            for p, c in zip(polys, cats) if float(np.max(np.asarray(tl.by_category[c], float))) > 0]
            if res is not None:
                line = ax.step(res[0], res[1], where="post", color="black", lw=1.1, zorder=5, gid="reserved",
                               label="reserved (caching allocator), peak "
                                     f"{size_text(float(res[1].max()) * scale, unit)}")
                if gpu_total is not None:
                    text = (f"device total: reserved + {size_text(outside, unit)} outside\n"
                            "the allocator (CUDA context, ...)")
                    line += ax.step(gpu_total[0], gpu_total[1], where="post", color="black", lw=1.0, ls=(0, (1, 1.5)),
                                    zorder=5, gid="device_total", label=text)
                if k == 0:
                    handles += line
            lines = budget_lines(ax, budget, scale, unit, headroom)
            if capacity is not None:
                lines.append(ax.axhline(capacity[1] / scale, color="#555555", lw=1.0, ls="-.", zorder=6,
                                        gid="capacity", label=f"{capacity[0]} memory {size_text(capacity[1], unit)}"))
            if k == 0:
                handles += lines
            if len(total):
                peak_i = int(np.argmax(total))
                if window[0] <= x[peak_i] <= window[1]:
                    ax.axvline(x[peak_i], color="black", lw=0.8, ls="--", zorder=6, gid="peak")
            if oom is not None and window[0] <= oom[0] * tmul <= window[1]:
                ax.plot([oom[0] * tmul], [budget / scale if budget is not None else top], marker="X", ms=11,
                        color=BUDGET_COLOUR, mec="white", zorder=8, gid="oom", ls="none", clip_on=False)
            ax.set_xlim(*window)
            ax.set_ylim(0, ymax)
            ax.grid(True, axis="y", lw=0.3, color="#bbbbbb", zorder=1)
            ax.set_axisbelow(True)
        if oom is not None:
            handles.append(Line2D([], [], marker="X", ms=9, color=BUDGET_COLOUR, mec="white", ls="none",
                                  label=f"first OOM under the budget: {oom[1]}"))
        if len(total):
            e = tl.events[int(np.argmax(total))]
            handles.append(Line2D([], [], color="black", lw=0.8, ls="--", marker="o", ms=4,
                                  label=f"peak {size_text(float(tl.total[int(np.argmax(total))]), unit)} at\n"
                                        f"{short_label(e.op, 40)} ({e.phase.value}, step {e.step})"))
        phases = []
        for _, _, phase, _ in spans:
            if phase not in phases:
                phases.append(phase)
        phase_handles = [Patch(facecolor=PHASE_COLOURS[p], edgecolor="#bbbbbb", label=p.value.replace("_", " "))
                         for p in phases]
        main.set_ylabel(f"device memory ({unit})")
        main.set_xlabel(f"time ({tname}, simulated)")
        for letter, ax, (lo, hi, name) in zip("ABC", zooms, windows):
            ax.set_title(f"{letter}: zoom on {name}", fontsize=BASE_FONT)
            ax.set_xlabel(f"time ({tname})")
            ax.set_ylabel(f"device memory ({unit})")
            shown = max(hi - lo, end * 0.006)  # a window too narrow to see is drawn this wide
            mid = min(max((lo + hi) / 2, shown / 2), end - shown / 2)
            main.axvspan(mid - shown / 2, mid + shown / 2, ymin=0, ymax=0.025, color="#333333", lw=0, zorder=8,
                         gid=f"zoom:{letter}")
            main.text(min(max(mid, end * 0.012), end * 0.988), 0.03, letter, transform=main.get_xaxis_transform(),
                      ha="center", va="bottom",
                      fontsize=BASE_FONT - 1, fontweight="bold", zorder=9,
                      bbox=dict(boxstyle="round,pad=0.15", fc="white", ec="#333333", lw=0.6))
        if len(total):
            peak_i = int(np.argmax(total))
            for ax, (lo, hi) in [(main, (0.0, end))] + [(z, w[:2]) for z, w in zip(zooms, windows)]:
                if lo <= x[peak_i] <= hi:
                    ax.plot([x[peak_i]], [total[peak_i]], marker="o", ms=5, color="black", zorder=9, ls="none")
        first = main.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0,
                    title="allocated at the peak, by category", title_fontsize=BASE_FONT - 1, frameon=False,
                    alignment="left")
        (zooms[-1] if zooms else main).legend(
            handles=phase_handles, loc="upper left" if zooms else "lower left",
            bbox_to_anchor=(1.01, 1.0) if zooms else (1.01, 0.0), borderaxespad=0, title="phases (shaded)",
            title_fontsize=BASE_FONT - 1, frameon=False, alignment="left", ncols=2 if len(phase_handles) > 3 else 1)
        if not zooms:
            main.add_artist(first)  # the phases' legend replaced it as the axes' legend
        set_titles(fig, title or "occupancy by category", setup)
    return fig


def _zoom_windows(tl: Timeline, x: np.ndarray, spans, end: float) -> list[tuple[float, float, str]]:
    """(start, end, name) of the zoomed panels: the first optimizer step (step 1's, where torch creates the
    optimizer states: a sliver of a long step's picture), the last one when it is another, and the moment of the
    peak; a panel whose window holds the peak says so, and then no third panel is drawn."""
    total = np.asarray(tl.total, dtype=float)
    peak_t = float(x[int(np.argmax(total))])
    opt = [s for s in spans if s[2] is Phase.OPTIMIZER]
    steps = sorted({s[3] for s in opt})
    out, has_peak = [], False
    for step, which in ([(steps[0], "the first"), (steps[-1], "the last")] if len(steps) > 1 else
                        [(steps[0], "the")] if steps else []):
        a = min(s[0] for s in opt if s[3] == step)
        b = max(s[1] for s in opt if s[3] == step)
        pad = max((b - a) * 0.35, end * 0.002)
        lo, hi = max(0.0, a - pad), min(end, b + pad)
        here = lo <= peak_t <= hi and not has_peak
        has_peak |= here
        out.append((lo, hi, f"{which} optimizer step (step {step})" + (", where the peak is" if here else "")))
    if not has_peak:
        half = end * 0.03
        out.append((max(0.0, peak_t - half), min(end, peak_t + half), "the peak"))
    return out


def plot_timeline(tl: Timeline, path: str, title: str = "", unit: str = "GiB",
                  reserved: list[tuple[float, int, int]] | None = None, **options) -> None:
    """Write `timeline_figure` to `path` (PNG) atomically; `options` are its keyword arguments."""
    save_figure(timeline_figure(tl, title, unit, reserved, **options), path)


def plot_overlay(measured: Timeline, predicted: Timeline, path: str, title: str = "", unit: str | None = None) -> None:
    """Measured and predicted total occupancy, each over its own event index scaled to 0..1 (a real run
    and a simulation have different clocks; phases line up by order, not by seconds); in `unit`, else the one
    that fits the larger peak."""
    unit = axis_unit(unit, float(max(max(measured.total, default=0), max(predicted.total, default=0))))
    scale = UNITS[unit]
    fig, ax = plt.subplots(figsize=(11, 5), dpi=100)
    for tl, label, style in ((measured, "measured (torch)", "-"), (predicted, "predicted (simulator)", "--")):
        n = max(len(tl.events) - 1, 1)
        ax.step(np.arange(len(tl.events)) / n, np.asarray(tl.total, dtype=float) / scale, style, where="post",
                label=f"{label}, peak {float(max(tl.total, default=0)) / scale:.4g} {unit}")
    ax.set_xlabel("progress through the run (event index, normalised)")
    ax.set_ylabel(f"live memory ({unit})")
    ax.set_title(title)
    ax.legend(loc="upper left", fontsize=8)
    save_figure(fig, path)


# -- checkpointing policies --------------------------------------------------------------------------
