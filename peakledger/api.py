"""The public API: simulate a scenario, find the largest micro-batch, compare scenarios, explain an OOM with
its fixes; before any model, the abstract batch budget (`batch_range`) and the compute plan (`plan`). Real runs
held against the simulation are validation.py."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager

from .analysis.card_fit import CardFit
from .analysis.card_fit import card_fit as card_fit_of
from .analysis.device import device_settings, with_gpu_oom
from .analysis.ledger import ledger_at
from .analysis.maxbatch import BatchRange, max_fitting, solve
from .analysis.peaks import with_headroom
from .analysis.peers import (
    deepspeed_estimators,
    largest_layer_params,
    model_state_peak,
    peak_difference,
    peak_moment,
    zero_paper_model_states,
)
from .analysis.peers_own import accelerate_estimate
from .analysis.peers_parallel import parallel_peers as formulas
from .analysis.report import Report, summarize
from .models.config import ConfigError
from .models.devices import device_profile
from .models.families import family_of
from .models.traced import from_hf_dict, micro_batch_points
from .models.traced.model import TracedModel
from .models.training import build_tape, describe
from .plan import plan as plan  # (the compute planner, peakledger/plan.py: one of the API's entry points)
from .progress import Progress, reporter
from .scenario import Scenario, build_scenario, traced_scenario
from .simulator.engine import simulate
from .simulator.events import Category, EventLog, Phase, Pool
from .simulator.gcpause import gc_paused
from .simulator.ops import OpGraph
from .simulator.timeline import timeline

STATE_CATEGORIES = (Category.PARAMETER, Category.MASTER_PARAMETER, Category.GRADIENT, Category.OPTIMIZER_STATE)


def trace(hf_config=None, *, module: str | None = None, name: str | None = None, device: str = "H100-80GB",
          describer: str = "traced", **training) -> Scenario:
    """A scenario for a model peakledger traces (models/traced): `hf_config` a config.json path or a dict of
    one, or `module` "path/to/file.py:factory" (factory() -> (model, batch, loss_fn)); `training` holds
    TrainingSetup fields (micro_batch, seq_len, precision, optimizer, checkpointing, ...). The result goes
    to `run`, `explain`, `max_micro_batch` and analysis.checkpointing like any scenario; the trace itself
    runs at the first of those (then cached per shape)."""
    if (hf_config is None) == (module is None):
        raise ConfigError("hf_config", "give exactly one of hf_config (a config.json path or dict) and module")
    if isinstance(hf_config, dict):
        model = from_hf_dict(hf_config, name or str(hf_config.get("model_type", "hf")))
        return traced_scenario(model, {}, training, {"device": device}, name, None)
    table = {"hf_config": str(hf_config)} if hf_config is not None else {"module": module}
    return build_scenario({**table, "describer": describer}, training, {"device": device}, name=name)


def op_graph(scenario: Scenario, budget: int | None = None) -> OpGraph:
    """The scenario described: the op graph the simulator runs (simulator/graph_nx.py gives its networkx form)."""
    graph = describe(scenario.model, scenario.setup, scenario.device, torch_version=scenario.torch_version)
    graph.metadata = graph.metadata.updated(**device_settings(scenario), device_capacity=budget)
    return graph


# the caller's last run of its own (`run` outside max-batch and explain): (scenario, report). Max-batch's probe of the
# scenario's own micro-batch and explain's run of the scenario as it is take that report, not a run of it again
# (docs/models.md's example: `run`, then `max_micro_batch` and `explain` of one scenario)
_LAST: list[tuple[Scenario, Report]] = []
_INSIDE = [0]  # > 0 while max-batch or explain runs (`reusing`)


@contextmanager
def reusing() -> Iterator[None]:
    """Runs inside (max-batch's, explain's) take the caller's last report of the same scenario, and keep none."""
    _INSIDE[0] += 1
    try:
        yield
    finally:
        _INSIDE[0] -= 1


@gc_paused  # describe, simulate and summarize: one block, no full collection between them (simulator/gcpause.py)
def run(scenario: Scenario, budget: int | None = None, stop_on_oom: bool = False,
        graph: OpGraph | None = None, progress: Progress | None = None) -> Report:
    """Describe, simulate and summarize one scenario (device pool; the report is of the rank with the
    highest peak, and lists every simulated rank's peak). `graph`: the scenario already described with this
    budget (`op_graph`), for a caller that also exports it. `progress(i, n, what)` before each of the three
    stages (peakledger/progress.py; silent by default). Inside max-batch and explain (`reusing`), the caller's last
    report of an equal scenario is taken as it is (the same input: the same report)."""
    plain = budget is None and not stop_on_oom and graph is None
    if plain and _INSIDE[0] and _LAST and _LAST[0][0] == scenario:
        return _LAST[0][1]
    if not _INSIDE[0]:
        _LAST.clear()  # (the last report is not kept alive beside the next run's)
    report = _run(scenario, budget, stop_on_oom, graph, progress)
    if plain and not _INSIDE[0]:
        _LAST.append((scenario, report))
    return report


def _run(scenario: Scenario, budget: int | None, stop_on_oom: bool, graph: OpGraph | None,
         progress: Progress | None) -> Report:
    say = reporter(progress)
    if graph is None:
        say(0, 3, f"describing {scenario.name}")
        graph = op_graph(scenario, budget)
    ranks = [int(r) for r in graph.metadata.rank_classes]
    cuda = device_profile(scenario.device).is_cuda  # on a GPU the caching allocator decides the OOM
    capacities = {(r, Pool.DEVICE): budget for r in ranks} if budget is not None and not cuda else None
    say(1, 3, f"simulating {scenario.name}")
    log = simulate(graph, capacities, stop_on_oom=stop_on_oom, simulator=scenario.simulator)
    if budget is not None and cuda:
        log = with_gpu_oom(log, budget, stop_on_oom)
    say(2, 3, f"summarizing {scenario.name}")
    return summarize(log, name=scenario.name, headroom=scenario.headroom)


ALLOCATOR_SETTINGS = frozenset({"alloc_conf", "empty_cache_before_save"})  # read by the allocator replay alone


def rerun_allocator(base: Report, scenario: Scenario) -> Report:
    """`run(scenario)` where `scenario` differs from the one `base` reports (run without a budget) only in
    ALLOCATOR_SETTINGS: neither the description nor the simulation reads them (only the caching allocator's replay,
    from the log's metadata), so `base`'s events are summarized again under the new settings, not remade."""
    log = base.log
    log = EventLog(events=log.events, source=log.source, metadata=log.metadata.updated(**device_settings(scenario)),
                   ooms=log.ooms, op_names=log.op_names)
    return summarize(log, name=scenario.name, headroom=scenario.headroom)


def card_fit(report: Report, budget: int) -> CardFit:
    """The one verdict of the run against `budget` per rank (analysis/card_fit.py): the worst rank's capacity
    needed, or, on a GPU without headroom, the caching allocator serving it within the budget once it frees its
    cache and retries (torch's rule), with the figures of that bounded run."""
    return card_fit_of(report.log, budget, report.peaks.headroom, report.peaks.capacity_needed, report.gpu)


def fits(report: Report, budget: int) -> bool:
    """`card_fit(report, budget).fits`."""
    return card_fit(report, budget).fits


def fixed_state_peak(scenario: Scenario) -> int:
    """Highest bytes of parameters + master weights + gradients + optimizer states at any moment."""
    graph = describe(scenario.model, scenario.setup.replace(micro_batch=1), scenario.device,
                     torch_version=scenario.torch_version)
    log = simulate(graph)
    best = 0
    for rank in graph.metadata.rank_classes:
        running = 0
        for e in timeline(log, int(rank)).events:
            if e.block.category in STATE_CATEGORIES:
                running += e.delta
                best = max(best, running)
    return best


MAX_BATCH_LIMIT = 1 << 20  # the search stops here: an answer equal to it means "at least this many"


def max_micro_batch(scenario: Scenario, budget: int, limit: int = MAX_BATCH_LIMIT,
                    progress: Progress | None = None) -> int:
    """Largest micro-batch whose simulated peak x (1 + headroom) fits `budget`; 0 if only the fixed
    state fits, -1 if not even that; `limit` when the budget holds even that many (a lower bound). A module
    whose factory takes no `micro_batch` keyword has one batch: nothing to search, refused. The scenario's own
    micro-batch is probed first (analysis/maxbatch.py `max_fitting`'s `start`: where it fits, no smaller one is
    traced), then the sizes where the line through two probed peaks meets the budget (`guided`: the same answer,
    fewer sizes simulated and traced). The first size traced of a deep traced model records micro-batch 2, 3 and 4
    beside it (models/traced `micro_batch_points`), from which scale.py derives the other sizes probed. `progress(i,
    None, what)` before each probe (peakledger/progress.py; silent by default)."""
    say = reporter(progress)
    model = scenario.model
    if isinstance(model, TracedModel) and model.kind == "module" and "micro_batch" not in model.varies:
        raise ConfigError("module", f"max-batch varies the micro-batch, and {model.source.rpartition(':')[2]}() takes "
                                    "no micro_batch keyword (its batch is fixed): add `micro_batch: int = N` to its "
                                    "signature and build the batch from it")
    cache: dict[int, int] = {}

    def need(b: int) -> int:
        if b not in cache:
            say(len(cache), None, f"probing micro-batch {b}")
            if b == 0:
                peak = fixed_state_peak(scenario)
                cache[b] = with_headroom(peak, scenario.headroom)  # a lower bound: tensors only
            else:
                report = run(dataclasses.replace(scenario, setup=scenario.setup.replace(micro_batch=b)))
                cache[b] = report.capacity_needed
                if cache[b] > budget and fits(report, budget):
                    cache[b] = budget  # the allocator's retry makes it fit

        return cache[b]

    with micro_batch_points(True), reusing():  # the first size traced records sizes 2-4 beside it: the others derived
        return max_fitting(need, budget, limit, start=scenario.setup.batch.micro_batch, guided=True)


def batch_range(*, fixed, per_sample, budget) -> BatchRange:
    """The micro-batches B that fit the abstract memory model fixed + per_sample x B <= budget (`peakledger
    max-batch --fixed --per-sample --budget`): exact ints, or strings as the flags take them ("100", "80GiB"; all
    with a unit or none), searched by `max_micro_batch`'s own search (analysis/maxbatch.py). `.max_batch` is the
    largest (0: only the fixed part fits, -1: not even it), `.feasible_range` (1, max) or None. Bad values raise
    ConfigError naming the flag."""
    return solve(fixed, per_sample, budget)[0]


def hf_config_of(model) -> tuple[dict | None, str]:
    """(the transformers config.json a model is, where it comes from): a traced HF model's own; a hand-written
    transformer's HF equivalent (models/families' `hf_equivalent`); else (None, why there is none)."""
    if isinstance(model, TracedModel):
        return (model.hf_dict(), "its config.json") if model.kind == "hf" else \
            (None, "a --module model has no transformers config")
    equivalent = family_of(model).hf_equivalent
    if equivalent is None:
        return None, f"{family_of(model).kind} has no transformers config"
    try:
        return equivalent(model), f"{model.name}'s HF equivalent (models/transformer/hf_config.py)"
    except ConfigError as e:
        return None, e.message


def peers(scenario: Scenario) -> list[dict]:
    """The scenario under DeepSpeed ZeRO stages 0-3 on its world size: peakledger's model states and peak
    per rank (the worst rank) next to the ZeRO paper's formula and DeepSpeed's estimators (its own functions when
    deepspeed imports, `deepspeed_source` says which), and at ZeRO-0 (no sharding: every rank trains the whole
    model) `accelerate estimate-memory`'s "Training using Adam" (its own functions on the model's transformers
    config when accelerate imports, `accelerate_source` says which). A stage whose peak is above the previous
    stage's carries `above_previous`: both peak moments and what each holds differently there, by category and
    block."""
    tape = build_tape(scenario.model, scenario.setup)
    psi = tape.n_params
    largest = largest_layer_params({p.name: p.shape for p in tape.params})
    n = scenario.setup.mesh.world_size
    ds = deepspeed_estimators()
    hf, where = hf_config_of(scenario.model)
    acc = accelerate_estimate(hf, psi, scenario.setup.precision, **({"config_from": where} if hf else {"no_hf": where}))
    rows, reports = [], []
    for stage in range(4):
        case = scenario.with_changes(dp_engine="deepspeed", zero_stage=stage)
        report = run(case)
        states = max(model_state_peak(report.log, rp.rank) for rp in report.ranks)
        deepspeed = {2: lambda: ds.zero2(psi, n), 3: lambda: ds.zero3(psi, largest, n)}.get(stage, lambda: None)()
        rows.append({"stage": stage, "world_size": n, "n_params": psi, "model_states": states,
                     "peak": report.peaks.overall.bytes, "zero_paper": round(zero_paper_model_states(psi, n, stage)),
                     "deepspeed_estimate": deepspeed, "deepspeed_source": ds.source,
                     "deepspeed_version": ds.version, "deepspeed_own": ds.own, "largest_layer_params": largest,
                     "accelerate_estimate": acc["estimate"] if stage == 0 else None,
                     "accelerate_source": acc["source"], "accelerate_version": acc["version"],
                     "accelerate_own": acc["own"]} | ({"accelerate_detail": acc["detail"]} if stage == 0 else {}))
        reports.append(report)
    for prev, (row, report) in zip(reports, list(zip(rows, reports))[1:]):
        if report.peaks.overall.bytes > prev.peaks.overall.bytes and report.peaks.overall.event is not None:
            at = [r.timeline.live_allocs_at(r.peaks.overall.index) for r in (report, prev)]
            row["above_previous"] = {
                "moment": peak_moment(report.peaks.overall.event, report.peaks.rank),
                "other_moment": peak_moment(prev.peaks.overall.event, prev.peaks.rank),
                "categories": peak_difference(*at)}
    return rows


def parallel_peers(scenario: Scenario) -> list[dict]:
    """Model parallelism (tp / pp / cp / ep): Megatron's theoretical memory and llm-analysis's formulas
    (analysis/peers_parallel.py) beside peakledger's simulation of the same layout, its worst rank first; where
    peakledger does not simulate the layout yet, its row says why instead of a number."""
    s = scenario.setup
    rows = formulas(
        scenario.model,
        s,
        tp=s.mesh.tp,
        pp=s.mesh.pp,
        cp=s.mesh.cp,
        sequence_parallel=s.mesh.sequence_parallel,
        virtual_stages=s.mesh.virtual_stages,
        pp_schedule=s.mesh.pp_schedule,
        ep=s.mesh.ep,
        device=scenario.device,
    )
    try:
        report = run(scenario)
    except ConfigError as e:
        return [{"source": "peakledger", "why": [f"not simulated: {e}"]}] + rows
    ours = {
        "source": "peakledger",
        "peak": report.peaks.overall.bytes,
        "model_states": max(model_state_peak(report.log, rp.rank) for rp in report.ranks),
        "activations": sum(r.bytes for r in report.ledger if r.category is Category.ACTIVATION),
        "why": [
            f"simulated: rank {report.peaks.rank}'s peak (the worst of {len(report.ranks)} rank classes) at "
            f"{report.peaks.overall.event.op if report.peaks.overall.event else '-'}, the schedule run op by op; "
            "activations: the worst rank's saved activations at its peak; temporaries and buffers are in the "
            "peak too"
        ],
    }
    return [ours] + rows


def _step_time(report: Report) -> float:
    return report.time_per_step_s


def _rows_beside(eager: list, compiled: list) -> list[dict]:
    rows = {r.row: r.bytes for r in eager}
    ours = {r.row: r.bytes for r in compiled}
    names = list(rows) + [n for n in ours if n not in rows]
    return [{"row": n, "eager": rows.get(n, 0), "compiled": ours.get(n, 0), "saved": rows.get(n, 0) - ours.get(n, 0)}
            for n in names]


def _training_peak(report: Report):
    """The highest forward or backward phase peak of the report (what compile changes), or None."""
    phases = [p for p in report.phases if p.phase in (Phase.FORWARD, Phase.BACKWARD)]
    return max(phases, key=lambda p: p.allocated, default=None)


def compile_savings(scenario: Scenario, compiled: Report) -> dict:
    """What torch.compile saves against eager: the same scenario simulated uncompiled, beside the compiled run
    (bytes; saved = eager - compiled): the peaks and each ledger row at each run's peak; each phase's peak; and the
    ledger rows at each run's forward + backward peak (where compile acts: a run whose peak is its optimizer step
    peaks the same compiled or not)."""
    eager = run(scenario.with_changes(compile=False))
    phases = {(p.step, p.phase): p for p in eager.phases}
    by_phase = [{"phase": p.label, "eager": phases[(p.step, p.phase)].allocated, "compiled": p.allocated,
                 "saved": phases[(p.step, p.phase)].allocated - p.allocated}
                for p in compiled.phases if (p.step, p.phase) in phases]
    at = {}
    for name, report in (("eager", eager), ("compiled", compiled)):
        peak = _training_peak(report)
        at[name] = (peak, ledger_at(report.timeline, peak.index) if peak is not None and peak.index >= 0 else [])
    (e_peak, e_rows), (c_peak, c_rows) = at["eager"], at["compiled"]
    return {"eager_peak": eager.peaks.overall.bytes, "compiled_peak": compiled.peaks.overall.bytes,
            "saved": eager.peaks.overall.bytes - compiled.peaks.overall.bytes,
            "by_row_at_peak": _rows_beside(eager.ledger, compiled.ledger),
            "by_phase": by_phase,
            "forward_backward_peak": {"eager": e_peak.allocated if e_peak else 0,
                                      "compiled": c_peak.allocated if c_peak else 0,
                                      "eager_at": e_peak.label if e_peak else None,
                                      "compiled_at": c_peak.label if c_peak else None,
                                      "by_row": _rows_beside(e_rows, c_rows)}}
