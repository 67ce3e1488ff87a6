"""The shared look of every picture: one colour per category, the stacking order, phases, the budget line,
titles with the setup, units, and `save_figure` (atomic, byte for byte the same for the same input)."""

from __future__ import annotations

import io

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.figure import Figure

from ...simulator.events import Category
from ...simulator.safe_io import write_atomic
from ..palette import BUDGET_COLOUR, CATEGORY_COLOURS, PHASE_COLOURS, PHASE_SHORT, STACK_ORDER
from ..units import SMALLER, UNITS, auto_unit, format_bytes

# -- the shared tables (the colours, the stacking order and the phases: analysis/palette.py) ------------

CATEGORY_HATCHES: dict[Category, str] = {Category.WORKSPACE: "x", Category.ALL_GATHER_BUFFER: "/",
                                         Category.REDUCE_SCATTER_BUCKET: "\\", Category.CHECKPOINT_STAGING: ".",
                                         Category.BUFFER: "-", Category.UNKNOWN: "+"}
OK_COLOUR, OVER_COLOUR, NEUTRAL_COLOUR, CHOSEN_COLOUR = "#009E73", "#D55E00", "#0072B2", "#7B3294"
BASE_FONT = 10

_ENGINES = {"fsdp2": "FSDP2", "ddp": "DDP", "zero-redundancy-optimizer": "DDP + ZeroRedundancyOptimizer"}


def category_label(category: Category) -> str:
    return category.value.replace("_", " ")


def plot_style() -> dict:
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
        return "*" if name in varied else s.knob(name)

    def on(name, off):  # a knob that is set (or swept)
        return name in varied or s.knob(name) != off

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
        device += f", torch {getattr(scenario, 'torch_version', '2.6')} rules, allocator " + \
            (getattr(scenario, "alloc_conf", "") or "default settings")
    parts.append(device)
    if budget is not None:
        parts.append(f"budget {size_text(budget, axis_unit(unit, budget))}")
    return " | ".join(p for p in parts if p)


def size_text(nbytes: float, unit: str) -> str:
    """Bytes in `unit`, or a smaller unit for what is under a hundredth of it (analysis/units.py)."""
    return format_bytes(int(round(nbytes)), unit)


def axis_unit(unit: str | None, top: float) -> str:
    """`unit`, or a smaller one of its family when the largest value drawn is under one `unit` (a tiny model's
    picture reads in MiB, not 0.0025 GiB); None: the binary unit of `top` (analysis/units.py auto_unit)."""
    if unit is None:
        return auto_unit(top) if top >= UNITS["KiB"] else "KiB"
    while top < UNITS[unit] and SMALLER.get(unit, "B") != "B":  # (down to KiB / KB, never bytes)
        unit = SMALLER[unit]
    return unit


def time_unit(end: float) -> tuple[float, str]:
    """(multiplier, name) to show seconds up to `end` in s, ms or us."""
    if end >= 1:
        return 1.0, "s"
    if end >= 1e-3:
        return 1e3, "ms"
    return 1e6, "µs"


def set_titles(fig: Figure, what: str, setup: str) -> None:
    """The title: what is drawn, then the setup, wrapped at its " | " to the figure's width."""
    most = int(fig.get_figwidth() * 11)  # characters of the title's font across the figure
    lines = [what]
    for part in setup.split(" | ") if setup else []:
        if len(lines) > 1 and len(lines[-1]) + 3 + len(part) <= most:
            lines[-1] += " | " + part
        else:
            lines.append(part)
    fig.suptitle("\n".join(lines), fontsize=BASE_FONT + 1)


def budget_lines(ax, budget: int | None, scale: float, unit: str, headroom: float = 0.0,
                  label: str = "budget") -> list:
    """The budget as a red dashed line (gid "budget"), and with headroom the part of it a run may use."""
    handles = []
    if budget is None:
        return handles
    handles.append(ax.axhline(budget / scale, color=BUDGET_COLOUR, lw=1.6, ls="--", zorder=6, gid="budget",
                              label=f"{label} {size_text(budget, unit)}"))
    if headroom:
        usable = budget / (1 + headroom)
        handles.append(ax.axhline(usable / scale, color=BUDGET_COLOUR, lw=1.0, ls=":", zorder=6, gid="usable",
                                  label=f"usable with {headroom:.0%} headroom {size_text(usable, unit)}"))
    return handles


# -- occupancy over time -----------------------------------------------------------------------------

def short_label(text: str, most: int = 90) -> str:
    text = text.split(";")[0].split(" (")[0]
    return text if len(text) <= most else text[:most - 3] + "..."


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


__all__ = ["CATEGORY_COLOURS", "CATEGORY_HATCHES", "STACK_ORDER", "PHASE_COLOURS", "PHASE_SHORT", "BUDGET_COLOUR",
           "OK_COLOUR", "OVER_COLOUR", "NEUTRAL_COLOUR", "CHOSEN_COLOUR", "BASE_FONT", "setup_text", "save_figure"]
