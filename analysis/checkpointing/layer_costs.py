"""Per-layer costs: two simulations (no layer and every layer checkpointed) cut into what each layer holds and
its highest occupancy, plain and checkpointed (`LayerCosts`, `layer_costs`; step 1 of
analysis/checkpointing/__init__.py)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from ...models.families import family_of
from ...simulator.events import Action, Phase, Pool
from .runs import CHECKPOINTED, PLAIN, SimulatedRun, n_layers, representatives, simulate_run, simulated_steps

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
    full = simulate_run(with_checkpointed_layers(scenario, tuple(range(n))), representatives(plain))
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
