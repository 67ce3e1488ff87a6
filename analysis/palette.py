"""One colour per category and per phase, for every picture (analysis/plot/, matplotlib) and the HTML report
(analysis/export_html.py, a browser): Okabe-Ito, then Paul Tol's colours; the stacking order; the budget's red.
Plain tables, importable without matplotlib."""

from __future__ import annotations

from ..simulator.events import Category, Phase

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
    Category.KV_CACHE: "#44AA99",  # Tol teal
    Category.PREDICTIONS: "#AA4499",  # Tol purple
    Category.ACTIVATION: "#CC79A7",  # reddish purple
    Category.TEMPORARY: "#D55E00",  # vermillion
    Category.UNKNOWN: "#000000",  # black: a measured block no rule could label
}
STACK_ORDER: tuple[Category, ...] = (
    Category.PARAMETER, Category.MASTER_PARAMETER, Category.GRADIENT, Category.OPTIMIZER_STATE, Category.BUFFER,
    Category.WORKSPACE, Category.INPUT, Category.ALL_GATHER_BUFFER, Category.REDUCE_SCATTER_BUCKET,
    Category.CHECKPOINT_STAGING, Category.KV_CACHE, Category.PREDICTIONS, Category.ACTIVATION, Category.TEMPORARY,
    Category.UNKNOWN)

PHASE_COLOURS = {Phase.LOAD: "#dddddd", Phase.FORWARD: "#e3eefa", Phase.BACKWARD: "#fbeadf",
                 Phase.OPTIMIZER: "#e2f4dc", Phase.ZERO_GRAD: "#efe3f5", Phase.CHECKPOINT: "#fff3c2",
                 Phase.EVAL: "#e0f2f1", Phase.GENERATE: "#fde4ec", Phase.PREFILL: "#fbd5e2",
                 Phase.DECODE: "#fdeef3", Phase.ROLLOUT: "#fff0e0", Phase.REFERENCE: "#eceff1",
                 Phase.OLD_LOGPROBS: "#f1f8e9"}
PHASE_SHORT = {Phase.LOAD: "load", Phase.FORWARD: "fwd", Phase.BACKWARD: "bwd", Phase.OPTIMIZER: "opt",
               Phase.ZERO_GRAD: "zero", Phase.CHECKPOINT: "save",
               Phase.EVAL: "eval", Phase.GENERATE: "gen", Phase.PREFILL: "prefill", Phase.DECODE: "decode",
               Phase.ROLLOUT: "rollout", Phase.REFERENCE: "ref", Phase.OLD_LOGPROBS: "old"}

BUDGET_COLOUR = "#C00000"

__all__ = ["CATEGORY_COLOURS", "STACK_ORDER", "PHASE_COLOURS", "PHASE_SHORT", "BUDGET_COLOUR"]
