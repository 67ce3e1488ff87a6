"""The peak of each phase of each step: load, a step's forward / backward / optimizer / zero_grad, a checkpoint
save. Where `validate` pairs these with a real run's, `simulate` prints them on their own, so a user sees the
first step's optimizer phase (its states created lazily) or a save's gathered copies against the steady state.

On a CUDA profile each phase also has its reserved peak and device total (context + reserved + buffers outside
the allocator), from the caching-allocator replay's series of the same rank's device events, in the same order
as the timeline's (simulator/device_memory.py appends one point per event of that rank and pool).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..simulator.device_memory import DeviceMemory
from ..simulator.events import Phase
from ..simulator.timeline import Timeline
from .units import Scale, format_bytes

PHASE_WORDS = {Phase.LOAD: "load", Phase.FORWARD: "forward", Phase.BACKWARD: "backward",
               Phase.OPTIMIZER: "optimizer step", Phase.ZERO_GRAD: "zero_grad", Phase.CHECKPOINT: "checkpoint save",
               Phase.EVAL: "eval", Phase.GENERATE: "generate",
               Phase.PREFILL: "prefill", Phase.DECODE: "decode", Phase.ROLLOUT: "rollout",
               Phase.REFERENCE: "reference pass", Phase.OLD_LOGPROBS: "old log-probs"}


@dataclass(frozen=True)
class PhasePeak:
    step: int
    phase: Phase
    allocated: int  # the tensors' highest bytes within the phase
    op: str  # the op that reached it
    reserved: int | None  # the caching allocator's highest reserved bytes within the phase (CUDA profiles)
    device_total: int | None  # the highest reserved + context + outside the allocator within the phase
    index: int = -1  # the timeline event that reached `allocated` (its first moment)
    outside_allocator: int = 0  # blocks mapped outside the allocator (Block.outside_allocator) at device_total

    @property
    def label(self) -> str:
        return f"{PHASE_WORDS[self.phase]}" if self.phase is Phase.LOAD else \
            f"step {self.step} {PHASE_WORDS[self.phase]}"

    def as_json(self) -> dict:
        return {"step": self.step, "phase": self.phase.value, "allocated": self.allocated, "op": self.op,
                "reserved": self.reserved, "device_total": self.device_total}


def phase_peaks(tl: Timeline, gpu: DeviceMemory | None = None) -> list[PhasePeak]:
    """Each (step, phase) of the timeline in the order the run first enters it, with its peaks. `gpu`: the same
    rank's allocator replay with its series (gpu_memory(..., series=True)); its reserved peaks are read only when
    the series covers every event of the timeline (a replay that stopped at an OOM does not)."""
    series = gpu.series if gpu is not None and len(gpu.series) == len(tl.events) else None
    fixed = gpu.outside_total if gpu is not None else 0
    mapped = gpu.outside_series if series is not None and len(gpu.outside_series) == len(series) else None
    best: dict[tuple[int, Phase], list] = {}  # key -> [allocated, index, reserved, reserved + mapped, mapped]
    total = tl.total.tolist()
    for i, e in enumerate(tl.events):
        key = (e.step, e.phase)
        row = best.get(key)
        reserved = series[i][2] if series is not None else None
        ext = mapped[i] if mapped is not None else 0
        if row is None:
            best[key] = [total[i], i, reserved, None if reserved is None else reserved + ext, ext]
            continue
        if total[i] > row[0]:
            row[0], row[1] = total[i], i
        if reserved is not None and reserved > row[2]:
            row[2] = reserved
        if reserved is not None and reserved + ext > row[3]:
            row[3], row[4] = reserved + ext, ext
    return [PhasePeak(step, phase, a, tl.events[i].op, r, None if d is None else d + fixed, i, x)
            for (step, phase), (a, i, r, d, x) in best.items()]


def phase_table(rows: list[PhasePeak], unit: str | None, budget: int | None = None
                ) -> tuple[str, list[str], list[list[str]]]:
    """The phase peaks as a table: its title, its column heads and one row of cells per phase, its sizes in one unit
    (`unit`, else the largest value's: analysis/units.py Scale), read by the text table (`phase_lines`) and the HTML
    report alike. The margin to a budget is negative over it."""
    gpu = bool(rows) and rows[0].reserved is not None
    need = [r.device_total if gpu else r.allocated for r in rows]
    g = Scale.of([r.allocated for r in rows] + (need if gpu else []) + [r.reserved for r in rows if gpu] +
                 ([budget] + [budget - n for n in need] if budget is not None else []), unit)
    title = (f"peak by phase ({g.unit}; " + ("allocated / reserved / device total" if gpu else "allocated tensors")
             + (f"; margin to the budget of {format_bytes(budget, g.unit)}, negative: over it"
                if budget is not None else "") + "):")
    head = ["phase", "allocated", *(("reserved", "device total") if gpu else ()),
            *(("margin",) if budget is not None else ()), "at"]
    body = []
    for r, n in zip(rows, need):
        cells = [r.label, g.number(r.allocated), *((g.number(r.reserved), g.number(r.device_total)) if gpu else ())]
        if budget is not None:
            cells.append(g.number(budget - n))
        body.append(cells + [r.op])
    return title, head, body


def phase_lines(rows: list[PhasePeak], unit: str | None, budget: int | None = None) -> list[str]:
    """The table `simulate` prints: one line per phase of each simulated step, with the margin to a budget."""
    if not rows:
        return []
    title, head, body = phase_table(rows, unit, budget)
    widths = [14] * (len(head) - 2)

    def line(cells: list[str]) -> str:
        return f"  {cells[0]:<28}" + "".join(f"{c:>{w}}" for c, w in zip(cells[1:-1], widths)) + f"  {cells[-1]}"

    return [title, line(head)] + [line(cells) for cells in body]


STATE_PHASES = (Phase.LOAD, Phase.OPTIMIZER, Phase.ZERO_GRAD)  # no activations live: what states alone need


def floor(p: PhasePeak) -> int:
    """What a phase needs that its cache does not explain: its tensors' peak, plus what lies outside the caching
    allocator on a GPU (context, NCCL) at that moment."""
    return p.allocated + (p.device_total - p.reserved - p.outside_allocator
                          if p.device_total is not None and p.reserved is not None else 0)


def binding(phases: list[PhasePeak], budget: int) -> PhasePeak | None:
    """The binding constraint when it is the states: the first phase without activations (load, an optimizer step,
    zero_grad) whose `floor` is over `budget`. No fix of the forward or backward (checkpointing, a smaller
    micro-batch, a shorter sequence) lowers it: only sharding, shrinking or offloading the states, or more memory.
    None when every such phase fits (the forward or backward binds)."""
    return next((p for p in phases if p.phase in STATE_PHASES and floor(p) > budget), None)


__all__ = ["PhasePeak", "phase_peaks", "phase_table", "phase_lines", "PHASE_WORDS", "STATE_PHASES", "floor", "binding"]
