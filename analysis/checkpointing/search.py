"""The least-recompute set of checkpointed layers that fits a budget: dynamic programming over the layer chain, then
the chosen set simulated in full and the limit tightened where it misses (`optimal_checkpointing`; steps 2 and 3 of
analysis/checkpointing/__init__.py)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ...models.config import ConfigError
from ...models.families import family_of
from ..peaks import with_headroom
from ..units import format_bytes, format_duration, format_flops
from .layer_costs import LayerCosts, layer_costs, with_checkpointed_layers
from .runs import CHECKPOINTED, PLAIN, SimulatedRun, n_layers, representatives, simulate_run, step_flops, step_time


def cheapest_layers(costs: LayerCosts, limit: int) -> tuple[int, ...] | None:
    """The least-recompute set of layers whose modelled peak (`LayerCosts.peak`) is <= `limit`, or None.

    Dynamic programming over the chain. After layer j a partial choice is summed up by its recompute
    cost and the bytes the layers so far hold in the forward and in the backward: the constraints of the
    layers above depend on nothing else, and less held is never worse. So only the Pareto front of
    (cost, forward held, backward held) is carried: an entry goes when another costs no more and holds
    no more in either pass. Among the cheapest fitting sets the one with the lowest modelled peak wins,
    then the lexicographically smallest. `LayerCosts.kept` belongs to a set, not to a layer: the chain is
    searched under `limit - kept`, and the empty set, which does without it, under `limit`."""
    found = _cheapest(costs, limit - costs.kept)
    if costs.kept and costs.peak(()) <= limit:
        return min((c for c in (found, ()) if c is not None),
                   key=lambda c: (sum(costs.recompute[j] for j in c), costs.peak(c), c))
    return found


def _cheapest(costs: LayerCosts, limit: int) -> tuple[int, ...] | None:
    """`cheapest_layers` over the chain, `kept` aside."""
    if max(costs.before, costs.after) > limit:
        return None
    front = [(0, 0, 0, 0, ())]  # (cost, forward held, backward held, peak so far, layers)
    for j, (held, inner) in enumerate(zip(costs.held, costs.inner)):
        grown = []
        for cost, fwd, bwd, peak, layers in front:
            for s in (PLAIN, CHECKPOINTED):
                here = max(fwd + inner[s][0], bwd + inner[s][1])
                if here <= limit:
                    grown.append((cost + (costs.recompute[j] if s else 0), fwd + held[s][0], bwd + held[s][1],
                                  max(peak, here), layers + ((j,) if s else ())))
        front = []
        for entry in sorted(grown):
            if not any(kept[1] <= entry[1] and kept[2] <= entry[2] for kept in front):
                front.append(entry)
        if not front:
            return None
    fitting = [(cost, max(peak, fwd + costs.top[0], bwd + costs.top[1]), layers)
               for cost, fwd, bwd, peak, layers in front
               if max(fwd + costs.top[0], bwd + costs.top[1]) <= limit]
    return min(fitting)[2] if fitting else None


@dataclass(frozen=True)
class OptimalCheckpointing:
    """The answer of `optimal_checkpointing`.

    layers            the checkpointed layers (policy "layers"); () when nothing needs checkpointing.
    fits              whether the verified peak (with headroom) fits the budget.
    peak, capacity_needed  the verified simulation's device peak, and with the scenario's headroom.
    predicted_peak    what the per-layer model predicted for `layers`.
    recompute_flops   FLOPs recomputed per step; model_flops the forward + backward FLOPs per step.
    note              how the answer was reached (fallbacks, iterations).
    simulations       the work it took (the wall-clock time is bench/run.py's to measure: same input, same
                      answer, byte for byte).
    """

    layers: tuple[int, ...]
    n_layers: int
    budget: int
    fits: bool
    peak: int
    capacity_needed: int
    predicted_peak: int
    recompute_flops: int
    model_flops: int
    step_time_s: float
    note: str
    simulations: int

    def scenario(self, scenario):
        """`scenario` with this set checkpointed."""
        return with_checkpointed_layers(scenario, self.layers)

    def as_json(self) -> dict:
        out = dataclasses.asdict(self)
        out["layers"] = list(self.layers)
        return out


def _raw_limit(budget: int, headroom: float) -> int:
    """The largest peak whose capacity with headroom fits `budget`."""
    lo, hi = 0, budget
    if with_headroom(0, headroom) > budget:
        return -1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if with_headroom(mid, headroom) <= budget:
            lo = mid
        else:
            hi = mid - 1
    return lo


def optimal_checkpointing(scenario, budget: int, max_rounds: int = 4) -> OptimalCheckpointing:
    """The least-recompute set of checkpointed layers (per-layer full checkpointing) whose simulated peak,
    with the scenario's headroom, fits `budget` bytes; see the module docstring for the method."""
    if not family_of(scenario.model).layer_search:
        raise ConfigError("checkpointing", "the layer search runs on implementation 'nanogpt' models; HF's "
                                           "GPT2LMHeadModel is modelled with none or full only")
    n = n_layers(scenario.model, scenario.setup)
    costs, plain, full = layer_costs(scenario)
    # on a GPU the device needs more than the tensors: what lies outside the allocator (the same for every set),
    # and the allocator's cache (its segments' rounding and free blocks, which differ from set to set and are not
    # additive per layer). A set cannot fit unless its tensors fit beside the former, so the search starts there
    # and walks down: a set that misses on the device alone rules out those the model gives a peak no lower
    raw = _raw_limit(budget, scenario.headroom)
    limit = raw - plain.outside if raw >= plain.outside else -1
    simulations = 2
    known = {(): plain, tuple(range(n)): full}
    tightened = limit
    notes = []
    for round_ in range(1, max_rounds + 1):
        layers = cheapest_layers(costs, tightened)
        if layers is None:
            break
        run = known.get(layers)
        if run is None:
            run = known[layers] = simulate_run(with_checkpointed_layers(scenario, layers), representatives(plain))
            simulations += 1
        if run.capacity_needed <= budget:
            if round_ > 1:
                notes.append(f"found in round {round_}")
            return _result(scenario, layers, n, budget, True, run, costs, "; ".join(notes) or "exact search, verified",
                           simulations)
        predicted = costs.peak(layers)
        gap = run.peak - predicted
        notes.append(f"round {round_}: {len(layers)} layers verified {run.peak:,} B, model said "
                     f"{predicted:,} B" + (f", needs {run.capacity_needed:,} B of the device"
                                           if run.capacity_needed != with_headroom(run.peak, scenario.headroom)
                                           else ""))
        if gap > 0:  # the per-layer model's error (and on a GPU what the device needs beyond the budget)
            tightened -= max(gap, run.capacity_needed - budget)
        else:  # the model was right, the device's cache missed: the sets of a lower modelled peak are left
            tightened = predicted - 1
    every = tuple(range(n))
    fits = full.capacity_needed <= budget
    if fits and plain.outside:  # a GPU: the cache's layout is not additive per layer; verify by size instead
        for layers in _by_size(costs, n):
            run = known.get(layers)
            if run is None:
                run = known[layers] = simulate_run(with_checkpointed_layers(scenario, layers),
                                                   representatives(plain))
                simulations += 1
            if run.capacity_needed <= budget:
                notes.append(f"the cheapest verified set of each size, up to {len(layers)} layers")
                return _result(scenario, layers, n, budget, True, run, costs, "; ".join(notes), simulations)
    note = ("; ".join(notes + ["fell back to checkpointing every layer"]) if fits else
            "does not fit even with every layer checkpointed")
    return _result(scenario, every, n, budget, fits, full, costs, note, simulations)


def _by_size(costs: LayerCosts, n: int):
    """For k = 1 .. n: the k layers of least recompute, then of lowest modelled peak (the set a device-total
    search verifies when the per-layer model's additive limit misses: at most n simulations)."""
    order = sorted(range(n), key=lambda j: (costs.recompute[j], costs.peak((j,)), j))
    for k in range(1, n + 1):
        yield tuple(sorted(order[:k]))


def _result(scenario, layers, n, budget, fits, run: SimulatedRun, costs: LayerCosts, note, simulations):
    model_flops, recompute_flops = step_flops(run.graph, run.rank)
    return OptimalCheckpointing(layers=tuple(layers), n_layers=n, budget=budget, fits=fits, peak=run.peak,
                                capacity_needed=run.capacity_needed, predicted_peak=costs.peak(layers),
                                recompute_flops=recompute_flops, model_flops=model_flops,
                                step_time_s=step_time(run.graph), note=note, simulations=simulations)


def render_optimal(result: OptimalCheckpointing, unit: str | None = "GiB") -> str:
    """The chosen set and what it costs, as text."""
    f = lambda b: format_bytes(b, unit)  # noqa: E731
    share = result.recompute_flops / result.model_flops if result.model_flops else 0.0
    verdict = "fits" if result.fits else "DOES NOT FIT"
    chosen = ", ".join(map(str, _ranges(result.layers))) or "none"
    return "\n".join([
        f"checkpoint {len(result.layers)} of {result.n_layers} layers: {chosen}",
        f"  peak {f(result.peak)} (capacity needed {f(result.capacity_needed)}) {verdict} the budget "
        f"{f(result.budget)}; the per-layer model predicted {f(result.predicted_peak)}",
        f"  recompute {format_flops(result.recompute_flops)} per step ({share:.1%} of forward + backward), "
        f"simulated step time {format_duration(result.step_time_s)}",
        f"  {result.note}; {result.simulations} simulations"])


def _ranges(layers: tuple[int, ...]) -> list[str]:
    """[0, 1, 2, 5] -> ["0-2", "5"]."""
    out: list[tuple[int, int]] = []
    for i in sorted(layers):
        if out and out[-1][1] == i - 1:
            out[-1] = (out[-1][0], i)
        else:
            out.append((i, i))
    return [f"{a}-{b}" if a != b else f"{a}" for a, b in out]
