"""The pictures: a run's occupancy over time, checkpointing policies, compared cases and sweeps, as PNG.

Every figure is built by a `*_figure` function (a matplotlib Figure, for tests and notebooks to inspect) and
written by its `plot_*` function through `save_figure`: atomically, and byte for byte the same for the same
input (no software stamp, no date). Shared conventions:

- one colour per `Category`, the same in every picture (`CATEGORY_COLOURS`: the Okabe-Ito palette, then
  Paul Tol's, chosen to stay apart under the common colour-vision deficiencies; the rarer categories carry
  a hatch pattern as well, `CATEGORY_HATCHES`), stacked in `STACK_ORDER` (the state that stays at the
  bottom, activations and temporaries on top);
- a budget is a red dashed horizontal line (gid "budget"), and with headroom the usable part of it too;
- legends sit outside the data, on the right;
- the first title line says what is drawn, the second the setup (`setup_text`).
"""

from __future__ import annotations

import io
import math

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch, Rectangle

from ..models.config import ConfigError
from ..simulator.events import Category, Phase
from ..simulator.files import write_atomic
from ..simulator.timeline import Timeline
from .units import UNITS, format_bytes

# -- the shared tables -------------------------------------------------------------------------------

CATEGORY_COLOURS: dict[Category, str] = {
    Category.PARAMETER: "#0072B2",  # Okabe-Ito blue
    Category.MASTER_PARAMETER: "#56B4E9",  # sky blue: the parameters' fp32 copy, beside them
    Category.GRADIENT: "#E69F00",  # orange
    Category.OPTIMIZER_STATE: "#009E73",  # bluish green
    Category.BUFFER: "#999999",  # grey
    Category.INPUT: "#F0E442",  # yellow
    Category.WORKSPACE: "#332288",  # Tol indigo
    Category.ALL_GATHER_BUFFER: "#882255",  # Tol wine
    Category.REDUCE_SCATTER_BUCKET: "#999933",  # Tol olive
    Category.CHECKPOINT_STAGING: "#117733",  # Tol green
    Category.ACTIVATION: "#CC79A7",  # reddish purple
    Category.TEMPORARY: "#D55E00",  # vermillion
    Category.UNKNOWN: "#000000",  # black: a measured block no rule could label
}
CATEGORY_HATCHES: dict[Category, str] = {Category.WORKSPACE: "x", Category.ALL_GATHER_BUFFER: "/",
                                         Category.REDUCE_SCATTER_BUCKET: "\\", Category.CHECKPOINT_STAGING: ".",
                                         Category.BUFFER: "-", Category.UNKNOWN: "+"}
STACK_ORDER: tuple[Category, ...] = (
    Category.PARAMETER, Category.MASTER_PARAMETER, Category.GRADIENT, Category.OPTIMIZER_STATE, Category.BUFFER,
    Category.WORKSPACE, Category.INPUT, Category.ALL_GATHER_BUFFER, Category.REDUCE_SCATTER_BUCKET,
    Category.CHECKPOINT_STAGING, Category.ACTIVATION, Category.TEMPORARY, Category.UNKNOWN)

PHASE_COLOURS = {Phase.LOAD: "#dddddd", Phase.FORWARD: "#e3eefa", Phase.BACKWARD: "#fbeadf",
                 Phase.OPTIMIZER: "#e2f4dc", Phase.ZERO_GRAD: "#efe3f5", Phase.CHECKPOINT: "#fff3c2"}
PHASE_SHORT = {Phase.LOAD: "load", Phase.FORWARD: "fwd", Phase.BACKWARD: "bwd", Phase.OPTIMIZER: "opt",
               Phase.ZERO_GRAD: "zero", Phase.CHECKPOINT: "save"}

BUDGET_COLOUR = "#C00000"
OK_COLOUR, OVER_COLOUR, NEUTRAL_COLOUR, CHOSEN_COLOUR = "#009E73", "#D55E00", "#0072B2", "#7B3294"
BASE_FONT = 10

_ENGINES = {"fsdp2": "FSDP2", "ddp": "DDP", "zero-redundancy-optimizer": "DDP + ZeroRedundancyOptimizer"}


def _label(category: Category) -> str:
    return category.value.replace("_", " ")


def _style() -> dict:
    return {"font.size": BASE_FONT, "axes.titlesize": BASE_FONT + 1, "axes.labelsize": BASE_FONT,
            "legend.fontsize": BASE_FONT - 1, "xtick.labelsize": BASE_FONT - 1, "ytick.labelsize": BASE_FONT - 1,
            "svg.hashsalt": "peakledger"}


def setup_text(scenario, budget: int | None = None, unit: str = "GiB", varied=()) -> str:
    """One line naming the setup: model, precision and optimizer, micro-batch x sequence, ranks and engine,
    checkpointing, LoRA, device and whose GPU rules; the budget when given. Fields in `varied` (a sweep's grid)
    read "*": the picture's axes give them."""
    s = scenario.setup
    varied = set(varied)

    def g(name, default=None):
        return "*" if name in varied else getattr(s, name, default)

    def on(name, off):  # a knob that is set (or swept)
        return name in varied or getattr(s, name, off) != off

    parts = [str(scenario.name)]
    precision = f"{g('precision')}, {g('optimizer')}"
    if on("optimizer_offload", "none"):
        precision += f" (states offloaded: {g('optimizer_offload')})"
    parts.append(precision)
    batch = f"micro-batch {g('micro_batch')} x seq {g('seq_len')}"
    if on("grad_accum", 1):
        batch += f" x {g('grad_accum')} accumulated"
    parts.append(batch)
    world = g("world_size", 1)
    ranks = "1 rank" if world == 1 else f"{world} ranks"
    mesh = [f"{k} {g(k)}" for k in ("tp", "pp", "cp", "ep") if on(k, 1)]
    if world != 1:
        engine = g("dp_engine", "deepspeed")
        ranks += ", " + (f"ZeRO-{g('zero_stage', 0)}" if engine == "deepspeed" else _ENGINES.get(engine, engine))
    if mesh:
        ranks += ", " + " x ".join(mesh)
    parts.append(ranks)
    if on("checkpointing", "none"):
        parts.append(f"checkpointing {g('checkpointing')}")
    if on("lora_r", 0):
        parts.append(f"LoRA r={g('lora_r')}" + (f", {g('quantize')}" if on("quantize", "none") else ""))
    device = "device *" if "device" in varied else str(getattr(scenario, "device", ""))
    if device and device != "cpu":
        device += f", torch {getattr(scenario, 'torch_version', '2.6')} rules"
    parts.append(device)
    if budget is not None:
        parts.append(f"budget {_size(budget, _axis_unit(unit, budget))}")
    return " | ".join(p for p in parts if p)


def _size(nbytes: float, unit: str) -> str:
    """Bytes in `unit`, or a smaller unit for what is under a hundredth of it (analysis/units.py)."""
    return format_bytes(int(round(nbytes)), unit)


_SMALLER_UNIT = {"TiB": "GiB", "GiB": "MiB", "MiB": "KiB", "TB": "GB", "GB": "MB", "MB": "KB"}


def _axis_unit(unit: str, top: float) -> str:
    """`unit`, or a smaller one of its family when the largest value drawn is under one `unit` (a tiny model's
    picture reads in MiB, not 0.0025 GiB)."""
    while top < UNITS[unit] and unit in _SMALLER_UNIT:
        unit = _SMALLER_UNIT[unit]
    return unit


def _time_unit(end: float) -> tuple[float, str]:
    """(multiplier, name) to show seconds up to `end` in s, ms or us."""
    if end >= 1:
        return 1.0, "s"
    if end >= 1e-3:
        return 1e3, "ms"
    return 1e6, "µs"


def _titles(fig: Figure, what: str, setup: str) -> None:
    """The title: what is drawn, then the setup, wrapped at its " | " to the figure's width."""
    most = int(fig.get_figwidth() * 11)  # characters of the title's font across the figure
    lines = [what]
    for part in setup.split(" | ") if setup else []:
        if len(lines) > 1 and len(lines[-1]) + 3 + len(part) <= most:
            lines[-1] += " | " + part
        else:
            lines.append(part)
    fig.suptitle("\n".join(lines), fontsize=BASE_FONT + 1)


def _budget_lines(ax, budget: int | None, scale: float, unit: str, headroom: float = 0.0,
                  label: str = "budget") -> list:
    """The budget as a red dashed line (gid "budget"), and with headroom the part of it a run may use."""
    handles = []
    if budget is None:
        return handles
    handles.append(ax.axhline(budget / scale, color=BUDGET_COLOUR, lw=1.6, ls="--", zorder=6, gid="budget",
                              label=f"{label} {_size(budget, unit)}"))
    if headroom:
        usable = budget / (1 + headroom)
        handles.append(ax.axhline(usable / scale, color=BUDGET_COLOUR, lw=1.0, ls=":", zorder=6, gid="usable",
                                  label=f"usable with {headroom:.0%} headroom {_size(usable, unit)}"))
    return handles


# -- occupancy over time -----------------------------------------------------------------------------

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
    unit = _axis_unit(unit, max(float(max(tl.total, default=0)), reserved_top + outside, budget or 0))
    scale = UNITS[unit]
    x = np.asarray(tl.times, dtype=float)
    end = float(x[-1]) if len(x) else 1.0
    tmul, tname = _time_unit(end)
    x = x * tmul
    end *= tmul
    total = np.asarray(tl.total, dtype=float) / scale
    spans = _merge_spans(_phase_spans(tl, x)) if len(x) else []
    windows = _zoom_windows(tl, x, spans, end) if zoom and len(x) > 1 else []
    with plt.rc_context(_style()):
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
                handles += [Patch(facecolor=p.get_facecolor()[0], hatch=CATEGORY_HATCHES.get(c), edgecolor="white",
                                  label=f"{_label(c)}: {_size(at_peak.get(c, 0), unit)}")
                            for p, c in zip(polys, cats) if float(np.max(np.asarray(tl.by_category[c], float))) > 0]
            if res is not None:
                line = ax.step(res[0], res[1], where="post", color="black", lw=1.1, zorder=5, gid="reserved",
                               label=f"reserved (caching allocator), peak {_size(float(res[1].max()) * scale, unit)}")
                if gpu_total is not None:
                    text = f"device total: reserved + {_size(outside, unit)} outside\nthe allocator (CUDA context, ...)"
                    line += ax.step(gpu_total[0], gpu_total[1], where="post", color="black", lw=1.0, ls=(0, (1, 1.5)),
                                    zorder=5, gid="device_total", label=text)
                if k == 0:
                    handles += line
            lines = _budget_lines(ax, budget, scale, unit, headroom)
            if capacity is not None:
                lines.append(ax.axhline(capacity[1] / scale, color="#555555", lw=1.0, ls="-.", zorder=6,
                                        gid="capacity", label=f"{capacity[0]} memory {_size(capacity[1], unit)}"))
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
                                  label=f"peak {_size(float(tl.total[int(np.argmax(total))]), unit)} at\n"
                                        f"{_short(e.op, 40)} ({e.phase.value}, step {e.step})"))
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
        _titles(fig, title or "occupancy by category", setup)
    return fig


def _zoom_windows(tl: Timeline, x: np.ndarray, spans, end: float) -> list[tuple[float, float, str]]:
    """(start, end, name) of the zoomed panels: the last optimizer step, and the moment of the peak (one panel
    when the peak is inside that step)."""
    out = []
    total = np.asarray(tl.total, dtype=float)
    peak_t = float(x[int(np.argmax(total))])
    opt = [s for s in spans if s[2] is Phase.OPTIMIZER]
    if opt:
        step = opt[-1][3]
        a = min(s[0] for s in opt if s[3] == step)
        b = max(s[1] for s in opt if s[3] == step)
        pad = max((b - a) * 0.35, end * 0.002)
        lo, hi = max(0.0, a - pad), min(end, b + pad)
        if lo <= peak_t <= hi:
            return [(lo, hi, f"the last optimizer step (step {step}), where the peak is")]  # one panel
        out.append((lo, hi, f"the last optimizer step (step {step})"))
    half = end * 0.03
    lo, hi = max(0.0, peak_t - half), min(end, peak_t + half)
    out.append((lo, hi, "the peak"))
    return out


def plot_timeline(tl: Timeline, path: str, title: str = "", unit: str = "GiB",
                  reserved: list[tuple[float, int, int]] | None = None, **options) -> None:
    """Write `timeline_figure` to `path` (PNG) atomically; `options` are its keyword arguments."""
    save_figure(timeline_figure(tl, title, unit, reserved, **options), path)


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


# -- checkpointing policies --------------------------------------------------------------------------

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
    unit = _axis_unit(unit, max([r.capacity_needed for r in rows] + [budget or 0]))
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
    tmul, tname = _time_unit(t_max)
    with plt.rc_context(_style()):
        fig = Figure(figsize=(13, 1.6 + 0.55 * n + 1.2), dpi=100, layout="constrained")
        mem, tim = fig.subplots(1, 2, sharey=True, gridspec_kw={"width_ratios": [1, 1]})
        for y, (label, r, is_chosen) in zip(ys, entries):
            if getattr(r, "error", None):
                reason = r.error.split(": ", 1)[1] if r.error.split(": ", 1)[0].isidentifier() else r.error
                for ax, text in ((mem, "n/a: " + _short(reason, 52)), (tim, "n/a")):
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
            text = _size(r.capacity_needed, unit) + ("" if fits else " over") + \
                (f"  (+ {_size(host, unit)} on the host)" if host else "")
            mem.text(r.capacity_needed / scale + mem_max * 0.01, y, text, va="center", ha="left",
                     fontsize=BASE_FONT - 1, color="black", zorder=7,
                     bbox=dict(boxstyle="square,pad=0.1", fc="white", ec="none", alpha=0.8))
            t = r.step_time_s
            tim.barh(y, t * tmul, 0.62, color=colour, alpha=0.85, edgecolor="white", lw=0, zorder=3,
                     gid="chosen_time" if is_chosen else f"time:{getattr(r, 'policy', '')}")
            share = r.recompute_flops / r.model_flops if r.model_flops else 0.0
            slower = f" ({t / base.step_time_s - 1:+.0%})" if base is not None and base.step_time_s else ""
            why = f"; {share:.0%} recomputed" if share else "; host-link copies" if host else ""
            tim.text(t * tmul + t_max * tmul * 0.01, y, f"{_seconds(t)}{slower}{why}", va="center", ha="left",
                     fontsize=BASE_FONT - 1, zorder=5)
        handles = []
        if budget is not None:
            handles.append(mem.axvline(budget / scale, color=BUDGET_COLOUR, lw=1.8, ls="--", zorder=6, gid="budget",
                                       label=f"budget {_size(budget, unit)}"))
        if base is not None:
            handles.append(tim.axvline(base.step_time_s * tmul, color="black", lw=1.0, ls=":", zorder=6,
                                       gid="baseline", label="no checkpointing's step time"))
        mem.set_xlim(0, mem_max * 1.45)
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
        _titles(fig, title or "activation checkpointing: memory and step time per policy", setup)
    return fig


def _seconds(s: float) -> str:
    return f"{s * 1e3:.4g} ms" if s < 1 else f"{s:.4g} s"


def _short(text: str, most: int = 90) -> str:
    text = text.split(";")[0].split(" (")[0]
    return text if len(text) <= most else text[:most - 3] + "..."


def plot_peak_vs_recompute(rows, path: str, title: str = "", unit: str = "GiB", **options) -> None:
    """Write `checkpointing_figure` to `path` (PNG) atomically; `options` are its keyword arguments."""
    save_figure(checkpointing_figure(rows, title, unit, **options), path)


# -- compared cases ----------------------------------------------------------------------------------

def compare_figure(cases, unit: str = "GiB", *, budget: int | None = None, title: str = "",
                   setup: str = "") -> Figure:
    """One bar per case (name, analysis/report.py Report): the allocated bytes at its peak stacked by category,
    and on a CUDA profile the reserved bytes and the device total at the device's peak as marks; the budget."""
    unit = _axis_unit(unit, max([max(r.peaks.peak.bytes, r.capacity_needed) for _, r in cases] + [budget or 0]))
    scale = UNITS[unit]
    cats = [c for c in STACK_ORDER if any(r.peaks.peak.live_by_category.get(c, 0) for _, r in cases)]
    gpu = any(r.gpu is not None for _, r in cases)
    tops = [max(r.peaks.peak.bytes, r.capacity_needed) for _, r in cases] + ([budget] if budget is not None else [])
    ymax = max(tops + [1]) / scale * 1.18
    n = len(cases)
    with plt.rc_context(_style()):
        fig = Figure(figsize=(max(10.0, 5.0 + 2.1 * n), 6.4), dpi=100, layout="constrained")
        ax = fig.add_subplot()
        xs = np.arange(n)
        bottom = np.zeros(n)
        for c in cats:
            vals = np.asarray([r.peaks.peak.live_by_category.get(c, 0) for _, r in cases], dtype=float) / scale
            ax.bar(xs, vals, 0.6, bottom=bottom, color=CATEGORY_COLOURS[c], hatch=CATEGORY_HATCHES.get(c),
                   edgecolor="white", lw=0.5, label=_label(c), gid=f"category:{c.value}", zorder=3)
            bottom += vals
        for i, (_, r) in enumerate(cases):
            lines = [f"{_size(r.peaks.peak.bytes, unit)} allocated"]
            top = r.peaks.peak.bytes
            if r.gpu is not None:
                reserved, total = r.gpu.reserved_peak.reserved, r.gpu.total_peak.total
                ax.plot([i - 0.36, i + 0.36], [reserved / scale] * 2, color="black", lw=1.6, zorder=5, gid="reserved")
                ax.plot([i - 0.36, i + 0.36], [total / scale] * 2, color="black", lw=1.4, ls=(0, (1, 1)), zorder=5,
                        gid="device_total")
                lines.append(f"{_size(total, unit)} device total")
                top = max(top, total)
            if r.capacity_needed != top:  # the scenario's headroom
                lines.append(f"{_size(r.capacity_needed, unit)} with headroom")
            over = budget is not None and r.capacity_needed > budget
            if budget is not None:
                lines.append("over the budget" if over else "fits")
            ax.text(i, max(top, r.capacity_needed) / scale + ymax * 0.012, "\n".join(lines), ha="center", va="bottom",
                    fontsize=BASE_FONT - 1, color=OVER_COLOUR if over else "black", zorder=7,
                    fontweight="bold" if over else "normal",
                    bbox=dict(boxstyle="square,pad=0.15", fc="white", ec="none"))
        handles = _budget_lines(ax, budget, scale, unit)
        ax.set_xticks(xs, [_case_tick(name, r) for name, r in cases])
        ax.set_xlim(-0.6, n - 0.4)
        ax.set_ylim(0, ymax * (1.08 if gpu else 1.0))
        ax.set_ylabel(f"peak per rank ({unit})")
        ax.grid(True, axis="y", lw=0.3, color="#cccccc", zorder=0)
        ax.set_axisbelow(True)
        legend = [Patch(facecolor=CATEGORY_COLOURS[c], hatch=CATEGORY_HATCHES.get(c), edgecolor="white",
                        label=_label(c)) for c in reversed(cats)]
        if gpu:
            legend += [Line2D([], [], color="black", lw=1.6, label="reserved (caching allocator) peak"),
                       Line2D([], [], color="black", lw=1.4, ls=(0, (1, 1)),
                              label="device total peak\n(+ CUDA context, NCCL)")]
        ax.legend(handles=legend + handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0,
                  frameon=False, title="at each case's peak", title_fontsize=BASE_FONT - 1, alignment="left")
        _titles(fig, title or "compared cases: allocated memory at the peak, by category", setup)
    return fig


def _case_tick(name: str, report) -> str:
    e = report.peaks.peak.event
    return f"{name}\npeak in {e.phase.value}, step {e.step}" if e is not None else name


def plot_compare(cases, path: str, unit: str = "GiB", **options) -> None:
    """Write `compare_figure` to `path` (PNG) atomically."""
    save_figure(compare_figure(cases, unit, **options), path)


# -- sweeps --------------------------------------------------------------------------------------------

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
    unit = _axis_unit(unit, max([v for v in needed if not math.isnan(v)] + [budget or 0]))
    scale = UNITS[unit]
    with plt.rc_context(_style()):
        if len(keys) == 2:
            fig = _sweep_heatmap(grid, keys, table, scale, unit, budget)
        else:
            fig = _sweep_lines(grid, keys, table, scale, unit, budget)
        what = title or ("sweep: device memory needed per rank over " + " x ".join(keys))
        _titles(fig, what, setup)
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
    handles += _budget_lines(ax, budget, scale, unit)
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
    vmax = max(float(finite.max()) if finite.size else 1.0, (budget or 0) / scale)
    cmap = matplotlib.colormaps["viridis"].with_extremes(bad="#dddddd")
    image = ax.imshow(np.ma.masked_invalid(data), cmap=cmap, vmin=0, vmax=vmax, aspect="auto", origin="lower")
    image.set_gid("heatmap")
    for i in range(len(rows)):
        for j in range(len(cols)):
            v = data[i, j]
            if np.isnan(v):
                ax.text(j, i, "n/a", ha="center", va="center", fontsize=BASE_FONT - 1, color="#555555")
                continue
            over = fits[i, j] is False
            light = v < 0.6 * vmax
            verdict = "\nover" if over else "\nfits" if fits[i, j] else ""
            ax.text(j, i, f"{v:.3g} {unit}{verdict}", ha="center", va="center", fontsize=BASE_FONT - 1,
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
    if budget is not None:
        label += f"\nred line: the budget, {_size(budget, unit)}"
    bar = fig.colorbar(image, ax=ax, label=label)
    if budget is not None:
        bar.ax.axhline(budget / scale, color=BUDGET_COLOUR, lw=3, ls="-", gid="budget")
    return fig


def plot_sweep(grid: dict[str, list], points, path: str, unit: str = "GiB", **options) -> None:
    """Write `sweep_figure` to `path` (PNG) atomically."""
    save_figure(sweep_figure(grid, points, unit, **options), path)


# -- writing -----------------------------------------------------------------------------------------

def save_figure(fig, path: str) -> None:
    """Lay out, render to PNG (no software stamp: same plot, same bytes), close, write atomically."""
    if fig.get_layout_engine() is None:
        fig.tight_layout()
    buffer = io.BytesIO()
    try:
        fig.savefig(buffer, format="png", metadata={"Software": None})
    finally:
        plt.close(fig)
    write_atomic(path, buffer.getvalue())


__all__ = ["CATEGORY_COLOURS", "CATEGORY_HATCHES", "STACK_ORDER", "PHASE_COLOURS", "setup_text", "timeline_figure",
           "plot_timeline", "plot_overlay", "checkpointing_figure", "plot_peak_vs_recompute", "compare_figure",
           "plot_compare", "check_sweep_plot", "sweep_figure", "plot_sweep", "save_figure"]
