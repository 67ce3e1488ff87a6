"""A sweep's grid: a line per varied field (one field, or one line per combination of the later fields), or a
heatmap for two fields, each point marked fits or over the budget."""

from __future__ import annotations

import math

import matplotlib
import matplotlib.pyplot as plt
import numpy as np
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Rectangle

from ...models.config import ConfigError
from ..units import UNITS, Scale
from .style import (
    BASE_FONT,
    BUDGET_COLOUR,
    OVER_COLOUR,
    axis_unit,
    budget_lines,
    plot_style,
    save_figure,
    set_titles,
    size_text,
)

SWEEP_MAX_LINES = 10  # lines one sweep picture draws at most (grids of three fields and more)


def check_sweep_plot(grid: dict[str, list]) -> None:
    """Refuse, before any work, a grid whose picture would be unreadable: three or more fields whose other
    fields make more than SWEEP_MAX_LINES lines."""
    keys = list(grid)
    if len(keys) >= 3:
        lines = math.prod(len(grid[k]) for k in keys[1:])
        if lines > SWEEP_MAX_LINES:
            raise ConfigError("plot", f"a sweep of {len(keys)} fields draws one line per combination of "
                                      f"{', '.join(keys[1:])}: {lines} lines, more than {SWEEP_MAX_LINES} can be told "
                                      "apart; plot two fields (a heatmap) or fewer values, or drop --plot")


def _numeric(values: list) -> bool:
    return all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)


def _show(value) -> str:
    return value if isinstance(value, str) else str(value)


def sweep_figure(grid: dict[str, list], points, unit: str = "GiB", *, budget: int | None = None, title: str = "",
                 setup: str = "") -> Figure:
    """The sweep's capacity needed per point (peakledger/sweep.py SweepPoint: `values`, `result`): one field
    a line over its values, two a heatmap (fits marked), more one line per combination of the fields after the
    first. Invalid points are gaps (lines) or grey "n/a" cells (heatmap). The budget line (on the heatmap: a
    mark on the colour bar, and cells over it outlined)."""
    check_sweep_plot(grid)
    keys = list(grid)
    table = {tuple(_show(p.values[k]) for k in keys): p.result for p in points}
    needed = [_needed(r) for r in table.values()]
    unit = axis_unit(unit, max([v for v in needed if not math.isnan(v)] + [budget or 0]))
    scale = UNITS[unit]
    with plt.rc_context(plot_style()):
        if len(keys) == 2:
            fig = _sweep_heatmap(grid, keys, table, scale, unit, budget)
        else:
            fig = _sweep_lines(grid, keys, table, scale, unit, budget)
        what = title or ("sweep: device memory needed per rank over " + " x ".join(keys))
        set_titles(fig, what, setup)
    return fig


def _needed(result: dict | None) -> float:
    if result is None or result.get("error") or result.get("capacity_needed_bytes") in ("", None):
        return float("nan")
    return float(result["capacity_needed_bytes"])


def _fits(result: dict | None) -> bool | None:
    """The point's verdict against the budget (peakledger/sweep.py: on a GPU the caching allocator's, with its
    free-and-retry rule); None without a budget or for an invalid point."""
    value = None if result is None or result.get("error") else result.get("fits")
    return value if isinstance(value, bool) else None


def _sweep_lines(grid, keys, table, scale, unit, budget) -> Figure:
    first = keys[0]
    xs_values = grid[first]
    numeric = _numeric(xs_values)
    positions = np.asarray(xs_values, dtype=float) if numeric else np.arange(len(xs_values), dtype=float)
    fig = Figure(figsize=(11, 6), dpi=100, layout="constrained")
    ax = fig.add_subplot()
    rest = [[]] if len(keys) == 1 else _product([grid[k] for k in keys[1:]])
    colours = ["#0072B2", "#E69F00", "#009E73", "#CC79A7", "#56B4E9", "#D55E00", "#332288", "#882255", "#117733",
               "#999933"]
    markers = "osD^vP<>hX"
    top = 0.0
    dashed = False
    for j, combo in enumerate(rest):
        needed, over, peaks = [], [], []
        for v in xs_values:
            r = table.get(tuple(_show(x) for x in [v, *combo]))
            needed.append(_needed(r) / scale)
            over.append(_fits(r) is False)
            peaks.append(float("nan") if math.isnan(needed[-1]) else float(r["peak_bytes"]) / scale)
        needed_a = np.asarray(needed)
        if np.any(~np.isnan(needed_a)):
            top = max(top, float(np.nanmax(needed_a)))
        label = ", ".join(f"{k}={_show(v)}" for k, v in zip(keys[1:], combo) if len(grid[k]) > 1) or \
            "device memory needed"
        colour = colours[j % len(colours)]
        ax.plot(positions, needed_a, marker=markers[j % len(markers)], color=colour, lw=1.8, ms=7, label=label,
                gid=f"line:{label}", zorder=4)
        if len(rest) <= 3 and not np.allclose(np.asarray(peaks), needed_a, equal_nan=True):
            ax.plot(positions, peaks, color=colour, lw=1.0, ls="--", zorder=3, gid=f"peak:{label}")
            dashed = True
        if any(over):
            over_a = np.asarray(over)
            ax.plot(positions[over_a], needed_a[over_a], marker="X", ms=12, color=OVER_COLOUR, mec="white", ls="none",
                    zorder=5, gid="over")
        for px, v in zip(positions, needed_a):
            if np.isnan(v):
                ax.annotate("n/a", (px, 0), xytext=(0, 4), textcoords="offset points", ha="center",
                            fontsize=BASE_FONT - 2, color="#777777")
            elif len(rest) <= 3:  # few lines: each point's value beside it
                ax.annotate(f"{v:.3g}", (px, v), xytext=(-6, 6), textcoords="offset points", ha="right",
                            fontsize=BASE_FONT - 2, color=colour, zorder=6)
    handles, _ = ax.get_legend_handles_labels()
    if dashed:
        handles.append(Line2D([], [], color="#555555", lw=1.0, ls="--", label="allocated peak (tensors), below\n"
                                                                             "what the device needs"))
    handles += budget_lines(ax, budget, scale, unit)
    if budget is not None:
        handles.append(Line2D([], [], marker="X", ms=9, color=OVER_COLOUR, mec="white", ls="none",
                              label="over the budget"))
    if numeric and len(positions) > 1 and positions.min() > 0 and positions.max() / positions.min() >= 4:
        ax.set_xscale("log", base=2)
    ax.set_xticks(positions, [_show(v) for v in xs_values])
    ax.minorticks_off()
    ax.set_xlabel(first)
    ax.set_ylabel(f"device memory needed per rank ({unit})")
    ax.set_ylim(0, max(top, (budget or 0) / scale, 1e-9) * 1.12)
    ax.grid(True, lw=0.3, color="#cccccc")
    ax.set_axisbelow(True)
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0, frameon=False,
              alignment="left")
    return fig


def _product(lists: list[list]) -> list[list]:
    out: list[list] = [[]]
    for values in lists:
        out = [o + [v] for o in out for v in values]
    return out


def _sweep_heatmap(grid, keys, table, scale, unit, budget) -> Figure:
    rows_k, cols_k = keys
    rows, cols = grid[rows_k], grid[cols_k]
    data = np.full((len(rows), len(cols)), np.nan)
    fits: dict[tuple[int, int], bool | None] = {}
    for i, rv in enumerate(rows):
        for j, cv in enumerate(cols):
            result = table.get((_show(rv), _show(cv)))
            data[i, j] = _needed(result) / scale
            fits[i, j] = _fits(result)
    fig = Figure(figsize=(max(10.0, 3.5 + 1.4 * len(cols)), max(5.2, 2.4 + 0.65 * len(rows))), dpi=100,
                 layout="constrained")
    ax = fig.add_subplot()
    finite = data[~np.isnan(data)]
    vmin, vmax = _colour_limits(finite)
    cmap = matplotlib.colormaps["viridis"].with_extremes(bad="#dddddd")
    image = ax.imshow(np.ma.masked_invalid(data), cmap=cmap, vmin=vmin, vmax=vmax, aspect="auto", origin="lower")
    image.set_gid("heatmap")
    cells = Scale.of([v * scale for v in finite], unit, digits=3)  # one unit and decimals for every cell
    for i in range(len(rows)):
        for j in range(len(cols)):
            v = data[i, j]
            if np.isnan(v):
                ax.text(j, i, "n/a", ha="center", va="center", fontsize=BASE_FONT - 1, color="#555555")
                continue
            over = fits[i, j] is False
            light = v < vmin + 0.6 * (vmax - vmin)
            verdict = "\nover" if over else "\nfits" if fits[i, j] else ""
            ax.text(j, i, f"{cells.text(v * scale)}{verdict}", ha="center", va="center", fontsize=BASE_FONT - 1,
                    color="white" if light else "black",
                    fontweight="bold" if over else "normal")
            if over:
                ax.add_patch(Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, lw=2.5,
                                                          ec=OVER_COLOUR, zorder=4, gid="over"))
    ax.set_xticks(range(len(cols)), [_show(v) for v in cols])
    ax.set_yticks(range(len(rows)), [_show(v) for v in rows])
    ax.set_xlabel(cols_k)
    ax.set_ylabel(rows_k)
    label = f"device memory needed per rank ({unit})"
    on_scale = budget is not None and finite.size and vmin <= budget / scale <= vmax
    if on_scale:
        label += f"\nred line: the budget, {size_text(budget, unit)}"
    elif budget is not None:
        side = "every point under it" if finite.size and vmax < budget / scale else "every point over it"
        label += f"\nthe budget, {size_text(budget, unit)}: off this scale ({side})"
    bar = fig.colorbar(image, ax=ax, label=label)
    if on_scale:
        bar.ax.axhline(budget / scale, color=BUDGET_COLOUR, lw=3, ls="-", gid="budget")
    return fig


def _colour_limits(finite: np.ndarray) -> tuple[float, float]:
    """The colour scale of a heatmap: the data's own min..max (a scale from 0, or to the card's capacity, would
    paint 4-8 GiB values on a 0-40 GiB bar in nearly one colour); one value alone gets a scale around it."""
    if not finite.size:
        return 0.0, 1.0
    lo, hi = float(finite.min()), float(finite.max())
    if lo == hi:
        return lo * 0.95, hi * 1.05 if hi else 1.0
    return lo, hi


def plot_sweep(grid: dict[str, list], points, path: str, unit: str = "GiB", **options) -> None:
    """Write `sweep_figure` to `path` (PNG) atomically."""
    save_figure(sweep_figure(grid, points, unit, **options), path)


# -- writing -----------------------------------------------------------------------------------------
