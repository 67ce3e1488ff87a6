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

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

from ..models.config import CHECKPOINTING, ConfigError
from ..models.devices import device_profile
from ..models.families import family_of
from ..models.training import StepPlan, describe
from ..simulator.engine import simulate
from ..simulator.events import Action, Category, EventLog, Phase, Pool
from ..simulator.ops import OpGraph
from .device import device_settings, gpu_memory
from .peaks import with_headroom
from .units import Scale, format_bytes, format_duration, format_flops

DEFAULT_POLICIES = tuple(p for p in CHECKPOINTING if p != "layers")
PLAIN, CHECKPOINTED = 0, 1


# -- one simulation ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class SimulatedRun:
    """A scenario described and simulated: its op graph, its event log, and the device peak of its worst
    rank (`rank`), plain and with the scenario's headroom."""

    graph: OpGraph
    log: EventLog
    peak: int  # device pool, the worst rank
    capacity_needed: int  # peak (on a CUDA profile: the device total) with the scenario's headroom
    rank: int
    outside: int = 0  # on a CUDA profile: what lies outside the allocator (context, NCCL's buffers), a constant


def simulate_run(scenario, ranks: list[int] | None = None) -> SimulatedRun:
    """Describe and simulate `scenario`; `ranks`: the representative ranks when already known (their
    classes do not depend on checkpointing, and finding them is most of a large data-parallel describe)."""
    graph = describe(scenario.model, scenario.setup, scenario.device, ranks=ranks, torch_version=scenario.torch_version)
    graph.metadata = graph.metadata.updated(**device_settings(scenario))
    log = simulate(graph, simulator=scenario.simulator)
    rank, peak = device_peak(log)
    gpu = gpu_memory(log, rank)  # on a CUDA profile a budget holds the device total (analysis/device.py)
    needed = gpu.total_peak.total if gpu is not None else peak
    outside = gpu.outside_total if gpu is not None else 0
    return SimulatedRun(graph, log, peak, with_headroom(needed, scenario.headroom), rank, outside)


def _representatives(run: SimulatedRun) -> list[int]:
    return sorted({op.rank for op in run.graph.ops_in_order()})


def device_peak(log: EventLog) -> tuple[int, int]:
    """(rank, bytes) of the highest device-pool occupancy of any rank (the lowest rank on ties), as
    `analysis.report.summarize` reports it, in one pass."""
    running: dict[int, int] = {}
    best: dict[int, int] = {}
    for e in log.events:
        if e.block.pool is Pool.DEVICE:
            r = e.block.rank
            running[r] = running.get(r, 0) + e.delta
            if running[r] > best.get(r, -1):
                best[r] = running[r]
    if not best:
        return 0, 0
    rank = max(best, key=lambda r: (best[r], -r))
    return rank, best[rank]


def _step_ends(graph: OpGraph) -> dict[int, dict[int, float]]:
    """rank -> step -> when the rank's last op of that step ends (step 0: the load): each op starts when
    every predecessor has ended (stream order is an edge), as the engine runs it."""
    end: dict[int, float] = {}
    ends: dict[int, dict[int, float]] = {}
    for op in graph.ops_in_order():  # insertion order is topological
        end[op.id] = max((end[p] for p in graph.predecessors(op.id)), default=0.0) + op.duration
        steps = ends.setdefault(op.rank, {})
        steps[op.step] = max(steps.get(op.step, 0.0), end[op.id])
    return ends


def run_time(graph: OpGraph) -> float:
    """Simulated seconds from the first op's start to the last op's end, of the steps the graph holds."""
    return max((t for steps in _step_ends(graph).values() for t in steps.values()), default=0.0)


def step_time(graph: OpGraph) -> float:
    """Simulated seconds per requested step: the whole run's end over its steps, the steps the graph does
    not simulate counted as the simulated steps they repeat (`StepPlan.end_time`, rank by rank: each rank's
    steps repeat at its own pace)."""
    plan = StepPlan.of(graph.metadata)
    return max((plan.end_time(steps) for steps in _step_ends(graph).values()), default=0.0) / plan.steps


def simulated_steps(graph: OpGraph, steps: int | None = None) -> int:
    """How many optimizer steps the graph describes: its metadata's `steps_simulated` (`steps` for a graph
    without one)."""
    md = graph.metadata
    if md.steps_simulated is not None:
        return md.steps_simulated
    return steps if steps is not None else md.setup.batch.steps


def step_flops(graph: OpGraph, rank: int, steps: int | None = None) -> tuple[int, int]:
    """(forward + backward FLOPs without recompute, recomputed FLOPs) of one rank per optimizer step (every
    step does the same; divided by the steps the graph simulates, `steps` only for a graph that does not
    say)."""
    steps = simulated_steps(graph, steps)
    model = recompute = 0
    for op in graph.ops_in_order():
        if op.rank != rank:
            continue
        if op.recompute:
            recompute += op.flops
        elif op.phase in (Phase.FORWARD, Phase.BACKWARD):
            model += op.flops
    return model // steps, recompute // steps


def host_activations(log: EventLog, rank: int) -> int:
    """Most bytes of activations `rank` holds in host memory at once: offloaded saved tensors on a GPU
    profile (0 without offloading, and on a CPU profile, where host and device are one pool)."""
    running = best = 0
    for e in log.events:
        if e.block.pool is Pool.HOST and e.block.rank == rank and e.block.category is Category.ACTIVATION:
            running += e.delta
            best = max(best, running)
    return best


def n_layers(model, setup=None) -> int:
    """The layers checkpointing policies count, as the model's family counts them (`Family.layers`): transformer
    blocks, an MLP's Linear(+activation) pairs, or a traced model's repeated blocks (which need the setup)."""
    return family_of(model).layers(model, setup)


# -- the policy table --------------------------------------------------------------------------------

@dataclass(frozen=True)
class PolicyRow:
    """One policy on one scenario. Sizes in bytes, FLOPs and seconds per optimizer step (all micro-batches).

    `error` is set (and the numbers are 0) when the policy does not apply to the model (e.g. "selective"
    on an MLP), with the reason."""

    policy: str
    label: str
    peak: int = 0
    capacity_needed: int = 0
    host_activations: int = 0
    model_flops: int = 0
    recompute_flops: int = 0
    step_time_s: float = 0.0
    error: str | None = None
    compiled: bool = False  # torch.compile's program (models/compile), the policy inside its graphs

    @property
    def recompute_fraction(self) -> float:
        """Recomputed FLOPs as a share of the forward + backward FLOPs."""
        return self.recompute_flops / self.model_flops if self.model_flops else 0.0

    def as_json(self) -> dict:
        out = dataclasses.asdict(self)
        out["recompute_fraction"] = self.recompute_fraction
        return out


def policy_label(setup) -> str:
    """The policy with the knob that shapes it: "every-k (k=2)", "layers [0, 3]"."""
    if setup.checkpointing.policy == "every-k":
        return f"every-k (k={setup.checkpointing.every_k})"
    if setup.checkpointing.policy == "layers":
        return f"layers {list(setup.checkpointing.layers)}"
    return setup.checkpointing.policy


COMPILE_POLICIES = ("none", "full", "op-policy")  # the rows torch.compile adds where it is modelled


def streams_applies(scenario) -> bool:
    """Whether the table gets a row for activation_offload "streams" (models/replay/offload_streams.py): the
    hand-written transformer tapes, uncompiled, on one device, not offloading already."""
    from ..models.families import family_of, nanogpt
    s = scenario.setup
    return (family_of(scenario.model) is nanogpt.FAMILY and s.checkpointing.activation_offload == "none"
            and not s.compile.on and s.mesh.world_size == 1 and not s.lora.r and s.batch.passes == "train")


def compile_applies(scenario) -> bool:
    """Whether torch.compile is one more fix to try: a traced model, or a hand-written model whose family gives an HF
    equivalent (`Family.hf_equivalent`, which a compiled preset runs as) and it has one, not compiled already, on the
    cpu profile or on a CUDA profile this torch lowers inductor's CUDA program for (models/compile/gpu.py
    `lowerable`: a CUDA build of torch seeing a device of the profile's compute capability); elsewhere compile is
    refused."""
    family = family_of(scenario.model)
    if scenario.setup.compile.on or (family.hand_written and family.hf_equivalent is None):
        return False
    if family.hf_equivalent is not None:
        try:
            family.hf_equivalent(scenario.model)
        except ConfigError:
            return False
    profile = device_profile(scenario.device)
    if profile.is_cpu:
        return True
    from ..models.compile.gpu import lowerable

    return profile.is_cuda and lowerable(profile.compute_capability)


def policy_table(scenario, policies=DEFAULT_POLICIES, with_compile: bool = True,
                 with_streams: bool = False) -> list[PolicyRow]:
    """Simulate `scenario` under each policy in `policies` (names of `TrainingSetup.checkpointing`; "every-k"
    takes the scenario's `checkpoint_every_k`, "layers" its `checkpoint_layers`); and, `with_compile` where
    `compile_applies`, compiled under each of `COMPILE_POLICIES`. A compiled graph marks no op as recomputed (the
    partitioner puts the recompute in the backward graph), so a compiled row's recompute is the FLOPs its step runs
    over the compiled row without checkpointing. `with_streams`: a last row for activation_offload "streams"
    where `streams_applies` (the `peakledger checkpointing` command's table)."""
    cases = [(policy, False) for policy in policies]
    if with_compile and compile_applies(scenario):
        cases += [(policy, True) for policy in COMPILE_POLICIES]
    compiled = scenario.setup.compile.on
    rows = []
    for policy, add_compile in cases:
        changes = {"checkpointing": policy, **({"compile": True} if add_compile else {})}
        if policy != "layers":
            changes["checkpoint_layers"] = ()
        added = ("compile" if policy == "none" else f"compile + {policy}") if add_compile else None
        try:
            case = scenario.with_changes(**changes)
            run = simulate_run(case)
        except ConfigError as e:
            rows.append(PolicyRow(policy, added or policy, error=str(e), compiled=compiled or add_compile))
            continue
        model_flops, recompute_flops = step_flops(run.graph, run.rank)
        rows.append(PolicyRow(policy=policy, label=added or policy_label(case.setup), peak=run.peak,
                              capacity_needed=run.capacity_needed,
                              host_activations=host_activations(run.log, run.rank),
                              model_flops=model_flops, recompute_flops=recompute_flops,
                              step_time_s=step_time(run.graph), compiled=compiled or add_compile))
    if with_streams and streams_applies(scenario):  # activation offload with streams (torchtune), beside the policies
        try:
            case = scenario.with_changes(checkpointing="none", checkpoint_layers=(), activation_offload="streams")
            run = simulate_run(case)
            model_flops, recompute_flops = step_flops(run.graph, run.rank)
            rows.append(PolicyRow(policy="streams", label="streams (torchtune)", peak=run.peak,
                                  capacity_needed=run.capacity_needed,
                                  host_activations=host_activations(run.log, run.rank), model_flops=model_flops,
                                  recompute_flops=recompute_flops, step_time_s=step_time(run.graph)))
        except ConfigError as e:
            rows.append(PolicyRow("streams", "streams (torchtune)", error=str(e)))
    base = next((r for r in rows if r.compiled and r.policy == "none" and r.error is None), None)
    if base is not None:
        rows = [dataclasses.replace(r, model_flops=base.model_flops,
                                    recompute_flops=max(0, r.model_flops - base.model_flops))
                if r.compiled and r.error is None else r for r in rows]
    return rows


def render_table(rows: list[PolicyRow], unit: str | None = None) -> str:
    """The table as text: peak, host memory (offload), recompute FLOPs and share, step time, per policy; each
    column in one unit (the sizes in `unit`, else their largest's: analysis/units.py Scale), named in the head."""
    base = next((r for r in rows if r.policy == "none" and r.error is None and not r.compiled), None)
    ok = [r for r in rows if not r.error]
    size = Scale.of([r.peak for r in ok] + [r.host_activations for r in ok], unit)
    flops = Scale.of([r.recompute_flops for r in ok], kind="flops")
    time = Scale.of([r.step_time_s for r in ok], kind="seconds")
    head = (f"{'policy':<22}{'peak ' + size.unit:>13}{'vs none':>9}{'host ' + size.unit:>13}"
            f"{'recompute ' + flops.unit:>18}{'of fwd+bwd':>12}{'step ' + time.unit:>12}")
    lines = [head, "-" * len(head)]
    for r in rows:
        if r.error:
            lines.append(f"{r.label:<22}  n/a: {r.error}")
            continue
        saved = f"{(r.peak - base.peak) / base.peak:+.1%}" if base and base.peak else ""
        host = size.number(r.host_activations) if r.host_activations else "-"
        lines.append(f"{r.label:<22}{size.number(r.peak):>13}{saved:>9}{host:>13}"
                     f"{flops.number(r.recompute_flops):>18}{r.recompute_fraction:>12.1%}"
                     f"{time.number(r.step_time_s):>12}")
    lines.append("")
    lines.append("peak: device memory of the worst rank; host: activations offloaded to host memory at most; "
                 "recompute: forward FLOPs repeated in backward per step (ops the cost model gives FLOPs: matmuls, "
                 "attention, norms, softmax); step: the simulated time per step (vendor peaks x assumed "
                 "efficiencies, host-link copies included)")
    if any(r.compiled for r in rows):
        lines.append("compile: torch.compile (inductor) of the same step, the policy inside its graphs; its first "
                     "step compiles (tens of seconds to minutes, not in the step time); its recompute is the FLOPs "
                     "its backward graphs run over compile without checkpointing")
    return "\n".join(lines)


def plot_peak_vs_recompute(rows: list[PolicyRow], path: str, title: str = "", unit: str = "GiB", **options) -> None:
    """Each policy's device memory against its step time, the budget and the chosen layer set (`options`:
    budget, chosen, setup), written atomically; drawn by analysis/plot.py `checkpointing_figure`."""
    from .plot import plot_peak_vs_recompute as draw  # matplotlib, loaded for the picture only

    draw(rows, path, title, unit, **options)


# -- per-layer costs ---------------------------------------------------------------------------------

_REGION_RELEASE = re.compile(r"^checkpoint\.region(\d+)\.release$")  # a region is named by its first layer


def _layer_pattern(model, setup=None) -> tuple[re.Pattern, int]:
    """A regex whose group 1 is a layer number inside an op name, and what to divide that number by: the model's
    family's (`Family.layer_pattern`)."""
    return family_of(model).layer_pattern(model, setup)


@dataclass(frozen=True)
class LayerCosts:
    """What each layer costs in each state (s = 0 plain, 1 checkpointed), cut from two simulations. Byte
    figures are (forward, backward) pairs: what a layer keeps alive can shrink when the forward ends
    (autocast drops its cached weight copies then), so the two passes have their own prefixes.

    held[j][s]      bytes layer j's forward leaves alive, (during the forward of the layers above it,
                    into the backward) -- m_j(s).
    inner[j][s]     highest occupancy inside layer j's (forward, backward: its recompute included), minus
                    what the layers below it hold then -- L_j(s).
    recompute[j]    FLOPs per step recomputed when layer j is checkpointed.
    before, after   highest occupancy before the first layer's forward, and outside forward and backward
                    or after the first layer's backward (independent of the set).
    top             highest occupancy (after the last layer's forward, before its backward: final norm,
                    head, loss) minus what every layer holds then.
    kept            bytes the first recomputed op allocates and nothing frees (torch 2.11's cuBLASLt workspace
                    of the autograd thread, models/gpu.py): left out of the pieces above and added to every
                    moment of a set with any layer checkpointed (exact where its peak comes after the first
                    recompute: a later step, or the backward; above the run's peak otherwise).
    """

    held: tuple[tuple[tuple[int, int], tuple[int, int]], ...]
    inner: tuple[tuple[tuple[int, int], tuple[int, int]], ...]
    recompute: tuple[int, ...]
    before: int
    after: int
    top: tuple[int, int]
    kept: int = 0

    def peak(self, layers) -> int:
        """The model's peak for checkpointing exactly `layers`."""
        chosen = set(layers)
        fwd = bwd = 0
        best = max(self.before, self.after)
        for j, (held, inner) in enumerate(zip(self.held, self.inner)):
            s = CHECKPOINTED if j in chosen else PLAIN
            best = max(best, fwd + inner[s][0], bwd + inner[s][1])
            fwd, bwd = fwd + held[s][0], bwd + held[s][1]
        return max(best, fwd + self.top[0], bwd + self.top[1]) + (self.kept if chosen else 0)


def _cut(run: SimulatedRun, n: int, pattern: re.Pattern, divide: int, skip: frozenset = frozenset()) -> dict:
    """One simulation cut into per-layer pieces (see `LayerCosts`).

    What each layer holds is read from one reference pass (the first micro-batch on the lowest rank): in
    the forward, the occupancy at the end of its forward minus that at the end of the layer below; into
    the backward, the bytes of the blocks its forward allocated that are still alive when the backward
    starts. Every moment of every pass and rank is then measured against those reference prefixes, so
    whatever differs between passes (optimizer states in step 2, a data-parallel engine's prefetched
    gathers) lands in the residuals and the model reproduces both simulations it was cut from exactly.
    `skip`: (rank, block id) of blocks left out (`_kept_by_recompute`)."""
    layer_of: dict[str, int | None] = {}

    def layer(op: str) -> int | None:
        if op not in layer_of:
            m = pattern.search(op)
            region = None if m else _REGION_RELEASE.match(op)
            layer_of[op] = int(m.group(1)) // divide if m else int(region.group(1)) if region else None
        return layer_of[op]

    ranks = sorted({e.block.rank for e in run.log.events if e.block.pool is Pool.DEVICE})
    records: dict[int, list[_Record]] = {r: [] for r in ranks}
    level = dict.fromkeys(ranks, 0)
    for e in run.log.events:
        r = e.block.rank
        if e.block.pool is Pool.DEVICE and (r, e.block.id) not in skip:
            level[r] += e.delta
            records[r].append(_Record(level[r], e.delta, e.phase, (e.step, e.micro_batch_index), layer(e.op),
                                      e.block.id))
    passes = {r: _passes(recs) for r, recs in records.items()}
    reference = records[ranks[0]], passes[ranks[0]][min(passes[ranks[0]])]
    held_fwd, held_bwd = _held_forward(*reference, n), _held_backward(*reference, n)
    prefix_fwd, prefix_bwd = _prefix(held_fwd), _prefix(held_bwd)
    inner_fwd, inner_bwd = [0] * n, [0] * n
    before = after = top_fwd = top_bwd = 0
    for r in ranks:
        recs = records[r]
        in_pass = set()
        for fwd, bwd in passes[r].values():
            in_pass.update(fwd, bwd)
            first, last = _layer_span(recs, fwd)
            current = 0
            for i in fwd:
                rec = recs[i]
                if i < first:
                    before = max(before, rec.level)
                elif i > last:
                    top_fwd = max(top_fwd, rec.level - prefix_fwd[n])
                else:
                    current = rec.layer if rec.layer is not None else current
                    inner_fwd[current] = max(inner_fwd[current], rec.level - prefix_fwd[current])
            first, last = _layer_span(recs, bwd)
            current = n - 1
            for i in bwd:
                rec = recs[i]
                if i < first:
                    top_bwd = max(top_bwd, rec.level - prefix_bwd[n])
                elif i > last:
                    after = max(after, rec.level)
                else:
                    current = rec.layer if rec.layer is not None else current
                    inner_bwd[current] = max(inner_bwd[current], rec.level - prefix_bwd[current])
        for i, rec in enumerate(recs):
            if i not in in_pass:
                after = max(after, rec.level)
    return {"held": list(zip(held_fwd, held_bwd)), "inner": list(zip(inner_fwd, inner_bwd)),
            "before": before, "after": after, "top": (top_fwd, top_bwd)}


@dataclass(frozen=True)
class _Record:
    level: int  # the rank's device occupancy right after the event
    delta: int
    phase: Phase
    key: tuple[int, int]  # (step, micro-batch)
    layer: int | None  # the layer its op belongs to
    block: int


def _passes(records: list[_Record]) -> dict[tuple[int, int], tuple[list[int], list[int]]]:
    """(step, micro-batch) -> (indices of its forward events, of its backward events)."""
    out: dict[tuple[int, int], tuple[list[int], list[int]]] = {}
    for i, rec in enumerate(records):
        if rec.phase is Phase.FORWARD:
            out.setdefault(rec.key, ([], []))[0].append(i)
        elif rec.phase is Phase.BACKWARD:
            out.setdefault(rec.key, ([], []))[1].append(i)
    return out


def _layer_span(records: list[_Record], idxs: list[int]) -> tuple[int, int]:
    """Indices of the first and last event of `idxs` that belongs to a layer ((len, -1) if none does)."""
    inside = [i for i in idxs if records[i].layer is not None]
    return (inside[0], inside[-1]) if inside else (len(records), -1)


def _prefix(held: list[int]) -> list[int]:
    out = [0]
    for m in held:
        out.append(out[-1] + m)
    return out


def _held_forward(records: list[_Record], one_pass, n: int) -> list[int]:
    """Bytes each layer's forward leaves alive during the forward: the occupancy after its last forward
    event minus that after the layer below's (before the first layer's first event, for layer 0)."""
    fwd, _ = one_pass
    first, last = _layer_span(records, fwd)
    if last < 0:
        return [0] * n
    end: dict[int, int] = {}
    for i in fwd:
        if records[i].layer is not None:
            end[records[i].layer] = records[i].level
    previous = records[first].level - records[first].delta
    held = []
    for j in range(n):
        here = end.get(j, previous)
        held.append(here - previous)
        previous = here
    return held


def _held_backward(records: list[_Record], one_pass, n: int) -> list[int]:
    """Bytes of the blocks each layer's forward allocated that are still alive when the backward starts."""
    fwd, bwd = one_pass
    first, last = _layer_span(records, fwd)
    if last < 0 or not bwd:
        return [0] * n
    owner: dict[int, tuple[int, int]] = {}  # block -> (layer, bytes)
    current = 0
    for i in range(bwd[0]):
        rec = records[i]
        if rec.delta < 0:
            owner.pop(rec.block, None)
        elif first <= i <= last:
            current = rec.layer if rec.layer is not None else current
            owner[rec.block] = (current, rec.delta)
    held = [0] * n
    for j, nbytes in owner.values():
        held[j] += nbytes
    return held


def _kept_by_recompute(run: SimulatedRun) -> tuple[frozenset, int]:
    """(rank, block id) of the device blocks a recomputed op allocates and nothing frees, and the most bytes of
    them on one rank (`LayerCosts.kept`)."""
    recomputed = {op.name for op in run.graph.ops_in_order() if op.recompute}
    alive: dict[tuple[int, int], int] = {}
    for e in run.log.events:
        if e.block.pool is Pool.DEVICE:
            key = (e.block.rank, e.block.id)
            if e.action is Action.ALLOC and e.op in recomputed:
                alive[key] = e.block.nbytes
            elif e.action is Action.FREE:
                alive.pop(key, None)
    per_rank: dict[int, int] = {}
    for (rank, _), nbytes in alive.items():
        per_rank[rank] = per_rank.get(rank, 0) + nbytes
    return frozenset(alive), max(per_rank.values(), default=0)


def layer_costs(scenario) -> tuple[LayerCosts, SimulatedRun, SimulatedRun]:
    """`LayerCosts` of `scenario`'s model, from a simulation with no layer checkpointed and one with all
    (returned too: the search reuses them)."""
    n = n_layers(scenario.model, scenario.setup)
    pattern, divide = _layer_pattern(scenario.model, scenario.setup)
    plain = simulate_run(with_checkpointed_layers(scenario, ()))
    full = simulate_run(with_checkpointed_layers(scenario, tuple(range(n))), _representatives(plain))
    skip, kept = _kept_by_recompute(full)
    cuts = [_cut(plain, n, pattern, divide), _cut(full, n, pattern, divide, skip)]
    steps = simulated_steps(full.graph)
    recompute = [0] * n
    for op in full.graph.ops_in_order():
        if op.recompute and op.rank == full.rank:
            m = pattern.search(op.name)
            if m:
                recompute[int(m.group(1)) // divide] += op.flops
    costs = LayerCosts(held=tuple((cuts[0]["held"][j], cuts[1]["held"][j]) for j in range(n)),
                       inner=tuple((cuts[0]["inner"][j], cuts[1]["inner"][j]) for j in range(n)),
                       recompute=tuple(r // steps for r in recompute),
                       before=max(c["before"] for c in cuts), after=max(c["after"] for c in cuts),
                       top=tuple(max(c["top"][p] for c in cuts) for p in (0, 1)), kept=kept)
    return costs, plain, full


def with_checkpointed_layers(scenario, layers: tuple[int, ...]):
    """`scenario` with exactly `layers` checkpointed (policy "layers")."""
    return scenario.with_changes(checkpointing="layers", checkpoint_layers=tuple(sorted(layers)))


# -- the search --------------------------------------------------------------------------------------

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
            run = known[layers] = simulate_run(with_checkpointed_layers(scenario, layers), _representatives(plain))
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
                                                   _representatives(plain))
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


__all__ = ["PolicyRow", "policy_table", "policy_label", "render_table", "plot_peak_vs_recompute", "LayerCosts",
           "layer_costs", "cheapest_layers", "OptimalCheckpointing", "optimal_checkpointing", "render_optimal",
           "SimulatedRun", "simulate_run", "with_checkpointed_layers", "run_time", "step_time", "step_flops",
           "simulated_steps", "device_peak",
           "host_activations", "n_layers", "DEFAULT_POLICIES"]
