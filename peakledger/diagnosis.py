"""`explain` as the user's diagnosis: where the run runs out of memory (the phase: load, a step's forward /
backward / optimizer step, a checkpoint save), what only the first step (or the first save) does there, and every
fix that changes that memory, each re-simulated and ranked; when the run fits, the margin of each phase and the
first-step risks this setup carries that a simulation cannot see.

The moment comes from analysis/explain.py (the first allocation over the budget, or the caching allocator's OOM on
a GPU profile), the phase peaks from analysis/phases.py, the candidate fixes from peakledger/fixes.py; each fix is
the scenario changed and run again (peakledger/api.py `run`). Only fixes that lower what the run needs (or make it
fit where it did not) are listed.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from . import api
from .analysis.device import first_gpu_oom, with_gpu_oom
from .analysis.explain import Moment, from_record, reserved_moment, worst_moment
from .analysis.host import HostLimits, judge_host
from .analysis.phases import PHASE_WORDS, PhasePeak, binding
from .analysis.report import Report
from .analysis.units import Scale, format_bytes, format_duration
from .fixes import RL_KNOBS, candidate_fixes
from .gpus import FSDP2, GPU_LIMIT, TP, ZERO3, Layout, min_gpus
from .models.config import ConfigError, TrainingSetup
from .models.forked import shared_map
from .models.traced import same_recording
from .models.traced.model import TracedModel
from .progress import Progress, reporter
from .scenario import Scenario
from .simulator.allocator import round_size
from .simulator.device_memory import DeviceMemory, DeviceOOM
from .simulator.events import Category, Phase, Pool


@dataclass(frozen=True)
class Fix:
    """One change to the scenario, re-simulated: its worst-rank peak and simulated step time."""

    name: str
    changes: dict
    peak: int
    capacity_needed: int
    fits: bool
    step_time: float
    changes_training: bool  # True when the model trained or its data changes, not only how memory is spent
    note: str
    more_gpus: bool = False  # the fix takes more GPUs than the scenario (a model-parallel degree raised)


@dataclass(frozen=True)
class Explanation:
    scenario: str
    budget: int
    host_budget: int | None
    moment: Moment  # the first device allocation that does not fit, else the device peak
    host_moment: Moment | None
    peak: int
    capacity_needed: int
    step_time: float
    fixes: list[Fix]
    gpu: DeviceMemory | None = None  # the worst rank through the caching allocator (CUDA profiles)
    gpu_oom: DeviceOOM | None = None  # the allocator's first OOM under the budget, after freeing its cache
    fragmentation: bool = False  # that OOM happens although the allocated blocks and the request fit
    fits: bool = False  # the run as it is fits the budget
    where: str = ""  # the phase of the moment, in words ("step 1's checkpoint save (save_mode full-rank0)")
    first_step: list[str] = field(default_factory=list)  # what only the first step / save does at that moment
    phases: list[PhasePeak] = field(default_factory=list)  # the peak of each phase of each simulated step
    binding: PhasePeak | None = None  # the state phase no forward / backward fix can bring under the budget
    risks: list[str] = field(default_factory=list)  # when it fits: what commonly makes a real first step worse
    tried: int = 0  # fixes re-simulated (those listed changed the peak)
    report: Report | None = None  # the run as it is (its timeline, ledger and phases: explain --html)
    rl_listed: bool = False  # RL fixes that lower nothing are listed too (the run runs out in its rollout)


def where(event, setup: TrainingSetup) -> str:
    """The phase of `event` in words, with what the setup says about it."""
    phase = event.phase
    if phase is Phase.LOAD:
        how = setup.checkpoint_io.load_mode
        return "the load, before the first step" + (f" (load_mode {how}" if how != "none" else " (build " +
                                                     setup.checkpoint_io.build) + ")"
    text = f"step {event.step}'s {PHASE_WORDS[phase]}"
    if phase is Phase.CHECKPOINT:
        text += f" (save_mode {setup.checkpoint_io.save_mode}, every {setup.checkpoint_io.every} step(s))"
    elif phase is Phase.OPTIMIZER:
        text += f" ({setup.optimizer.name}, {setup.optimizer.impl})"
    elif event.micro_batch_index >= 0:
        text += f" (micro-batch {event.micro_batch_index})"
    return text


def first_step_causes(moment: Moment, setup: TrainingSetup, unit: str = "GiB") -> list[str]:
    """What at this moment exists because it is the first step or the first save, and whether it recurs."""
    e, live = moment.event, moment.by_category
    f = lambda n: format_bytes(n, unit)  # noqa: E731
    out = []
    if e.phase is Phase.OPTIMIZER and e.step == 1 and live.get(Category.OPTIMIZER_STATE):
        states = live[Category.OPTIMIZER_STATE]
        out.append(f"lazy optimizer states: torch creates them inside the first step() ({f(states)} live now), "
                   "while every gradient is still allocated; every later step holds them too, so this "
                   "recurs: it is the first moment the full training state exists")
    asked = e.block.nbytes if moment.failed and e.block.category is Category.TEMPORARY else 0
    if e.phase is Phase.OPTIMIZER and live.get(Category.TEMPORARY, 0) + asked:
        impl = setup.optimizer.impl
        temporaries = live.get(Category.TEMPORARY, 0) + asked
        out.append(f"optimizer temporaries: {f(temporaries)} with the one asked for ({impl}: "
                   + ("a whole parameter group's intermediate results at once" if impl == "foreach" else
                      "one parameter's at a time") + "); a fused optimizer has none; every step")
    if e.phase is Phase.CHECKPOINT and live.get(Category.CHECKPOINT_STAGING):
        staged = live[Category.CHECKPOINT_STAGING]
        out.append(f"the save's gathered copies: {f(staged)} of checkpoint staging (save_mode "
                   f"{setup.checkpoint_io.save_mode}) on top of the training state; every save")
    if live.get(Category.ALL_GATHER_BUFFER) and e.step <= 1 and e.phase in (Phase.FORWARD, Phase.BACKWARD):
        ahead = (
            setup.data_parallel.fsdp2.forward_prefetch
            if e.phase is Phase.FORWARD
            else setup.data_parallel.fsdp2.backward_prefetch
        )
        out.append(f"all-gather buffers: {f(live[Category.ALL_GATHER_BUFFER])} of unsharded parameters (the unit "
                   f"running and {ahead} prefetched); every step")
    if e.phase is Phase.LOAD and setup.checkpoint_io.build == "device-fp32":
        out.append("the model built in fp32 on the device before the cast to the training dtype; load only")
    if e.phase is Phase.LOAD and setup.checkpoint_io.load_mode != "none":
        out.append(
            f"a checkpoint loaded with load_mode {setup.checkpoint_io.load_mode}: its copies beside the model's; "
            "load only"
        )
    return out


def first_step_risks(scenario: Scenario, report: Report) -> list[str]:
    """When the run fits: what commonly makes a real first step worse than this simulation assumed, for this
    setup (each one named with what to simulate instead)."""
    s, md = scenario.setup, report.metadata
    f = lambda n: format_bytes(n, "GiB")  # noqa: E731
    out = []
    if s.batch.passes == "train" and s.optimizer.name != "sgd":
        out.append("optimizer states appear inside the first step() (included above: the step 1 optimizer phase); a "
                   "run that loads a checkpoint allocates them at the load instead (--load-mode)")
    if s.checkpoint_io.every == 0:
        out.append("no checkpoint save is simulated: a save gathers or stages copies of the state (full state dicts on "
                   "rank 0 can double it); re-run with --checkpoint-every N --save-mode <yours>")
    if s.batch.passes == "train":
        out.append(
            f"every micro-batch is simulated at seq_len {s.batch.seq_len}: with variable lengths the longest batch "
            "sets the peak, and an evaluation loop (no_grad, often a larger batch) is not simulated"
        )
    if report.gpu is not None:
        ctx = report.gpu.context
        out.append(f"outside PyTorch: the CUDA context ({f(ctx)} here, assumed where not measured) and any other "
                   "process on the GPU count against the card; nvidia-smi shows them")
        frag = report.gpu.reserved_peak.fragmentation
        out.append(f"the caching allocator: reserved-but-unallocated {f(frag)} at the reserved peak; a different "
                   "allocation order (data-dependent shapes) fragments more: PYTORCH_CUDA_ALLOC_CONF="
                   "expandable_segments:True removes most of it")
    else:
        out.append("simulated on the cpu profile: no CUDA context or caching allocator; give --device for a GPU's "
                   "reserved memory and device total")
    if md.describer == "traced":
        out.append("traced models: described from the CPU program's kernels; GPU kernels (SDPA backends, fused "
                   "losses) can save different tensors")
    if not s.compile.on:
        out.append("a compiled step (torch.compile) saves fewer activations and fuses temporaries away: --compile "
                   "models inductor's program of a traced model (on a GPU profile, with a CUDA build of torch)")
    return out


def explain(scenario: Scenario, budget: int, host_budget: int | None = None, limits: HostLimits | None = None,
            progress: Progress | None = None) -> Explanation:
    """Why `scenario` does not fit `budget` (or how close it is), with every candidate fix re-simulated
    and ranked: fixes that fit first, those on the same GPUs before more GPUs, those that keep the training
    unchanged before those that change it, then by simulated step time; fixes that do not fit after, by peak.
    `progress(i, n, what)` before each simulation (peakledger/progress.py; silent by default). The run of the
    scenario as it is takes the caller's last report of it (api.py `reusing`)."""
    with api.reusing():
        return _explain(scenario, budget, host_budget, limits, progress)


def _explain(scenario: Scenario, budget: int, host_budget: int | None, limits: HostLimits | None,
             progress: Progress | None) -> Explanation:
    say = reporter(progress)
    say(0, None, f"simulating {scenario.name} as it is")
    base = api.run(scenario)
    setup = base.metadata.setup
    moment = worst_moment(base.log, budget)
    found = first_gpu_oom(base.log, budget) if base.gpu is not None else None
    if found is not None:  # on a GPU the allocator's OOM is the moment (torch raises there)
        moment = from_record(with_gpu_oom(base.log, budget, stop=False, found=found).ooms[0])
    gpu_oom = found[0].oom if found else None
    # fragmentation: the live blocks and the request would fit what the allocator may hold, the cache's gaps not
    fragmentation = gpu_oom is not None and (gpu_oom.point.allocated_blocks + round_size(gpu_oom.requested)
                                             <= budget - (gpu_oom.point.total - gpu_oom.point.reserved))
    host = worst_moment(base.log, host_budget, Pool.HOST) if host_budget is not None and any(
        e.block.pool is Pool.HOST for e in base.log.events) else None
    verdict = api.card_fit(base, budget)  # the one verdict: the figures printed are those judged
    fits_now = verdict.fits
    listed = candidate_fixes(scenario, fragmentation)
    layouts = () if fits_now else MORE_GPU_LAYOUTS
    steps = 1 + len(listed) + len(layouts)
    said = iter(range(1, steps))
    own = _judged(scenario, budget, base, "", {}, False, "") if layouts else None  # (the searches' own size)

    def one(item):  # a candidate re-simulated, or a layout's fewest GPUs (each independent of the others)
        if isinstance(item, tuple):
            try:
                return _fix(scenario, budget, *item, host=limits, base=base)
            except ConfigError:
                return None  # not applicable to this model / setup (a policy the model has no layers for, ...)
        return more_gpus_fix(scenario, budget, item, own=own)

    def done(i, item):
        say(next(said), steps, f"re-simulated: {item[0]}" if isinstance(item, tuple)
            else f"searched the fewest GPUs that fit ({item.name})")

    # the longest first, so that the two processes end together (models/forked.py: on two cores, two at once): the
    # candidates that trace the model anew, the searches of more GPUs (each several runs), then the others
    items = [*layouts, *listed]
    order = sorted(range(len(items)), key=lambda i: _work(scenario, items[i]))
    ran = shared_map(lambda i: one(items[i]), order, lambda _, i: done(i, items[i]))
    results = [None] * len(items)
    for i, r in zip(order, ran):
        results[i] = r
    candidates = [c for c, f in zip(listed, results[len(layouts):]) if f is not None]
    fixes = [f for f in results[len(layouts):] if f is not None] + [f for f in results[:len(layouts)] if f is not None]
    if fixes and not any(f.fits for f in fixes):
        say(steps, steps, "combining fixes")
        combined = _combine(scenario, budget, candidates, fixes, host=limits)
        if combined is not None:
            fixes.append(combined)
    # a run that runs out in its rollout or scoring: the RL fixes are listed whatever they do (a sleep level or an
    # fp8 cache that lowers nothing is an answer too), and rank first within their group; when none fits alone,
    # they are combined with each other and the allocator's settings (the training unchanged)
    rl_phase = moment.event.phase in RL_PHASES and not fits_now
    rl_singles = [f for f in fixes if _rl_fix(f) or f.changes and set(f.changes) <= ALLOCATOR_KNOBS]
    if rl_phase and rl_singles and not any(f.fits for f in rl_singles):
        say(steps, steps, "combining the RL fixes")
        names = {f.name for f in rl_singles}
        combined = _combine(scenario, budget, [c for c in candidates if c[0] in names], rl_singles, host=limits)
        if combined is not None and combined.name not in {f.name for f in fixes}:
            fixes.append(combined)
    tried = len(fixes)
    fixes = [f for f in fixes if _helps(f, base, verdict.need, fits_now) or rl_phase and _rl_fix(f)]
    fixes.sort(key=lambda f: (0, f.more_gpus, not (rl_phase and _rl_fix(f)), f.changes_training, f.step_time)
               if f.fits else (1, not (rl_phase and _rl_fix(f)), f.capacity_needed, f.changes_training))
    return Explanation(scenario=scenario.name, budget=budget, host_budget=host_budget, moment=moment,
                       host_moment=host, peak=base.peaks.overall.bytes, capacity_needed=verdict.need,
                       step_time=base.time_per_step_s, fixes=fixes, gpu=found[0] if found else base.gpu,
                       gpu_oom=gpu_oom, fragmentation=fragmentation, fits=fits_now,
                       where=where(moment.event, setup) + f", rank {moment.rank}",
                       first_step=first_step_causes(moment, setup) if moment.event.step <= 1 else [],
                       phases=base.phases, risks=first_step_risks(scenario, base) if fits_now else [], tried=tried,
                       binding=None if fits_now else binding(base.phases, budget), report=base,
                       rl_listed=rl_phase and any(_rl_fix(f) and not _helps(f, base, verdict.need, fits_now)
                                                  for f in fixes))


FIX_HEAD = ["fix", "peak", "fits", "step time", "cost"]


def fixes_table(x: Explanation, unit: str | None = None) -> tuple[str, list[str], list[list[str]]]:
    """The fixes as `explain` prints them: a title (how many of how many tried, the step time now), the column
    heads and one row of cells per fix (its peak in the table's one unit, whether it fits, its step time against
    the run's, its cost)."""
    if not x.fixes:
        return f"fixes: none of the {x.tried} re-simulated lowers the peak", FIX_HEAD, []
    g = Scale.of([fx.peak for fx in x.fixes], unit)
    what = ("fixes, each re-simulated: every RL fix tried (the run runs out in its rollout), the others where they "
            "lower the peak" if x.rl_listed else "fixes that lower the peak, each re-simulated")
    title = (f"{what} ({len(x.fixes)} of {x.tried} tried; step time "
             f"{format_duration(x.step_time)} now; fitting first, then same GPUs, training unchanged, faster):")
    rows = [[fx.name, g.number(fx.peak), "yes" if fx.fits else "no",
             f"{fx.step_time / x.step_time - 1:+.0%}" if x.step_time else "-",
             fx.note + ("; changes the training" if fx.changes_training else "")] for fx in x.fixes]
    return title, [FIX_HEAD[0], f"{FIX_HEAD[1]} {g.unit}", *FIX_HEAD[2:]], rows


ALLOCATOR_KNOBS = api.ALLOCATOR_SETTINGS


RL_PHASES = frozenset({Phase.ROLLOUT, Phase.GENERATE, Phase.PREFILL, Phase.DECODE, Phase.REFERENCE})


def _rl_fix(fix: Fix) -> bool:
    """A fix of the rollout: RL knobs, with the allocator's settings or not."""
    return bool(set(fix.changes) & RL_KNOBS) and set(fix.changes) <= RL_KNOBS | ALLOCATOR_KNOBS


def _helps(fix: Fix, base: Report, need: int, fits_now: bool) -> bool:
    """A fix is listed when it makes the run fit, or lowers its tensors' peak, or (the allocator's own settings,
    which never change the tensors) lowers the device memory the run needs."""
    if fix.fits and not fits_now or fix.peak < base.peaks.overall.bytes:
        return True
    return set(fix.changes) <= ALLOCATOR_KNOBS and fix.capacity_needed < need


def _fix(scenario: Scenario, budget: int, name: str, changes: dict, changes_training: bool, note: str,
         host: HostLimits | None = None, base: Report | None = None) -> Fix:
    """A fix re-simulated and judged: the card (api.card_fit) and the node's host (analysis/host.py judge_host,
    under `host`'s limits, else the profile's typical node): a fix that moves memory to a host that cannot hold it
    does not fit, and its note says so. `base`: `scenario`'s own run (api.run), whose simulation a fix of the
    allocator's settings alone shares (api.rerun_allocator)."""
    changed = scenario.with_changes(**changes)
    report = api.rerun_allocator(base, changed) if base is not None and set(changes) <= api.ALLOCATOR_SETTINGS \
        else api.run(changed)
    return _judged(scenario, budget, report, name, changes, changes_training, note, host)


def _judged(scenario: Scenario, budget: int, report: Report, name: str, changes: dict, changes_training: bool,
            note: str, host: HostLimits | None = None) -> Fix:
    """`report` (the run of `scenario` with `changes`) judged as a fix (`_fix`)."""
    verdict = api.card_fit(report, budget)
    judged = judge_host(report.log, scenario.device, host or HostLimits(), report.index)
    if judged is not None and not judged.fits:
        note = f"{note}; {judged.text('GiB')}" if note else judged.text("GiB")
    return Fix(
        name=name,
        changes=changes,
        peak=report.peaks.overall.bytes,
        capacity_needed=verdict.need,
        fits=verdict.fits and (judged is None or judged.fits),
        step_time=report.time_per_step_s,
        changes_training=changes_training,
        note=note,
        more_gpus=changes.get("world_size", scenario.setup.mesh.world_size) > scenario.setup.mesh.world_size,
    )


MORE_GPU_LAYOUTS = (FSDP2, ZERO3, TP)


def _work(scenario: Scenario, item) -> int:
    """How long explain's `item` takes, in rank: 0 a candidate that traces its (traced) model anew, 1 a search of
    the fewest GPUs (several runs), 2 any other candidate (one run)."""
    if not isinstance(item, tuple):
        return 1
    if not isinstance(scenario.model, TracedModel):
        return 2
    try:
        changed = scenario.with_changes(**item[1])
    except ConfigError:
        return 2  # (not applicable: nothing run)
    return 2 if changed.model == scenario.model and same_recording(scenario.model, scenario.setup, changed.setup) \
        else 0


def more_gpus_fix(scenario: Scenario, budget: int, layout: Layout, limit: int = GPU_LIMIT,
                  own: Fix | None = None) -> Fix | None:
    """Sharding over more GPUs (peakledger/gpus.py): `layout`'s fewest GPUs at which the run fits `budget`, that
    count re-simulated and the one below it too (named in the fix's note), as a fix; None: none up to `limit`, or
    its own. `own`: `scenario`'s own run judged (`_judged`), not run again."""
    world = scenario.setup.mesh.world_size
    known = {world: own} if own is not None else None
    count = min_gpus(scenario, layout, lambda sc: _fix(sc, budget, "", {}, False, ""), limit, known=known)
    if count.n is None or count.n == world:
        return None
    below = (f"; {count.below_n:,} GPUs do not fit (need {format_bytes(count.below.capacity_needed, 'GiB')})"
             if count.below is not None and count.below_n != world else "")
    return dataclasses.replace(count.at, name=f"{layout.name} over {count.n:,} GPUs ({world} -> {count.n:,})",
                               changes=count.changes(scenario), note=layout.note + below, more_gpus=True)


def _combine(scenario: Scenario, budget: int, candidates, singles: list[Fix], rounds: int = 4,
             host: HostLimits | None = None) -> Fix | None:
    """No single fix fits: add fixes greedily (the one that lowers the peak most, training-preserving ones
    first on ties), each combination re-simulated, until the peak fits or nothing helps."""
    by_name = {c[0]: c for c in candidates}
    best = min(singles, key=lambda f: (f.capacity_needed, f.changes_training))
    chosen = [best]
    for _ in range(rounds - 1):
        if best.fits:
            break
        used = set().union(*(set(f.changes) for f in chosen))
        trials = []
        for name, changes, ct, note in candidates:
            if set(changes) & used:
                continue
            merged = {k: v for f in chosen for k, v in f.changes.items()} | changes
            try:
                trials.append(_fix(scenario, budget, " + ".join([f.name for f in chosen] + [name]), merged,
                                   any(f.changes_training for f in chosen) or ct, "; ".join([best.note, note]),
                                   host=host))
            except ConfigError:
                continue
        if not trials:
            break
        step = min(trials, key=lambda f: (f.capacity_needed, f.changes_training))
        if step.capacity_needed >= best.capacity_needed:
            break
        best = step
        chosen.append(_fix(scenario, budget, *by_name[step.name.split(" + ")[-1]]))
    return best if len(chosen) > 1 else None


def explain_trace(log, budget: int, reserved=None):
    """A measured trace against `budget`: the first allocation that did not fit (a CUDA snapshot's own
    oom record when it has one), else its peak. Given `reserved` (a CUDA snapshot's reserved-memory log,
    TraceFile.reserved), the pair (that moment, the reserved one: the first segment after which reserved bytes
    exceed the budget, else the reserved peak; None when the log holds no segment)."""
    moment = from_record(log.ooms[0]) if log.ooms else worst_moment(log, budget)
    if reserved is None:
        return moment
    return moment, (reserved_moment(reserved, budget) if reserved.events else None)


__all__ = ["Fix", "Explanation", "explain", "explain_trace", "where", "first_step_causes", "first_step_risks"]
