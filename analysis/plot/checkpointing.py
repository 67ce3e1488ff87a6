"""Activation checkpointing policies: the device memory each needs against the budget, its step time against
no checkpointing (offload's host-link copies included), and the least-recompute layer set chosen."""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch

from ..units import UNITS, format_duration
from .style import (
    BASE_FONT,
    BUDGET_COLOUR,
    CHOSEN_COLOUR,
    NEUTRAL_COLOUR,
    OK_COLOUR,
    OVER_COLOUR,
    axis_unit,
    plot_style,
    save_figure,
    set_titles,
    short_label,
    size_text,
    time_unit,
)


def _ranges(layers) -> str:
    """[0, 1, 2, 5] -> "0-2, 5"."""
    out: list[list[int]] = []
    for i in sorted(layers):
        if out and out[-1][1] == i - 1:
            out[-1][1] = i
        else:
            out.append([i, i])
    return ", ".join(f"{a}-{b}" if a != b else f"{a}" for a, b in out) or "none"


def checkpointing_figure(rows, title: str = "", unit: str = "GiB", *, budget: int | None = None, chosen=None,
                         setup: str = "") -> Figure:
    """One row per policy (analysis/checkpointing.py PolicyRow), and `chosen` (an OptimalCheckpointing: the
    least-recompute layer set that fits the budget) as a highlighted row. Left: the device memory each needs per
    rank (what a budget holds; a tick at the tensors' peak where the device needs more) against the budget line;
    right: its simulated step time against no checkpointing's, so what recompute and offloading's host-link
    copies cost shows. Policies that do not apply are rows marked n/a."""
    unit = axis_unit(unit, max([r.capacity_needed for r in rows] + [budget or 0]))
    scale = UNITS[unit]
    base = next((r for r in rows if r.error is None and r.policy == "none"), None)
    entries = [(r.label, r, False) for r in rows]
    if chosen is not None:
        entries.append((f"chosen: layers {_ranges(chosen.layers)}\n({len(chosen.layers)} of {chosen.n_layers})",
                        chosen, True))
    n = len(entries)
    ys = np.arange(n)[::-1]  # the first row on top
    mem_max = max([getattr(r, "capacity_needed", 0) for _, r, _ in entries] + [budget or 0, 1]) / scale
    t_max = max([getattr(r, "step_time_s", 0.0) for _, r, _ in entries] + [1e-30])
    tmul, tname = time_unit(t_max)
    with plt.rc_context(plot_style()):
        fig = Figure(figsize=(13, 1.6 + 0.55 * n + 1.2), dpi=100, layout="constrained")
        mem, tim = fig.subplots(1, 2, sharey=True, gridspec_kw={"width_ratios": [1, 1]})
        for y, (label, r, is_chosen) in zip(ys, entries):
            if getattr(r, "error", None):
                reason = r.error.split(": ", 1)[1] if r.error.split(": ", 1)[0].isidentifier() else r.error
                for ax, text in ((mem, "n/a: " + short_label(reason, 52)), (tim, "n/a")):
                    ax.text(0.01, y, text, transform=ax.get_yaxis_transform(), va="center", ha="left",
                            fontsize=BASE_FONT - 2, color="#666666")
                continue
            fits = budget is None or r.capacity_needed <= budget
            colour = CHOSEN_COLOUR if is_chosen else NEUTRAL_COLOUR if budget is None else \
                OK_COLOUR if fits else OVER_COLOUR
            hatch = None if fits else "//"
            mem.barh(y, r.capacity_needed / scale, 0.62, color=colour, hatch=hatch, edgecolor="white", lw=0,
                     zorder=3, gid="chosen" if is_chosen else f"policy:{r.policy}")
            if r.peak != r.capacity_needed:
                mem.plot([r.peak / scale] * 2, [y - 0.31, y + 0.31], color="black", lw=1.6, zorder=4, gid="tensors")
            host = getattr(r, "host_activations", 0)
            text = size_text(r.capacity_needed, unit) + _verdict(r.capacity_needed, budget, unit) + \
                (f"\n+ {size_text(host, unit)} on the host" if host else "")
            mem.text(r.capacity_needed / scale + mem_max * 0.01, y, text, va="center", ha="left",
                     fontsize=BASE_FONT - 1, color="black", zorder=7,
                     bbox=dict(boxstyle="square,pad=0.1", fc="white", ec="none", alpha=0.8))
            t = r.step_time_s
            tim.barh(y, t * tmul, 0.62, color=colour, alpha=0.85, edgecolor="white", lw=0, zorder=3,
                     gid="chosen_time" if is_chosen else f"time:{getattr(r, 'policy', '')}")
            share = r.recompute_flops / r.model_flops if r.model_flops else 0.0
            slower = f" ({t / base.step_time_s - 1:+.0%})" if base is not None and base.step_time_s else ""
            why = f"; {share:.0%} recomputed" if share else "; host-link copies" if host else ""
            tim.text(t * tmul + t_max * tmul * 0.01, y, f"{format_duration(t)}{slower}{why}", va="center", ha="left",
                     fontsize=BASE_FONT - 1, zorder=5)
        handles = []
        if budget is not None:
            handles.append(mem.axvline(budget / scale, color=BUDGET_COLOUR, lw=1.8, ls="--", zorder=6, gid="budget",
                                       label=f"budget {size_text(budget, unit)}"))
        if base is not None:
            handles.append(tim.axvline(base.step_time_s * tmul, color="black", lw=1.0, ls=":", zorder=6,
                                       gid="baseline", label="no checkpointing's step time"))
        mem.set_xlim(0, mem_max * 2.0)
        tim.set_xlim(0, t_max * tmul * 1.5)
        mem.set_yticks(ys, [label for label, _, _ in entries])
        for tick, (_, _, is_chosen) in zip(mem.get_yticklabels(), entries):
            if is_chosen:
                tick.set_color(CHOSEN_COLOUR)
                tick.set_fontweight("bold")
        mem.set_ylim(-0.6, n - 0.4)
        mem.set_xlabel(f"device memory needed per rank ({unit})")
        tim.set_xlabel(f"simulated step time ({tname}; recompute and offload copies included)")
        mem.set_title("memory: what the budget holds", fontsize=BASE_FONT)
        tim.set_title("cost: time per optimizer step", fontsize=BASE_FONT)
        for ax in (mem, tim):
            ax.grid(True, axis="x", lw=0.3, color="#cccccc", zorder=0)
            ax.set_axisbelow(True)
        if budget is not None:
            handles += [Patch(facecolor=OK_COLOUR, label="fits the budget"),
                        Patch(facecolor=OVER_COLOUR, hatch="//", edgecolor="white", label="does not fit")]
        if chosen is not None:
            handles.append(Patch(facecolor=CHOSEN_COLOUR, label="least-recompute layer set that fits"
                                 if chosen.fits else "every layer checkpointed (still over the budget)"))
        if any(getattr(r, "error", None) is None and r.peak != r.capacity_needed for _, r, _ in entries):
            handles.append(Line2D([], [], color="black", lw=1.6, marker="|", ms=10, ls="none",
                                  label="tensors' peak (allocated); the device\nneeds more: the caching allocator, CUDA"
                                        " context"))
        tim.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0, frameon=False)
        set_titles(fig, title or "activation checkpointing: memory and step time per policy", setup)
    return fig


def _verdict(needed: int, budget: int | None, unit: str) -> str:
    """Beside a bar: how far over the budget it is, or what it leaves ("" without a budget)."""
    if budget is None:
        return ""
    if needed > budget:
        return f": over by {size_text(needed - budget, unit)}"
    return f": fits, {size_text(budget - needed, unit)} to spare"


def plot_peak_vs_recompute(rows, path: str, title: str = "", unit: str = "GiB", **options) -> None:
    """Write `checkpointing_figure` to `path` (PNG) atomically; `options` are its keyword arguments."""
    save_figure(checkpointing_figure(rows, title, unit, **options), path)


# -- compared cases ----------------------------------------------------------------------------------
