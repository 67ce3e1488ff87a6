"""The public API: simulate a scenario, find the largest micro-batch, compare scenarios, explain an OOM with
its fixes. Real runs held against the simulation are validation.py."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .analysis.device import device_settings, first_gpu_oom, gpu_fits, with_gpu_oom
from .analysis.explain import Moment, from_record, reserved_moment, worst_moment
from .analysis.maxbatch import max_fitting
from .analysis.peaks import with_headroom
from .analysis.peers import (
    deepspeed_zero2_estimate,
    deepspeed_zero3_estimate,
    largest_layer_params,
    model_state_peak,
    zero_paper_model_states,
)
from .analysis.peers_parallel import parallel_peers as formulas
from .analysis.report import Report, summarize
from .models.config import CHECKPOINTING, ConfigError, TransformerConfig
from .models.costs import device_profile
from .models.trace import from_hf_dict, traced_layers
from .models.trace.model import TracedModel
from .models.training import build_tape, describe
from .scenario import Scenario, _traced_scenario, build_scenario
from .simulator.allocator import round_size
from .simulator.device_memory import DeviceMemory, DeviceOOM
from .simulator.engine import simulate
from .simulator.events import Category, Pool
from .simulator.ops import OpGraph
from .simulator.timeline import timeline

STATE_CATEGORIES = (Category.PARAMETER, Category.MASTER_PARAMETER, Category.GRADIENT, Category.OPTIMIZER_STATE)


def trace(hf_config=None, *, module: str | None = None, name: str | None = None, device: str = "H100-80GB",
          describer: str = "traced", **training) -> Scenario:
    """A scenario for a model peakledger traces (models/trace): `hf_config` a config.json path or a dict of
    one, or `module` "path/to/file.py:factory" (factory() -> (model, batch, loss_fn)); `training` holds
    TrainingSetup fields (micro_batch, seq_len, precision, optimizer, checkpointing, ...). The result goes
    to `run`, `explain`, `max_micro_batch` and analysis.checkpointing like any scenario; the trace itself
    runs at the first of those (then cached per shape)."""
    if (hf_config is None) == (module is None):
        raise ConfigError("hf_config", "give exactly one of hf_config (a config.json path or dict) and module")
    if isinstance(hf_config, dict):
        model = from_hf_dict(hf_config, name or str(hf_config.get("model_type", "hf")))
        return _traced_scenario(model, {}, training, {"device": device}, name, None)
    table = {"hf_config": str(hf_config)} if hf_config is not None else {"module": module}
    return build_scenario({**table, "describer": describer}, training, {"device": device}, name=name)


def op_graph(scenario: Scenario, budget: int | None = None) -> OpGraph:
    """The scenario described: the op graph the simulator runs (simulator/graph_nx.py gives its networkx form)."""
    graph = describe(scenario.model, scenario.setup, scenario.device, torch_version=scenario.torch_version)
    graph.metadata.update(device_settings(scenario), device_capacity=budget)
    return graph


def run(scenario: Scenario, budget: int | None = None, stop_on_oom: bool = False,
        graph: OpGraph | None = None) -> Report:
    """Describe, simulate and summarize one scenario (device pool; the report is of the rank with the
    highest peak, and lists every simulated rank's peak). `graph`: the scenario already described with this
    budget (`op_graph`), for a caller that also exports it."""
    graph = graph if graph is not None else op_graph(scenario, budget)
    ranks = [int(r) for r in graph.metadata["rank_classes"]]
    cuda = device_profile(scenario.device).is_cuda  # on a GPU the caching allocator decides the OOM
    capacities = {(r, Pool.DEVICE): budget for r in ranks} if budget is not None and not cuda else None
    log = simulate(graph, capacities, stop_on_oom=stop_on_oom, simulator=scenario.simulator)
    if budget is not None and cuda:
        log = with_gpu_oom(log, budget, stop_on_oom)
    return summarize(log, name=scenario.name, headroom=scenario.headroom)


def fits(report: Report, budget: int) -> bool:
    """The run fits `budget` per rank: its capacity needed does; or, on a GPU without headroom, the caching
    allocator serves it within the budget once it frees its cache and retries (torch's rule)."""
    if report.capacity_needed <= budget:
        return True
    return report.gpu is not None and not report.peaks.headroom and gpu_fits(report.log, budget)


def fixed_state_peak(scenario: Scenario) -> int:
    """Highest bytes of parameters + master weights + gradients + optimizer states at any moment."""
    graph = describe(scenario.model, dataclasses.replace(scenario.setup, micro_batch=1), scenario.device,
                     torch_version=scenario.torch_version)
    log = simulate(graph)
    best = 0
    for rank in graph.metadata["rank_classes"]:
        running = 0
        for e in timeline(log, int(rank)).events:
            if e.block.category in STATE_CATEGORIES:
                running += e.delta
                best = max(best, running)
    return best


MAX_BATCH_LIMIT = 1 << 20  # the search stops here: an answer equal to it means "at least this many"


def max_micro_batch(scenario: Scenario, budget: int, limit: int = MAX_BATCH_LIMIT) -> int:
    """Largest micro-batch whose simulated peak x (1 + headroom) fits `budget`; 0 if only the fixed
    state fits, -1 if not even that; `limit` when the budget holds even that many (a lower bound). A module
    whose factory takes no `micro_batch` keyword has one batch: nothing to search, refused."""
    model = scenario.model
    if isinstance(model, TracedModel) and model.kind == "module" and "micro_batch" not in model.varies:
        raise ConfigError("module", f"max-batch varies the micro-batch, and {model.source.rpartition(':')[2]}() takes "
                                    "no micro_batch keyword (its batch is fixed): add `micro_batch: int = N` to its "
                                    "signature and build the batch from it")
    cache: dict[int, int] = {}

    def need(b: int) -> int:
        if b not in cache:
            if b == 0:
                peak = fixed_state_peak(scenario)
                cache[b] = with_headroom(peak, scenario.headroom)  # a lower bound: tensors only
            else:
                report = run(dataclasses.replace(scenario, setup=dataclasses.replace(scenario.setup, micro_batch=b)))
                cache[b] = report.capacity_needed
                if cache[b] > budget and fits(report, budget):
                    cache[b] = budget  # the allocator's retry makes it fit

        return cache[b]

    return max_fitting(need, budget, limit)


def peers(scenario: Scenario) -> list[dict]:
    """The scenario under DeepSpeed ZeRO stages 0-3 on its world size: peakledger's model states and peak
    per rank (the worst rank) next to the ZeRO paper's formula and DeepSpeed's own estimators."""
    tape = build_tape(scenario.model, scenario.setup)
    psi = tape.n_params
    largest = largest_layer_params({p.name: p.shape for p in tape.params})
    n = scenario.setup.world_size
    rows = []
    for stage in range(4):
        case = scenario.with_changes(dp_engine="deepspeed", zero_stage=stage)
        report = run(case)
        states = max(model_state_peak(report.log, rp.rank) for rp in report.ranks)
        deepspeed = {2: deepspeed_zero2_estimate(psi, n), 3: deepspeed_zero3_estimate(psi, largest, n)}.get(stage)
        rows.append({"stage": stage, "world_size": n, "n_params": psi, "model_states": states,
                     "peak": report.peaks.peak.bytes, "zero_paper": round(zero_paper_model_states(psi, n, stage)),
                     "deepspeed_estimate": deepspeed, "largest_layer_params": largest})
    return rows


def parallel_peers(scenario: Scenario) -> list[dict]:
    """Model parallelism (tp / pp / cp / ep): Megatron's theoretical memory and llm-analysis's formulas
    (analysis/peers_parallel.py) beside peakledger's simulation of the same layout, its worst rank first; where
    peakledger does not simulate the layout yet, its row says why instead of a number."""
    s = scenario.setup
    rows = formulas(scenario.model, s, tp=s.tp, pp=s.pp, cp=s.cp, sequence_parallel=s.sequence_parallel,
                    virtual_stages=s.virtual_stages, pp_schedule=s.pp_schedule, ep=s.ep)
    try:
        report = run(scenario)
    except ConfigError as e:
        return [{"source": "peakledger", "why": [f"not simulated: {e}"]}] + rows
    ours = {"source": "peakledger", "peak": report.peaks.peak.bytes,
            "model_states": max(model_state_peak(report.log, rp.rank) for rp in report.ranks),
            "activations": sum(r.bytes for r in report.ledger if r.category is Category.ACTIVATION),
            "why": [f"simulated: rank {report.peaks.rank}'s peak (the worst of {len(report.ranks)} rank classes) at "
                    f"{report.peaks.peak.event.op if report.peaks.peak.event else '-'}, the schedule run op by op; "
                    "activations: the worst rank's saved activations at its peak; temporaries and buffers are in the "
                    "peak too"]}
    return [ours] + rows


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


def allocator_fixes(scenario: Scenario) -> list[tuple[str, dict, bool, str]]:
    """The caching allocator's own fixes for fragmentation (simulator/allocator.py), each a run setting."""
    conf = scenario.alloc_conf
    settings = dict(item.split(":", 1) for item in conf.split(",") if ":" in item)
    merged = lambda **kw: ",".join(f"{k}:{v}" for k, v in {**settings, **kw}.items())  # noqa: E731
    out = []
    if settings.get("expandable_segments") != "True":
        out.append(("allocator: expandable_segments:True", {"alloc_conf": merged(expandable_segments="True")}, False,
                    "none: segments grow page by page instead of leaving gaps between cached segments"))
    if "max_split_size_mb" not in settings and settings.get("expandable_segments") != "True":
        out.append(("allocator: max_split_size_mb:128", {"alloc_conf": merged(max_split_size_mb="128")}, False,
                    "none: blocks of 128 MiB and more are never split, so large requests find whole blocks"))
    if scenario.setup.checkpoint_every and not scenario.empty_cache_before_save:
        out.append(("torch.cuda.empty_cache() before each save", {"empty_cache_before_save": True}, False,
                    "the cache is rebuilt after the save (cudaMalloc calls, a short stall)"))
    return out


def model_parallel_fixes(scenario: Scenario) -> list[tuple[str, dict, bool, str]]:
    """Pipeline schedules that hold fewer micro-batches in flight on the same GPUs, and more tensor-, context- or
    pipeline-parallel ranks, which say that they take more GPUs (models/parallel/)."""
    s = scenario.setup
    out: list[tuple[str, dict, bool, str]] = []
    if s.pp > 1 and s.pp_schedule == "gpipe" and s.grad_accum >= s.pp:
        out.append(("pipeline schedule gpipe -> 1f1b", {"pp_schedule": "1f1b"}, False,
                    "same GPUs: at most pp micro-batches in flight on the first stage instead of all of them"))
    if s.tp > 1 or (s.pp == 1 and s.world_size == 1 and isinstance(scenario.model, TransformerConfig)):
        tp = s.tp * 2
        out.append((f"tp {s.tp} -> {tp} ({s.world_size} -> {s.world_size * 2} GPUs)",
                    {"tp": tp, "world_size": s.world_size * 2}, False,
                    f"twice the GPUs: each holds 1/{tp} of the weights and of the activations between linears"))
    if s.cp > 1 or (s.world_size == 1 and isinstance(scenario.model, TransformerConfig) and s.seq_len % 4 == 0):
        cp = s.cp * 2  # skipped (a ConfigError) where context parallelism is not simulated for the scenario
        out.append((f"cp {s.cp} -> {cp} ({s.world_size} -> {s.world_size * 2} GPUs)",
                    {"cp": cp, "world_size": s.world_size * 2}, False,
                    f"twice the GPUs: each holds 1/{cp} of the sequence's activations (ring attention)"))
    if s.pp > 1:
        out.append((f"pp {s.pp} -> {2 * s.pp} ({s.world_size} -> {s.world_size * 2} GPUs)",
                    {"pp": 2 * s.pp, "world_size": s.world_size * 2, "grad_accum": max(s.grad_accum, 2 * s.pp)},
                    False, "twice the GPUs: each stage holds half as many layers"))
    return out


def candidate_fixes(scenario: Scenario, fragmentation: bool = False) -> list[tuple[str, dict, bool, str]]:
    """(name, setup changes, changes the training?, what it costs) for every fix worth re-simulating; with
    `fragmentation` (the allocator's cached free blocks cause the OOM) the allocator's fixes first."""
    s, model = scenario.setup, scenario.model
    out: list[tuple[str, dict, bool, str]] = allocator_fixes(scenario) if fragmentation else []
    if s.world_size > 1 and s.dp_engine == "deepspeed":
        for stage in range(s.zero_stage + 1, 4):
            out.append((f"ZeRO-{stage}", {"zero_stage": stage}, False,
                        "more communication: " + {1: "none extra", 2: "gradients reduce-scattered",
                                                  3: "parameters all-gathered per module"}[stage]))
    if s.world_size > 1 and s.dp_engine in ("ddp", "zero-redundancy-optimizer"):
        out.append(("FSDP2", {"dp_engine": "fsdp2"}, False, "parameters all-gathered per block"))
    traced = isinstance(model, TracedModel)
    for policy in CHECKPOINTING:
        if policy not in (s.checkpointing, "none", "layers") and not (traced and policy == "selective"):
            # "layers" needs a set (`peakledger checkpointing`); "selective" names transformer-block parts
            cost = ("saved activations copied to the host and back over the host link" if policy == "offload"
                    else "recompute in backward")
            out.append((f"checkpointing={policy}", {"checkpointing": policy}, False, cost))
    mb = s.micro_batch if not traced or "micro_batch" in model.varies else 1  # a fixed factory batch
    for d in sorted((d for d in range(1, mb) if mb % d == 0), reverse=True):
        out.append((f"micro-batch {mb} -> {d}, accumulation {s.grad_accum} -> {s.grad_accum * mb // d}",
                    {"micro_batch": d, "grad_accum": s.grad_accum * mb // d}, False,
                    "same B_eff, more and smaller steps (lower arithmetic intensity)"))
    if (isinstance(model, TransformerConfig) or traced and "seq_len" in model.varies and model.batch_note(s)
            .startswith("input_ids")) and s.seq_len > 1:
        out.append((f"seq_len {s.seq_len} -> {s.seq_len // 2}", {"seq_len": s.seq_len // 2}, True,
                    "shorter context: changes what the model learns"))
    if s.optimizer in ("adam", "adamw"):
        out.append(("8-bit Adam (bitsandbytes)", {"optimizer": "adam-8bit"}, True, "quantised optimizer states"))
    if s.optimizer_impl != "fused" and s.optimizer != "adam-8bit":
        out.append(("fused optimizer", {"optimizer_impl": "fused"}, False, "none: no step temporaries"))
    chunked = {"optimizer_offload": "chunked", "offload_first_step": "chunked"}
    copies = "optimizer states copied to the device and back every step, over the host link"
    if s.optimizer_offload == "none":
        out.append(("optimizer-state offload, chunked", chunked, False, copies))
        out.append(("optimizer-state offload", {"optimizer_offload": "states"}, False, copies))
    elif s.optimizer_offload == "states":
        out.append(("optimizer-state offload in chunks", chunked, False, copies + ", chunk by chunk"))
    elif s.offload_first_step == "whole":
        out.append(("first step chunk by chunk (offload_first_step=chunked)", {"offload_first_step": "chunked"}, False,
                    "none: the first step creates and offloads the states chunk by chunk"))
    if s.precision == "fp32":
        out.append(("bf16 mixed precision", {"precision": "bf16-mixed"}, True, "16-bit compute and gradients"))
    out += model_parallel_fixes(scenario)
    if traced and s.checkpointing == "none":
        layers = traced_layers(model, s)
        if len(layers) > 1:
            half = layers[:len(layers) // 2]
            out.append((f"freeze {half[0]} .. {half[-1]}", {"frozen": tuple(f"{name}.*" for name in half)}, True,
                        "fine-tunes the upper half only"))
    if isinstance(model, TransformerConfig) and model.n_layer > 1:
        prefix = "transformer.h" if model.family == "gpt2" else "model.layers"
        half = model.n_layer // 2
        out.append((f"freeze layers 0-{half - 1}", {"frozen": tuple(f"{prefix}.{i}.*" for i in range(half))}, True,
                    "fine-tunes the upper half only"))
    return out


def explain(scenario: Scenario, budget: int, host_budget: int | None = None) -> Explanation:
    """Why `scenario` does not fit `budget` (or how close it is), with every candidate fix re-simulated
    and ranked: fixes that fit first, those that keep the training unchanged before those that change
    it, then by simulated step time; fixes that do not fit after, by peak."""
    base = run(scenario)
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
    base_time = _step_time(base)
    candidates, fixes = [], []
    for candidate in candidate_fixes(scenario, fragmentation):
        try:
            fix = _fix(scenario, budget, *candidate)
        except ConfigError:
            continue  # not applicable to this model / setup (a policy the model has no layers for, ...)
        candidates.append(candidate)
        fixes.append(fix)
    if fixes and not any(f.fits for f in fixes):
        combined = _combine(scenario, budget, candidates, fixes)
        if combined is not None:
            fixes.append(combined)
    fixes.sort(key=lambda f: (0, f.more_gpus, f.changes_training, f.step_time) if f.fits
               else (1, f.capacity_needed, f.changes_training))  # on the same GPUs before more GPUs
    return Explanation(scenario=scenario.name, budget=budget, host_budget=host_budget, moment=moment,
                       host_moment=host, peak=base.peaks.peak.bytes, capacity_needed=base.capacity_needed,
                       step_time=base_time, fixes=fixes, gpu=found[0] if found else base.gpu, gpu_oom=gpu_oom,
                       fragmentation=fragmentation)


def _fix(scenario: Scenario, budget: int, name: str, changes: dict, changes_training: bool, note: str) -> Fix:
    report = run(scenario.with_changes(**changes))
    return Fix(name=name, changes=changes, peak=report.peaks.peak.bytes, capacity_needed=report.capacity_needed,
               fits=fits(report, budget), step_time=_step_time(report), changes_training=changes_training, note=note,
               more_gpus=changes.get("world_size", scenario.setup.world_size) > scenario.setup.world_size)


def _combine(scenario: Scenario, budget: int, candidates, singles: list[Fix], rounds: int = 4) -> Fix | None:
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
                                   any(f.changes_training for f in chosen) or ct, "; ".join([best.note, note])))
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


def _step_time(report: Report) -> float:
    return report.time_per_step_s
