"""The pictures: a run's occupancy over time, checkpointing policies, compared cases and sweeps, as PNG.

Every figure is built by a `*_figure` function (a matplotlib Figure, for tests and notebooks to inspect) and
written by its `plot_*` function through `save_figure`: atomically, and byte for byte the same for the same
input (no software stamp, no date). How the modules compose:

    style.py          one colour per `Category` (Okabe-Ito, then Tol; hatches for the rarer ones), the stacking
                      order, phase shades, the budget line, titles with the setup (`setup_text`), units, saving
    timeline.py       a run's occupancy (simulate --plot) and measured vs predicted (validate --plot)
    checkpointing.py  the policies' memory and step time, the chosen layer set (checkpointing --plot)
    compare.py        the compared cases at their peaks (compare --plot)
    sweep.py          a grid as lines or a heatmap (sweep --plot)

Each figure module draws with style.py's tables only, so a category has one colour in every picture.
"""

from .checkpointing import checkpointing_figure, plot_peak_vs_recompute
from .compare import compare_figure, plot_compare
from .style import BUDGET_COLOUR, CATEGORY_COLOURS, CATEGORY_HATCHES, STACK_ORDER, save_figure, setup_text
from .sweep import SWEEP_MAX_LINES, check_sweep_plot, plot_sweep, sweep_figure
from .timeline import plot_overlay, plot_timeline, timeline_figure

__all__ = ["CATEGORY_COLOURS", "CATEGORY_HATCHES", "STACK_ORDER", "BUDGET_COLOUR", "setup_text", "save_figure",
           "timeline_figure", "plot_timeline", "plot_overlay", "checkpointing_figure", "plot_peak_vs_recompute",
           "compare_figure", "plot_compare", "sweep_figure", "plot_sweep", "check_sweep_plot", "SWEEP_MAX_LINES"]
