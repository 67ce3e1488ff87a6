"""Hold a simulated run against a measured one (both are `EventLog`s) and say where they differ.

Aligned by phase and step: the peak of each (phase, step) on both sides, the overall, first-step and
steady peaks, bytes by category at each side's peak, and the largest unexplained differences: at the
worst-matching phase peak, the live blocks of one side that have no block of the same category and
size on the other side, largest first, with their tensor names. That is where an assumption of the
describer (what an op saves, which temporaries it makes) disagrees with torch.

Each side says what it is (`measured_by`, `predicted_by`, from the logs' source and metadata): a real torch
run on the CPU (traces/tracker/), a CUDA capture on a named GPU (traces/cuda_capture.py) or a CUDA memory
snapshot; the simulator on the cpu profile, or on a GPU profile with a torch version's allocator rules. A CUDA
trace can also carry the caching allocator's reserved peak (`reserved`, set by the caller).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from ..models.devices import DEVICES
from ..simulator.events import Block, Category, EventLog, Phase, Pool
from ..simulator.timeline import timeline
from .device import torch_rules
from .phases import phase_peaks
from .units import Scale


@dataclass(frozen=True)
class PeakPair:
    label: str
    measured: int
    predicted: int

    @property
    def error(self) -> float:
        return (self.predicted - self.measured) / self.measured if self.measured else 0.0


@dataclass
class Validation:
    name: str
    overall: PeakPair
    first_step: PeakPair
    steady: PeakPair | None
    phases: list[PeakPair]
    categories_at_peak: dict[str, tuple[int, int]]
    unexplained: list[tuple[str, Block]] = field(default_factory=list)  # ("measured only"/"predicted only", block)
    worst_phase: str = ""
    host: PeakPair | None = None  # the rank's host memory, when either side has any
    measured_by: str = "real torch run on CPU"  # what the measured log is (`measured_description`)
    predicted_by: str = "simulator"  # what the simulated log is (`predicted_description`)
    reserved: PeakPair | None = None  # a CUDA trace: the caching allocator's reserved peak, each side

    def passes(self, tolerance: float) -> bool:
        return abs(self.overall.error) <= tolerance


def measured_description(log: EventLog) -> str:
    """What a measured log is, from its source and metadata: "real torch run on CPU", "CUDA capture on NVIDIA
    H200 (cuda:0, torch 2.11.0)", "CUDA memory snapshot (device 0)", ..."""
    meta = log.metadata
    gpu = meta.gpu or (meta.device if isinstance(meta.device, str) else None)
    if meta.device_kind == "cuda" or (log.source.startswith("cuda-snapshot") and gpu):
        cc = meta.compute_capability
        details = ([f"cuda:{meta.cuda_device}"] if isinstance(meta.cuda_device, int) else []) + \
            ([f"compute capability {'.'.join(str(x) for x in cc)}"] if isinstance(cc, list) and cc else []) + \
            ([f"torch {meta.torch_version}"] if meta.torch_version else [])
        return f"CUDA capture on {gpu or 'a CUDA GPU'}" + (f" ({', '.join(details)})" if details else "")
    if log.source.startswith("cuda-snapshot"):
        which = f"devices {meta.devices}" if meta.devices else f"device {0 if meta.device is None else meta.device}"
        return f"CUDA memory snapshot ({which})"
    if str("cpu" if meta.device is None else meta.device) == "cpu":
        return "real torch run on CPU"
    return f"{log.source} on {meta.device}"


def predicted_description(log: EventLog) -> str:
    """What a simulated log is: "simulator" on the cpu profile; on a GPU profile, the profile and the torch
    version whose allocator rules apply."""
    profile = DEVICES.get(str(log.metadata.device))
    if profile is None or not profile.is_cuda:
        return "simulator"
    return f"simulator, {profile.name} profile, torch {torch_rules(log)} allocator rules"


def _phase_peaks(tl) -> dict[tuple[Phase, int], tuple[int, int]]:
    """(phase, step) -> (peak bytes, event index), from analysis/phases.py's phase peaks."""
    return {(p.phase, p.step): (p.allocated, p.index) for p in phase_peaks(tl)}


def _unmatched(a: list[Block], b: list[Block]) -> list[Block]:
    """Blocks of `a` with no partner of the same category and size in `b` (multiset difference). A block of
    unknown category (a CUDA snapshot's: the allocator knows sizes, not tensors) partners a block of the same
    size whatever its category, once the exact partners are taken."""
    left = Counter((x.category, x.nbytes) for x in b)
    rest = []
    for x in sorted(a, key=lambda x: -x.nbytes):
        key = (x.category, x.nbytes)
        if left[key]:
            left[key] -= 1
        else:
            rest.append(x)
    unknown = Category.UNKNOWN
    categories: dict[int, list[Category]] = {}  # size -> the categories of `b` left with blocks of that size
    for (c, n), k in left.items():
        if k:
            categories.setdefault(n, []).append(c)
    out = []
    for x in rest:
        c = next((c for c in categories.get(x.nbytes, ()) if left[(c, x.nbytes)] and unknown in (c, x.category)),
                 None)
        if c is None:
            out.append(x)
        else:
            left[(c, x.nbytes)] -= 1
    return out


def compare_logs(measured: EventLog, simulated: EventLog, name: str = "", rank: int = 0,
                 pool: Pool = Pool.DEVICE, simulated_rank: int | None = None) -> Validation:
    """Measured rank `rank` against the simulation's rank `simulated_rank` (default: the same rank; a rank of a
    class of identical ranks is held against the one the simulation ran)."""
    srank = rank if simulated_rank is None else simulated_rank
    mt, st = timeline(measured, rank, pool), timeline(simulated, srank, pool)
    mp, sp = mt.peak(), st.peak()
    first = PeakPair("first step", mt.peak(lambda e: e.step <= 1).bytes, st.peak(lambda e: e.step <= 1).bytes)
    has_steady = any(e.step >= 2 for e in mt.events) and any(e.step >= 2 for e in st.events)
    steady = PeakPair("steady (steps >= 2)", mt.peak(lambda e: e.step >= 2).bytes,
                      st.peak(lambda e: e.step >= 2).bytes) if has_steady else None
    mph, sph = _phase_peaks(mt), _phase_peaks(st)
    order = [k for k in sorted(set(mph) | set(sph), key=lambda k: (k[1], list(Phase).index(k[0])))]
    phases = [PeakPair(f"{ph.value} step {step}", mph.get((ph, step), (0, -1))[0], sph.get((ph, step), (0, -1))[0])
              for ph, step in order]
    cats = {}
    for c in Category:
        m, s = mp.live_by_category.get(c, 0), sp.live_by_category.get(c, 0)
        if m or s:
            cats[c.value] = (m, s)
    worst = max(((k, abs(sph.get(k, (0, -1))[0] - mph.get(k, (0, -1))[0])) for k in order if k in mph and k in sph),
                key=lambda kv: kv[1], default=(None, 0))[0]
    unexplained: list[tuple[str, Block]] = []
    worst_label = ""
    if worst is not None:
        worst_label = f"{worst[0].value} step {worst[1]}"
        m_live = mt.live_blocks_at(mph[worst][1])
        s_live = st.live_blocks_at(sph[worst][1])
        unexplained = [("measured only", b) for b in _unmatched(m_live, s_live)[:8]] + \
                      [("predicted only", b) for b in _unmatched(s_live, m_live)[:8]]
        unexplained.sort(key=lambda sb: -sb[1].nbytes)
    host = None
    if pool is Pool.DEVICE and any(e.block.pool is Pool.HOST for log in (measured, simulated) for e in log.events):
        host = PeakPair("host memory", timeline(measured, rank, Pool.HOST).peak().bytes,
                        timeline(simulated, srank, Pool.HOST).peak().bytes)
    return Validation(name=name, overall=PeakPair("overall", mp.bytes, sp.bytes), first_step=first, steady=steady,
                      phases=phases, categories_at_peak=cats, unexplained=unexplained[:10], worst_phase=worst_label,
                      host=host, measured_by=measured_description(measured),
                      predicted_by=predicted_description(simulated))


def validation_json(v: Validation) -> dict:
    pair = lambda p: None if p is None else {"measured": p.measured, "predicted": p.predicted,  # noqa: E731
                                             "error": round(p.error, 6)}
    return {"scenario": v.name, "peak": pair(v.overall), "first_step_peak": pair(v.first_step),
            "steady_peak": pair(v.steady), "phases": {p.label: pair(p) for p in v.phases},
            "categories_at_peak": {c: {"measured": m, "predicted": s} for c, (m, s) in v.categories_at_peak.items()},
            "unexplained": [{"side": side, "tensor": b.name, "category": b.category.value, "bytes": b.nbytes}
                            for side, b in v.unexplained], "worst_phase": v.worst_phase, "host_peak": pair(v.host),
            "measured_by": v.measured_by, "predicted_by": v.predicted_by, "reserved_peak": pair(v.reserved)}


def render_validation(v: Validation, unit: str | None = None) -> str:
    """The text: measured and predicted side by side, every size in one unit (`unit`, else the largest's: analysis/
    units.py Scale) named in the head; the differences in bytes."""
    head = [v.overall, v.first_step] + ([v.steady] if v.steady else []) + ([v.host] if v.host else []) + \
        ([v.reserved] if v.reserved else [])
    rows = head + v.phases
    g = Scale.of([x for p in rows for x in (p.measured, p.predicted)] +
                 [x for pair in v.categories_at_peak.values() for x in pair], unit)
    f = g.number
    lines = [f"validate {v.name}: measured ({v.measured_by}) vs predicted ({v.predicted_by})", "",
             f"  {'(' + g.unit + ')':<26}{'measured':>14}{'predicted':>14}{'error':>9}{'diff bytes':>14}"]
    for i, p in enumerate(rows):
        if i == len(head):
            lines.append("  by phase (device memory):" if v.host else
                         "  by phase (allocated):" if v.reserved else "  by phase:")
        lines.append(f"  {p.label:<26}{f(p.measured):>14}{f(p.predicted):>14}{p.error:>+9.2%}"
                     f"{p.predicted - p.measured:>+14,}")
    lines += ["", "  at each side's overall peak, by category:"]
    for c, (m, s) in v.categories_at_peak.items():
        lines.append(f"  {c:<26}{f(m):>14}{f(s):>14}{'':>9}{s - m:>+14,}")
    if v.unexplained:
        lines += ["", f"  largest unexplained blocks at the {v.worst_phase} peak "
                      "(no same-size twin on the other side):"]
        for side, b in v.unexplained:
            lines.append(f"  {side:<16}{b.category.value:<14}{b.nbytes:>12,} B  {b.name}")
    return "\n".join(lines)


STATIC_ROWS = (Category.PARAMETER, Category.GRADIENT, Category.OPTIMIZER_STATE)


def static_rows(log: EventLog, rank: int = 0, step: int = 1) -> dict[str, int]:
    """Parameter, gradient and optimizer-state bytes of one rank live when `step`'s optimizer phase ends
    (gradients still there, states created): the rows an engine's layout alone decides."""
    live: dict[Category, int] = {}
    for e in timeline(log, rank).events:
        if e.step > step or (e.step == step and e.phase is Phase.ZERO_GRAD):
            break
        live[e.block.category] = live.get(e.block.category, 0) + e.delta
    return {c.value: live.get(c, 0) for c in STATIC_ROWS}


def transient_peak(log: EventLog, category: Category, rank: int = 0) -> int:
    """The most bytes of one category (e.g. all-gather buffers) live at once on a rank."""
    running = best = 0
    for e in timeline(log, rank).events:
        if e.block.category is category:
            running += e.delta
            best = max(best, running)
    return best
