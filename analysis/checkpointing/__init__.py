"""Activation checkpointing: what each policy costs, and the cheapest set of checkpointed layers that fits.

Checkpointing trades memory for compute: a checkpointed layer keeps only its input from the forward
pass and runs its forward again in backward. `policy_table` simulates one scenario under each policy of
`TrainingSetup.checkpointing` (see models/tape.py) and puts side by side what it needs (the peak) and
what it costs: the FLOPs recomputed in backward (the ops the replay marks `recompute`), their share of
the forward + backward FLOPs, and the simulated step time from the cost model.

`optimal_checkpointing` answers "which layers must I checkpoint, at the least recompute, to fit this
budget?" over every subset of the layer chain (per-layer full checkpointing, policy "layers"):

1. Two simulations, no layer and every layer checkpointed, are cut into per-layer pieces
   (`LayerCosts`, from the events' op names): for each layer j and state s (plain, checkpointed),
   m_j(s), the bytes layer j's forward leaves alive until its backward (saved tensors or only its
   input, and its output), and L_j(s), the highest occupancy inside layer j's forward or backward
   above the layers below it. Moments outside the layers are constants (before the first layer, and
   after the last one's backward: optimizer, zero_grad) or sit on top of every layer (the head and
   loss, forward and backward). For a set S the model is then
       peak(S) = max(before, after, top + sum_j m_j(s_j), max_j [sum_{i<j} m_i(s_i) + L_j(s_j)]).
2. Dynamic programming over the chain finds the least-recompute S under that model exactly: at layer j
   it keeps, for each recompute cost, the smallest memory held by the layers below (a smaller prefix
   is never worse for the layers above), so the Pareto front of (cost, prefix) is all it carries.
   A block the first recompute allocates and keeps (torch 2.11's cuBLASLt workspace of the autograd
   thread) belongs to the set, not to a layer: `LayerCosts.kept`, added when any layer is checkpointed.
3. The chosen set is simulated in full. If the verified peak does not fit (the model is exact when
   layers are independent, which is what the replay makes them, but engines that prefetch or gather
   across layers can couple them), the gap tightens the limit and the search runs again; after a few
   rounds it falls back to checkpointing every layer, and says so. On a GPU the budget holds the
   device total: the search starts from the tensors' room beside what lies outside the allocator (a
   bound no set beats), and a set whose device total misses only by the allocator's cache (segment
   rounding, cached blocks: not additive per layer, and not the same from set to set) leaves the sets
   of a lower modelled peak for the next round (exact where the device total grows with the peak).

Every answer is a function of the scenario: the same input gives the same JSON and text, byte for byte
(no wall-clock time in them; bench/run.py times the search itself). Per-step figures are per requested
step: a graph that simulates fewer steps than requested (models/training.StepPlan) is read through its
plan (`step_flops`, `step_time`).
"""

from .layer_costs import LayerCosts, layer_costs, with_checkpointed_layers
from .policies import (
    PolicyRow,
    compile_applies,
    plot_peak_vs_recompute,
    policy_label,
    policy_table,
    render_table,
    streams_applies,
)
from .runs import (
    DEFAULT_POLICIES,
    SimulatedRun,
    device_peak,
    host_activations,
    n_layers,
    run_time,
    simulate_run,
    simulated_steps,
    step_flops,
    step_time,
)
from .search import OptimalCheckpointing, cheapest_layers, optimal_checkpointing, render_optimal

__all__ = ["PolicyRow", "policy_table", "policy_label", "render_table", "plot_peak_vs_recompute", "LayerCosts",
           "layer_costs", "cheapest_layers", "OptimalCheckpointing", "optimal_checkpointing", "render_optimal",
           "SimulatedRun", "simulate_run", "with_checkpointed_layers", "run_time", "step_time", "step_flops",
           "simulated_steps", "device_peak",
           "host_activations", "n_layers", "DEFAULT_POLICIES", "compile_applies", "streams_applies"]
