"""PNG plot of a run: stacked occupancy by category over time, phase bands, the peak marked."""

from __future__ import annotations

import io

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

from ..simulator.events import Phase
from ..simulator.files import write_atomic
from ..simulator.timeline import Timeline
from .units import UNITS

PHASE_COLOURS = {Phase.LOAD: "#dddddd", Phase.FORWARD: "#e8f1fb", Phase.BACKWARD: "#fbeee6",
                 Phase.OPTIMIZER: "#eaf7e6", Phase.ZERO_GRAD: "#f3e8f7", Phase.CHECKPOINT: "#fff6cc"}


def plot_timeline(tl: Timeline, path: str, title: str = "", unit: str = "GiB",
                  reserved: list[tuple[float, int, int]] | None = None) -> None:
    """Write the plot to `path` atomically. The x axis is time in seconds (simulated or measured). `reserved`:
    (time, allocated, reserved) after each event of a CUDA device (simulator/device_memory.py), drawn as a line
    over the stacked allocated bytes."""
    scale = UNITS[unit]
    x = np.asarray(tl.times, dtype=float)
    fig, ax = plt.subplots(figsize=(11, 5), dpi=100)
    start = 0
    for i in range(1, len(tl.events) + 1):
        if i == len(tl.events) or tl.events[i].phase is not tl.events[start].phase:
            end = x[i] if i < len(x) else x[-1]
            ax.axvspan(x[start], end, color=PHASE_COLOURS[tl.events[start].phase], lw=0)
            start = i
    cats = list(tl.by_category)
    ys = [np.asarray(tl.by_category[c], dtype=float) / scale for c in cats]
    if ys:
        ax.stackplot(x, *ys, labels=[c.value for c in cats], step="post")
        peak_i = int(np.argmax(np.asarray(tl.total, dtype=float)))
        peak = float(tl.total[peak_i]) / scale
        ax.axvline(x[peak_i], color="black", lw=0.8, ls="--")
        ax.annotate(f"peak {peak:.4g} {unit}\n{tl.events[peak_i].op}", (x[peak_i], peak), textcoords="offset points",
                    xytext=(5, -25), fontsize=8)
    if reserved:
        rx = np.asarray([t for t, _, _ in reserved], dtype=float)
        ry = np.asarray([r for _, _, r in reserved], dtype=float) / scale
        ax.step(rx, ry, where="post", color="black", lw=1.0,
                label=f"reserved (caching allocator), peak {float(ry.max()):.4g} {unit}")
    ax.set_xlabel("time (s; phases shaded: load grey, forward blue, backward orange, optimizer green)")
    ax.set_ylabel(f"live memory ({unit})")
    ax.set_title(title)
    ax.legend(loc="upper left", fontsize=7, ncol=2)
    save_figure(fig, path)


def plot_overlay(measured: Timeline, predicted: Timeline, path: str, title: str = "", unit: str = "MiB") -> None:
    """Measured and predicted total occupancy, each over its own event index scaled to 0..1 (a real run
    and a simulation have different clocks; phases line up by order, not by seconds)."""
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


def save_figure(fig, path: str) -> None:
    """Lay out, render to PNG (no software stamp: same plot, same bytes), close, write atomically."""
    fig.tight_layout()
    buffer = io.BytesIO()
    try:
        fig.savefig(buffer, format="png", metadata={"Software": None})
    finally:
        plt.close(fig)
    write_atomic(path, buffer.getvalue())
