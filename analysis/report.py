"""The report of one run: peaks, ledger at the peak, FLOPs, assumptions; as JSON and as text.

`summarize(log)` works on any event log. The JSON keys `ledger`, `peak`, `steady_peak`,
`first_step_peak` and `events` are a stable contract read by other tools; add keys, never rename.

A simulated log holds the steps its describer simulated (`steps_simulated` of the requested `steps`;
models/training.StepPlan): later steps repeat them exactly. Its peaks, ledger and rank peaks are the
whole run's as they stand (a repeated step reaches nothing its source did not reach first); the step time
and the event count of the whole run come from `run_seconds` and `run_events`. `events` counts the events
simulated; `events_all_steps` what a simulation of every requested step would record.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field

from ..models.training import RANK_LIST_LIMIT, RankRanges, StepPlan
from ..simulator.device_memory import DeviceMemory
from ..simulator.events import EventLog, Pool
from ..simulator.gcpause import gc_paused
from ..simulator.log_index import LogIndex, log_index
from ..simulator.run_metadata import RunMetadata
from ..simulator.timeline import PeakPoint, Timeline, rank_events, rank_peak_points, timeline
from .device import context_of, device_json, gpu_memory, torch_rules
from .host import host_uses
from .ledger import LedgerRow, ledger_at
from .peaks import Peaks, peaks, with_headroom
from .phases import PhasePeak, phase_peaks

REPORT_VERSION = 2


@dataclass(frozen=True)
class RankPeak:
    """One simulated (or measured) rank's peak, and the ranks whose layout is identical to it.

    JSON: `ranks` lists them (null for a class of more than RANK_LIST_LIMIT ranks: a million-rank class
    would be megabytes of numbers), `rank_ranges` gives them as inclusive [first, last] ranges, always."""

    rank: int
    same_as: Sequence[int]  # every rank this one stands for, itself included (a RankRanges from rank_peaks)
    peak: PeakPoint

    def as_json(self) -> dict:
        ranks = self.same_as if isinstance(self.same_as, RankRanges) else RankRanges.of(self.same_as)
        return {"rank": self.rank, "ranks": list(ranks) if len(ranks) <= RANK_LIST_LIMIT else None,
                "rank_ranges": ranks.as_json(), **_peak_json(self.peak)}


@dataclass
class Report:
    name: str
    log: EventLog
    peaks: Peaks
    metadata: RunMetadata = field(default_factory=RunMetadata)  # the log's
    ranks: list[RankPeak] = field(default_factory=list)
    host: Peaks | None = None  # the same rank's host memory, when the run uses it
    gpu: DeviceMemory | None = None  # the same rank through the caching allocator (with its series), on a CUDA profile
    index: LogIndex | None = None  # the log's index (simulator/log_index.py), made once by `summarize` for its readers
    peak_timeline: Timeline | None = field(default=None, repr=False)  # `timeline`, where `summarize` made it

    @property
    def capacity_needed(self) -> int:
        """What the rank needs of its device, x (1 + headroom): on a CUDA profile the device total (context +
        reserved + outside the allocator), else the peak of the tensors."""
        if self.gpu is not None:
            return with_headroom(self.gpu.total_peak.total, self.peaks.headroom)
        return self.peaks.capacity_needed

    @functools.cached_property
    def timeline(self) -> Timeline:
        """The peak rank's timeline in the peak's pool: `summarize`'s, or made once when something reads it."""
        if self.peak_timeline is not None:
            return self.peak_timeline
        return timeline(self.log, self.peaks.rank, self.peaks.pool, index=self.index)

    @property
    def gpu_series(self) -> DeviceMemory | None:
        """The peak rank through the caching allocator with its series (time, allocated, reserved) per device
        event, on a CUDA profile (the phase peaks, the picture, the HTML report read it): `gpu` itself, whose one
        replay in `summarize` keeps the series (appending a point per event costs little beside the replay that
        a second pass would repeat)."""
        return self.gpu

    @functools.cached_property
    def ledger(self) -> list[LedgerRow]:
        """What is live at the peak, by row (analysis/ledger.py `ledger_at`), made when something reads it (a
        report shown; not the re-simulations of explain's fixes or a search, which judge the peak alone)."""
        overall = self.peaks.overall
        return ledger_at(self.timeline, overall.index) if overall.event is not None else []

    @functools.cached_property
    def phases(self) -> list[PhasePeak]:
        """The peak of each phase of each simulated step (analysis/phases.py), made when a report is shown."""
        return phase_peaks(self.timeline, self.gpu_series)

    @property
    def steps(self) -> int:
        setup = self.metadata.setup
        return setup.batch.steps if setup is not None else 1

    @property
    def time_per_step_s(self) -> float:
        """Simulated seconds per requested step: the whole run's end over its steps (0.0 for an empty log)."""
        return run_seconds(self.log, self.index) / max(1, self.steps)


def run_plan(log: EventLog) -> StepPlan:
    """The steps the log stands for (a full run for a measured log, or one a stopping OOM cut short)."""
    return StepPlan.of(log.metadata)


def step_ends(log: EventLog, index: LogIndex | None = None) -> dict[int, dict[int, float]]:
    """rank -> step -> when the rank's last event of that step happens (events are in time order); `index`: the
    log's (simulator/log_index.py), its last event of each (rank, step) found there."""
    if index is not None:
        ends: dict[int, dict[int, float]] = {}
        for e in map(log.events.__getitem__, index.last_of_steps()):
            ends.setdefault(e.block.rank, {})[e.step] = e.time
        return ends
    ends = {}
    for e in log.events:
        ends.setdefault(e.block.rank, {})[e.step] = e.time
    return ends


def run_seconds(log: EventLog, index: LogIndex | None = None) -> float:
    """The time of the whole run's last event: the log's own, or, when later steps repeat simulated ones,
    the last repeat's (`StepPlan.end_time` of each rank, whose steps repeat at its own pace; equal to a full
    simulation's up to float rounding)."""
    plan = run_plan(log)
    return max((plan.end_time(ends) for ends in step_ends(log, index).values()), default=0.0)


def run_events(log: EventLog, index: LogIndex | None = None) -> int:
    """How many events a simulation of every requested step records: the log's, plus each repeated step's
    source's count."""
    plan = run_plan(log)
    if not plan.truncated:
        return len(log.events)
    per_step: dict[int, int] = index.step_counts() if index is not None else {}
    for e in log.events if index is None else ():
        per_step[e.step] = per_step.get(e.step, 0) + 1
    first, last = plan.repeated
    cycles, rest = divmod(plan.steps - plan.simulated, plan.period)
    return (len(log.events) + cycles * sum(per_step.get(s, 0) for s in range(first, last + 1))
            + sum(per_step.get(first + i, 0) for i in range(rest)))


def rank_peaks(log: EventLog, pool: Pool = Pool.DEVICE, index: LogIndex | None = None) -> list[RankPeak]:
    """The peak of every rank in the log, with the ranks each stands for (its metadata's `rank_class_ranges`; a
    log written before it was there lists them in `rank_classes`); `index`: the log's, read instead of its events."""
    md = log.metadata
    if md.rank_class_ranges is not None:
        classes = {int(r): RankRanges.from_json(m) for r, m in md.rank_class_ranges.items()}
    else:
        classes = {int(r): RankRanges.of(m) for r, m in (md.rank_classes or {}).items()}
    points = rank_peak_points(log, pool, index)
    # a pipeline group is simulated whole: its stages that stand for no class of their own are not reported
    return [RankPeak(rank=r, same_as=classes.get(r, RankRanges([(r, r + 1)])), peak=points[r]) for r in sorted(points)
            if not classes or r in classes]


@gc_paused  # simulator/gcpause.py: the log's events are walked several times, nothing cyclic is made
def summarize(log: EventLog, name: str = "", headroom: float = 0.0, rank: int | None = None,
              pool: Pool = Pool.DEVICE) -> Report:
    """The report of one rank: `rank`, or by default the rank with the highest peak (the lowest on ties). The log's
    index (simulator/log_index.py) is made here, once, and kept in the report for every later reader."""
    index = log_index(log)
    per_rank = rank_peaks(log, pool, index)
    if rank is None:
        rank = max(per_rank, key=lambda rp: (rp.peak.bytes, -rp.rank)).rank if per_rank else 0
    events = rank_events(log, rank, index)  # the rank's events, found once for its timelines and allocator replay
    tl = timeline(log, rank, pool, events, index)
    pk = peaks(tl, headroom=headroom)
    host, host_pool = None, Pool.HOST
    if pool is Pool.DEVICE and any(e.block.pool is host_pool for _, e in events):
        host = peaks(timeline(log, rank, Pool.HOST, events, index))
    gpu = gpu_memory(log, rank, series=True, events=events) if pool is Pool.DEVICE else None  # the run's one replay
    return Report(name=name, log=log, peaks=pk, metadata=log.metadata, ranks=per_rank, host=host,
                  gpu=gpu, index=index, peak_timeline=tl)


def training_flops(n_params: int, tokens_per_step: int) -> int:
    """6ND: forward + backward FLOPs of a dense model per optimizer step (an approximation)."""
    return 6 * n_params * tokens_per_step


def _peak_json(p: PeakPoint | None) -> dict | None:
    if p is None:
        return None
    e = p.event
    return {"bytes": p.bytes, "unit": "B", "op": e.op if e else None, "phase": e.phase.value if e else None,
            "step": e.step if e else None, "micro_batch_index": e.micro_batch_index if e else None,
            "time_s": e.time if e else None,
            "live_by_category": {c.value: b for c, b in p.live_by_category.items()}}


def _repeats_json(plan: StepPlan) -> dict | None:
    if not plan.truncated:
        return None
    first, last = plan.repeated
    return {"steps": [plan.simulated + 1, plan.steps], "source_steps": [first, last], "period": plan.period,
            "rule": f"step s > {plan.simulated} repeats simulated step {first} + (s - {first}) mod {plan.period}"}


def _host_memory_json(r: Report) -> dict:
    """{"host_memory": the host peak split pinned / pageable} where the rank holds pinned host memory (else {}: the
    split says nothing more than host_peak, and such a run's JSON stays as it was)."""
    use = host_uses(r.log, r.index).get(r.host.rank) if r.host is not None else None
    return {"host_memory": use.as_json()} if use is not None and use.pinned_peak else {}


def report_json(r: Report) -> dict:
    md = r.metadata
    setup = md.setup
    plan = run_plan(r.log)
    out = {
        "version": REPORT_VERSION,
        "scenario": r.name,
        "model": md.model,
        "describer": "hand-written" if md.describer is None else md.describer,
        "batch": md.batch,
        "describer_note": md.describer_note,
        "device": md.device,
        "gpu_rules": {"torch_version": torch_rules(r.log), "why": md.torch_rules} if r.gpu is not None else None,
        "setup": setup.knob_values() if setup is not None else {},
        "n_params": md.n_params,
        "n_trainable": md.n_trainable,
        "rank": r.peaks.rank,
        "pool": r.peaks.pool.value,
        "peak": _peak_json(r.peaks.overall),
        "first_step_peak": _peak_json(r.peaks.first_step),
        "steady_peak": _peak_json(r.peaks.steady),
        "transient_bytes": r.peaks.transient,
        "headroom": r.peaks.headroom,
        "capacity_needed": r.capacity_needed,
        **device_json(r.gpu, context_of(r.log)),
        "ledger": [row.as_json() for row in r.ledger],
        "phases": [p.as_json() for p in r.phases],
        "ranks": [rp.as_json() for rp in r.ranks],
        "host_peak": _peak_json(r.host.overall) if r.host else None,
        **_host_memory_json(r),
        "steps": plan.steps,
        "steps_simulated": plan.simulated,
        "repeats": _repeats_json(plan),
        "events": len(r.log.events),
        "events_all_steps": run_events(r.log, r.index),
        "ooms": [{"op": o.event.op, "phase": o.event.phase.value, "step": o.event.step, "tensor": o.event.block.name,
                  "bytes": o.event.block.nbytes, "capacity": o.capacity, "live_bytes": o.live_bytes,
                  "message": o.message or None}
                 for o in r.log.ooms],
        "assumptions": assumptions(r),
    }
    if setup is not None:
        tokens = md.tokens_per_step
        out["effective_batch"] = md.effective_batch
        out["tokens_per_step"] = tokens
        out["training_flops_per_step"] = {
            "value": training_flops(md.n_trainable or md.n_params or 0, tokens),
            "method": "6ND dense-model approximation (N = trainable parameters, D = tokens per optimizer step)"}
        if md.expert_parallel:
            out["expert_parallel"] = md.expert_parallel
        if md.counted_flops_per_step:  # a traced model: torch's FLOP formulas over the recorded ops
            out["training_flops_per_step"] = {
                "value": md.counted_flops_per_step,
                "method": "counted per rank over the traced forward and backward aten ops "
                          "(torch/utils/flop_counter.py)"}
        elif md.n_active_params is not None:  # mixture of experts: N = parameters one token runs through
            out["n_active_params"] = md.n_active_params
            out["training_flops_per_step"] = {
                "value": training_flops(md.n_active_params, tokens),
                "method": f"6ND over active parameters (N = parameters one token runs through, {md.experts}; "
                          "D = tokens per optimizer step)"}
        if r.log.events:
            out["simulated_time_per_step_s"] = run_seconds(r.log, r.index) / setup.batch.steps
    return out


def assumptions(r: Report) -> list[str]:
    """The run's assumptions, with the line of what lies outside the allocator for its profile and torch version
    (measured or assumed, analysis/device.py `context_of`), in place of the one a log written before it carries."""
    ctx = context_of(r.log)
    kept = [a for a in (r.metadata.assumptions or []) if not a.startswith("CUDA context and kernels")]
    return kept + ([ctx.assumption()] if ctx is not None else [])
