"""The `peakledger` command.

    peakledger simulate [--preset gpt2 | --hf-config config.json | --scenario file.toml] [flags] [--json] [--plot F]
    peakledger max-batch --budget 80GiB [same model/training flags]
    peakledger compare [--case "name: key=value key=value" ...] [same flags for the base scenario]
    peakledger explain | replay | calibrate ...   (cmd_explain.py, cmd_calibrate.py; shared flags: cli_common.py)

Bad input exits 2 with one line naming the field and the allowed values.
"""

from __future__ import annotations

import argparse
import dataclasses
import signal
import sys
import threading
import traceback

from . import (
    api,
    inputs,  # its host limit by attribute: a test gives another
    sweep,
    validation,
)
from .analysis.checkpointing import (
    optimal_checkpointing,
    plot_peak_vs_recompute,
    policy_table,
    render_optimal,
    render_table,
)
from .analysis.device import device_settings, gpu_memory
from .analysis.export import write_chrome_trace, write_snapshot
from .analysis.ledger import ROW_ORDER
from .analysis.peers import PEER_NOTES, render_peers
from .analysis.peers_parallel import PARALLEL_PEER_NOTES, render_parallel_peers
from .analysis.plot import plot_overlay, plot_timeline
from .analysis.report import render_text, report_json
from .analysis.units import format_bytes
from .analysis.validate import PeakPair, compare_logs, render_validation, validation_json
from .cli_common import _add_scenario_flags, _budget, _parse_case, _write_json
from .cmd_calibrate import register as register_calibrate
from .cmd_explain import cmd_explain, cmd_replay
from .inputs import (
    VALIDATE_DEFAULTS,
    check_command_outputs,
    check_common,
    check_real_run,
    host_need,
    real_run_scenario,
    scenario_for_trace,
    scenario_from_args,
)
from .models.config import ConfigError
from .models.costs import DEVICES, device_profile
from .models.trace.boundary import time_limit
from .models.training import StepPlan, describe
from .simulator.allocator import AllocatorConfig
from .simulator.engine import simulate
from .simulator.files import InputError, digits_message, too_many_digits
from .simulator.graph_nx import CriticalPath, critical_path, write_graphml
from .simulator.timeline import timeline
from .traces import cuda_capture  # its GPU probe and capture by attribute: a test stands in for them
from .traces.cuda_capture import allocator_rules, check_capturable, is_cuda_trace
from .traces.store import load_trace, save_log, with_event_index_times

DEFAULT_CASES = ["fp32-sgd: precision=fp32 optimizer=sgd",
                 "bf16-adamw: precision=bf16-mixed optimizer=adamw",
                 "zero2-x8: precision=bf16-mixed optimizer=adamw zero_stage=2 world_size=8"]


def critical_path_json(path: CriticalPath) -> dict:
    return {"ops": len(path.ops), "seconds": path.seconds, "seconds_by_stream": path.by_stream(),
            "first": path.ops[0].name if path.ops else None, "last": path.ops[-1].name if path.ops else None}


def critical_path_text(path: CriticalPath) -> str:
    """One line: how long the critical path is, and which streams it runs on."""
    parts = ", ".join(f"{stream} {s / path.seconds:.1%}" for stream, s in sorted(path.by_stream().items(),
                                                                                 key=lambda kv: -kv[1]))
    return (f"critical path: {len(path.ops):,} ops, {path.seconds:.6g} s (the simulated run's length; {parts}), "
            f"from {path.ops[0].name} to {path.ops[-1].name}" if path.ops else "critical path: no ops")


def cmd_simulate(args) -> int:
    check_command_outputs(args, ["plot", "export_snapshot", "export_chrome", "export_graph"])
    budget = _budget(args)
    if args.stop_at_oom and budget is None:
        raise ConfigError("stop_at_oom", "needs --budget: the OOM it stops at is an allocation over the budget")
    scenario = scenario_from_args(args)
    report = api.run(scenario, budget=budget, stop_on_oom=args.stop_at_oom)
    if args.plot:
        gpu = gpu_memory(report.log, report.peaks.rank, series=True) if report.gpu is not None else None
        plot_timeline(timeline(report.log, report.peaks.rank), args.plot, unit=args.unit,
                      title=f"{scenario.name}: allocated by category" + (" and reserved" if gpu else ""),
                      reserved=gpu.series if gpu else None)
    if args.export_snapshot:
        write_snapshot(report.log, args.export_snapshot)
    if args.export_chrome:
        write_chrome_trace(report.log, args.export_chrome)
    path = None
    if args.export_graph:
        graph = api.op_graph(scenario, budget)
        write_graphml(graph, args.export_graph)
        path = critical_path(graph)
    written = [x for x in (args.plot, args.export_snapshot, args.export_chrome, args.export_graph) if x]
    repeats = StepPlan.of(report.log.metadata).summary()
    if args.json:
        _write_json({**report_json(report), **({"critical_path": critical_path_json(path)} if path else {})})
    else:
        print(render_text(report, args.unit))
        if path:
            print(critical_path_text(path))
        if written:
            print(f"written: {', '.join(written)}"
                  + (f" (they show the simulated steps: {repeats})" if repeats else ""))
    return 0


def cmd_max_batch(args) -> int:
    budget = _budget(args)
    scenario = scenario_from_args(args)
    best = api.max_micro_batch(scenario, budget)
    fixed = api.fixed_state_peak(scenario)
    capped = best >= api.MAX_BATCH_LIMIT
    result = {"budget": budget, "max_micro_batch": best, "fixed_state_bytes": fixed,
              "headroom": scenario.headroom, "scenario": scenario.name, "search_limit_reached": capped}
    if best > 0:
        at = api.run(dataclasses.replace(scenario, setup=dataclasses.replace(scenario.setup, micro_batch=best)))
        result["peak_at_max"] = at.peaks.peak.bytes
        result["effective_batch_at_max"] = best * scenario.setup.grad_accum * scenario.setup.dp
    if args.json:
        _write_json(result)
        return 0
    u = args.unit
    print(f"{scenario.name}: budget {format_bytes(budget, u)}, fixed state {format_bytes(fixed, u)}")
    if best < 0:
        print("max micro-batch: -1 (even parameters, gradients and optimizer states do not fit)")
    elif best == 0:
        print("max micro-batch: 0 (the fixed state fits, but not one sample of activations)")
    elif capped:
        print(f"max micro-batch: at least {best:,} (the search stops at {api.MAX_BATCH_LIMIT:,}; the budget holds "
              f"more: peak there {format_bytes(result['peak_at_max'], u)})")
    else:
        print(f"max micro-batch: {best} (peak {format_bytes(result['peak_at_max'], u)}; B_eff "
              f"{result['effective_batch_at_max']} with accumulation {scenario.setup.grad_accum})")
    return 0


def cmd_peers(args, base) -> int:
    s = base.setup
    if s.tp * s.pp * s.cp * s.ep > 1:  # model parallelism: Megatron's and llm-analysis's formulas
        rows = api.parallel_peers(base)
        if args.json:
            _write_json({"scenario": base.name, "peers": rows, "notes": PARALLEL_PEER_NOTES})
            return 0
        print(render_parallel_peers(rows, args.unit, base.name))
        return 0
    rows = api.peers(base)
    if args.json:
        _write_json({"scenario": base.name, "peers": rows, "notes": PEER_NOTES})
        return 0
    print(render_peers(base.name, rows, args.unit))
    return 0


def cmd_compare(args) -> int:
    base = scenario_from_args(args)
    if args.peers and args.case:
        raise ConfigError("case", "--peers compares DeepSpeed's ZeRO stages of the base scenario; --case does not "
                                  "apply with it: drop one")
    if args.peers:
        return cmd_peers(args, base)
    cases = [_parse_case(c) for c in (args.case or DEFAULT_CASES)]
    results = []
    for name, changes in cases:
        scenario = base.with_changes(name=name, **changes)
        results.append((name, api.run(scenario)))
    if args.json:
        _write_json({"cases": [report_json(r) for _, r in results]})
        return 0
    u = args.unit
    rows = ["peak", "first-step peak", "steady peak"]
    all_rows = sorted({row.row: row.category for _, r in results for row in r.ledger}.items(),
                      key=lambda item: (ROW_ORDER.index(item[1]), item[0]))
    width = max(14, *(len(n) + 2 for n, _ in results))
    print(f"{'':<30}" + "".join(f"{n:>{width}}" for n, _ in results))
    for label in rows:
        vals = []
        for _, r in results:
            p = {"peak": r.peaks.peak, "first-step peak": r.peaks.first_step, "steady peak": r.peaks.steady}[label]
            vals.append(format_bytes(p.bytes, u) if p else "-")
        print(f"{label:<30}" + "".join(f"{v:>{width}}" for v in vals))
    print("at the peak:")
    for row_name, _ in all_rows:
        vals = []
        for _, r in results:
            match = [x for x in r.ledger if x.row == row_name]
            vals.append(format_bytes(match[0].bytes, u) if match else "-")
        print(f"  {row_name:<28}" + "".join(f"{v:>{width}}" for v in vals))
    print("peak reached at:")
    for name, r in results:
        e = r.peaks.peak.event
        print(f"  {name}: {e.op} ({e.phase.value}, step {e.step})")
    return 0


def cmd_sweep(args) -> int:
    if args.output is None and args.json_output is None:
        raise ConfigError("output", "give --output FILE.csv and/or --json-output FILE.json")
    check_command_outputs(args, ["output", "json_output"])
    base = scenario_from_args(args)
    grid = sweep.parse_grid(args.grid or [])
    budget = _budget(args)
    result = sweep.run_sweep(base, grid, budget=budget, max_batch=args.max_batch, jobs=args.jobs,
                             engine=args.engine, address=args.address)
    sweep.write(result, base, grid, args.output, args.json_output)
    failed = sum(1 for p in result if p.result["error"])
    written = " and ".join(x for x in (args.output, args.json_output) if x)
    print(f"{len(result)} points simulated ({failed} invalid, each with its error) into {written}")
    return 0


def cmd_checkpointing(args) -> int:
    check_command_outputs(args, ["plot"])
    budget = _budget(args)
    scenario = scenario_from_args(args)
    rows = policy_table(scenario)
    best = optimal_checkpointing(scenario, budget) if budget is not None else None
    if args.plot:
        plot_peak_vs_recompute(rows, args.plot, title=f"{scenario.name}: peak vs recompute", unit=args.unit)
    if args.json:
        _write_json({"scenario": scenario.name, "policies": [r.as_json() for r in rows],
                     "optimal": best.as_json() if best else None})
        return 0
    print(render_table(rows, args.unit))
    if best is not None:
        print("")
        print(render_optimal(best, args.unit))
    if args.plot:
        print(f"plot written to {args.plot}")
    return 0


def cmd_capture(args) -> int:
    if args.wall_times and args.device_kind == "cuda":
        raise ConfigError("wall_times", "applies to CPU captures; a CUDA snapshot keeps the allocator's own times")
    check_command_outputs(args, ["output", "moe_counts"])
    scenario = real_run_scenario(args)
    if args.device_kind == "cuda":
        return _capture_cuda(args, scenario)
    check_real_run(args, scenario)
    recorder = _moe_recorder(args, scenario)
    log = validation.measure(scenario, model_hook=recorder.attach if recorder else None)
    save_log(log if args.wall_times else with_event_index_times(log), args.output)
    peak = max(timeline(log).total, default=0)
    print(f"captured {len(log.events):,} events of {scenario.name} (peak {int(peak):,} B) into {args.output}")
    if recorder:
        recorder.write(args.moe_counts, scenario.setup.micro_batch, scenario.setup.seq_len, scenario.name)
        print(f"routing counts (tokens per expert per layer, first micro-batch) written to {args.moe_counts}")
    return 0


def _capture_cuda(args, scenario) -> int:
    """capture --device-kind cuda: the setup checked (before CUDA is looked for), then the GPU, then what the run
    needs, host and device, against what this machine has (unless --force), then the capture."""
    _moe_recorder(args, scenario)  # refuses --moe-counts: routers are recorded in CPU captures
    check_capturable(scenario)
    gpu = _check_cuda_capture(args, scenario)
    snapshot = args.output + ".snapshot.pickle"
    trace = cuda_capture.capture_cuda(scenario, snapshot, device=gpu)
    save_log(trace.allocated, args.output)
    meta = trace.allocated.metadata
    print(f"captured {len(trace.allocated.events):,} CUDA allocator events of {scenario.name} on {meta['gpu']} (peak "
          f"{trace.peak_bytes(allow_truncated=True):,} B allocated, {meta['reserved_peak']:,} B reserved; steps "
          f"1-{scenario.setup.steps}) into {args.output}; the raw snapshot is {snapshot}")
    if trace.truncated:
        print(f"peakledger: the snapshot is truncated ({'; '.join(trace.problems[:2])}): its peaks are lower bounds",
              file=sys.stderr)
    outside = meta["step_labels"]["outside"]
    if outside:
        print(f"peakledger: {outside:,} events lie outside the loop's marks (the snapshot's clock disagrees with the "
              "host's): their steps and phases are a guess", file=sys.stderr)
    return 0


def _check_cuda_capture(args, scenario) -> dict:
    """The GPU (ConfigError naming device_kind without one), and what a CUDA capture of `scenario` holds: on the
    host (the model built there before it moves; peakledger/inputs.py host_need) against half of this machine's
    memory, on the device (the simulation on the GPU's profile, with its torch's allocator rules) against the
    GPU's free memory. Either over: refused unless --force."""
    gpu = cuda_capture.cuda_device()
    profile = gpu["profile"]
    if profile is None:
        profile = scenario.device if device_profile(scenario.device).is_cuda else "H100-80GB"
        print(f"peakledger: {gpu['name']} (compute capability {'.'.join(map(str, gpu['compute_capability']))}) "
              f"matches no device profile: its memory is predicted on {profile}'s", file=sys.stderr)
    if args.force:
        return gpu
    conf = gpu["alloc_conf"]
    try:
        AllocatorConfig.parse(conf, gpu["allocator_rules"])
    except InputError:
        conf = ""  # settings the allocator model does not take: the prediction uses the defaults
    need = host_need(scenario, profile, gpu["allocator_rules"], conf)
    limit = inputs.real_run_limit()
    if need.host > limit:
        raise ConfigError("force", f"a CUDA capture of {scenario.name} holds about {format_bytes(need.host, 'GiB')} "
                                   f"of host memory (the model built on the host in fp32, "
                                   f"{format_bytes(need.build, 'GiB')}, before it moves to the GPU, plus torch and the "
                                   f"CUDA libraries), over the limit of {format_bytes(limit, 'GiB')} (half of this "
                                   "machine's memory): choose a smaller model, or pass --force to run it anyway")
    if need.device > gpu["free_memory"]:
        raise ConfigError("force", f"{scenario.name} is predicted to need {format_bytes(need.device, 'GiB')} "
                                   f"on the GPU "
                                   f"({profile} profile, torch {gpu['allocator_rules']} allocator rules, CUDA context "
                                   f"included), but {gpu['name']} has {format_bytes(gpu['free_memory'], 'GiB')} free "
                                   f"of {format_bytes(gpu['total_memory'], 'GiB')}: choose a smaller model or "
                                   "micro-batch, or pass --force to run it anyway")
    return gpu


def _moe_recorder(args, scenario):
    """capture --moe-counts FILE: a router hook on the real model (traces/reference/mixtral.py), or None."""
    if not args.moe_counts:
        return None
    if args.device_kind == "cuda" or not getattr(scenario.model, "num_local_experts", None):
        raise ConfigError("moe_counts", "records the routers of a mixture-of-experts model (num_local_experts) "
                                        "in a CPU capture")
    from .traces.reference.mixtral import RoutingRecorder
    return RoutingRecorder()


def cmd_validate_ranks(args, scenario) -> int:
    if args.plot:
        raise ConfigError("plot", "validate --world-size N prints one table per rank; --plot draws one run: drop it "
                                  "(or validate one rank's trace with --trace)")
    results, simulated = validation.validate_ranks(scenario, backend=args.pg_backend or "gloo")
    if args.json:
        _write_json({"ranks": [validation_json(v) for v, _ in results]})
    else:
        for v, _ in results:
            print(render_validation(v, args.unit or "MiB"))
            print("")
    if scenario.setup.pp > 1 and not args.json:  # what the stages hold apart: first stage vs last stage
        first, last = results[0][0].overall, results[-1][0].overall
        print(f"last stage - first stage peak: measured {last.measured - first.measured:+,} B, predicted "
              f"{last.predicted - first.predicted:+,} B")
    if args.tolerance is not None:
        worst = max((v for v, _ in results), key=lambda v: abs(v.overall.error))
        ok = worst.passes(args.tolerance)
        print(f"worst rank peak error {worst.overall.error:+.3%} ({worst.name}) "
              f"{'within' if ok else 'OUTSIDE'} tolerance {args.tolerance:.2%}", file=sys.stderr)
        return 0 if ok else 1
    return 0


def cmd_validate(args) -> int:
    check_command_outputs(args, ["plot"])
    if args.trace:
        if args.pg_backend is not None or args.force:
            raise ConfigError("trace", "validate --trace runs nothing: --pg-backend and --force do not apply")
        trace = load_trace(args.trace)
        if trace.truncated:
            raise ConfigError("trace", f"{trace.warning()}; a validation needs the whole run")
        scenario, notes = scenario_for_trace(args, trace, VALIDATE_DEFAULTS)
        cuda = is_cuda_trace(trace.log)
        if cuda:
            scenario, notes = _cuda_trace_scenario(args, trace, scenario, notes)
        for note in notes:
            print(f"peakledger: {note}", file=sys.stderr)
        if cuda:
            result, measured, simulated = _validate_cuda_trace(scenario, trace)
        else:
            result, measured, simulated = validation.validate(scenario, trace.log)
    else:
        scenario = real_run_scenario(args)
        if args.pg_backend is not None and scenario.setup.world_size == 1:
            raise ConfigError("pg_backend", "only applies to a real run of world_size > 1 (one process per rank)")
        check_real_run(args, scenario)
        if scenario.setup.world_size > 1:
            return cmd_validate_ranks(args, scenario)
        result, measured, simulated = validation.validate(scenario)
    if args.plot:
        plot_overlay(timeline(measured), timeline(simulated), args.plot,
                     title=f"{scenario.name}: measured vs predicted")
    if args.json:
        _write_json(validation_json(result))
    else:
        print(render_validation(result, args.unit or "MiB"))
    if args.tolerance is not None:
        ok = result.passes(args.tolerance)
        print(f"peak error {result.overall.error:+.3%} {'within' if ok else 'OUTSIDE'} tolerance {args.tolerance:.2%}",
              file=sys.stderr)
        return 0 if ok else 1
    return 0


def _cuda_trace_scenario(args, trace, scenario, notes: list[str]):
    """validate --trace of a CUDA trace: the scenario on the GPU it ran on. Device: --device, else the profile the
    capture recorded (the one matching the GPU's compute capability and memory), else the scenario's own when the
    trace names no GPU; allocator rules: --torch-version, else those of the torch that ran; allocator settings:
    --alloc-conf, else the PYTORCH_CUDA_ALLOC_CONF the capture ran with. Returns it and the notes, said anew."""
    meta = trace.log.metadata
    notes = [n for n in notes if not n.startswith(("overrode torch_version:", "overrode alloc_conf:"))]
    gpu = meta.get("gpu") or (meta.get("device") if isinstance(meta.get("device"), str) else None)
    cuda_profiles = ", ".join(n for n, p in DEVICES.items() if p.is_cuda)
    if args.device is not None:
        device = args.device
        notes.append(f"simulating on {device} (--device)" + (f"; the trace ran on {gpu}" if gpu else ""))
    elif meta.get("device_profile"):
        device = meta["device_profile"]
        notes.append(f"simulating on {device}, the profile of {gpu or 'the GPU the trace ran on'}")
    elif meta.get("compute_capability") is not None:
        cc = ".".join(str(x) for x in meta["compute_capability"])
        raise ConfigError("device", f"{trace.path} was captured on {gpu} (compute capability {cc}), which no "
                                    f"peakledger device profile matches: give --device, one of {cuda_profiles}")
    else:
        device = scenario.device
        notes.append(f"{trace.path} names no device profile: simulating on {device} (the scenario's; --device "
                     "to change)")
    if not device_profile(device).is_cuda:
        raise ConfigError("device", f"{trace.path} is a CUDA trace: simulate it on a CUDA device profile, one of "
                                    f"{cuda_profiles} (got {device!r})")
    if args.torch_version is not None:
        rules = args.torch_version
        notes.append(f"allocator rules of torch {rules} (--torch-version)")
    elif meta.get("allocator_rules") or meta.get("torch_version"):
        rules = meta.get("allocator_rules") or allocator_rules(meta["torch_version"])
        notes.append(f"allocator rules of torch {rules}" + (f" (the trace ran torch {meta['torch_version']})"
                                                             if meta.get("torch_version") else ""))
    else:
        rules = scenario.torch_version
    conf = args.alloc_conf if args.alloc_conf is not None else meta.get("alloc_conf", scenario.alloc_conf)
    if conf:
        notes.append(f"allocator settings {conf!r}" + (" (--alloc-conf)" if args.alloc_conf is not None else
                                                        " (the capture's PYTORCH_CUDA_ALLOC_CONF)"))
    try:
        scenario = dataclasses.replace(scenario, device=device, torch_version=rules, alloc_conf=conf)
    except InputError as e:
        raise ConfigError("trace", f"{trace.path}: cannot simulate the GPU it records: {e}") from None
    if not any(e.step > 0 for e in trace.log.events):
        notes.append(f"{trace.path} has no step labels (a raw snapshot, or a capture older than them): every event "
                     "counts as step 0, so the first-step and per-phase rows do not line up; validate the capture's "
                     "JSON trace instead")
    return scenario, notes


def _validate_cuda_trace(scenario, trace):
    """A CUDA trace against the simulation of `scenario` on its GPU profile (every step, the allocator settings and
    rules in the log's metadata): allocated peaks as for any trace, plus the reserved peak (the caching
    allocator's segments: the capture's recorded `reserved_peak`, a snapshot's reserved view) against the
    allocator model's. Returns (Validation, measured log, simulated log)."""
    measured = trace.log
    devices = sorted({e.block.rank for e in measured.events})
    if len(devices) != 1:
        raise ConfigError("trace", f"{trace.path} holds devices {devices}: validate holds one device at a time")
    if devices != [0]:  # one device's trace, held against the simulated rank 0
        measured = dataclasses.replace(measured, events=[dataclasses.replace(e, block=dataclasses.replace(
            e.block, rank=0)) for e in measured.events])
    graph = describe(scenario.model, scenario.setup, scenario.device, torch_version=scenario.torch_version,
                     all_steps=True)
    graph.metadata.update(device_settings(scenario))
    simulated = simulate(graph, simulator=scenario.simulator)
    result = compare_logs(measured, simulated, name=scenario.name)
    result.host = None  # a CUDA snapshot sees the device's allocator only: the host is not measured
    reserved = measured.metadata.get("reserved_peak")
    if reserved is None and trace.reserved is not None:
        running = reserved = 0
        for e in trace.reserved.events:
            running += e.delta
            reserved = max(reserved, running)
    dm = gpu_memory(simulated, 0)
    if isinstance(reserved, int) and dm is not None:
        result.reserved = PeakPair("reserved (allocator)", reserved, dm.reserved_peak.reserved)
    return result, measured, simulated


class Parser(argparse.ArgumentParser):
    """argparse without prefix matching (`--micro 3` is not `--micro-batch 3`; `sweep --json` is not
    `--json-output`), its errors in the CLI's one-line form with exit 2 (subcommands' parsers are of this class)."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        self.exit(2, f"peakledger: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="peakledger", description="Where the memory of a training step goes.")
    sub = parser.add_subparsers(dest="command", required=True)
    s = sub.add_parser("simulate", help="simulate a scenario and print the ledger and peaks")
    _add_scenario_flags(s)
    s.add_argument("--json", action="store_true", help="print one JSON object")
    s.add_argument("--plot", metavar="FILE", help="write a PNG of occupancy by category")
    s.add_argument("--budget", help="device capacity (80GiB, 80GB, bytes): record the first OOM")
    s.add_argument("--stop-at-oom", action="store_true", help="with --budget: end the run at the first OOM")
    s.add_argument("--export-snapshot", metavar="FILE",
                   help="write a CUDA-snapshot pickle (open with torch/cuda/_memory_viz.py or pytorch.org/memory_viz)")
    s.add_argument("--export-chrome", metavar="FILE", help="write a Chrome/Perfetto trace JSON")
    s.add_argument("--export-graph", metavar="FILE",
                   help="write the op graph as GraphML (networkx) and print its critical path")
    s.set_defaults(func=cmd_simulate)
    m = sub.add_parser("max-batch", help="largest micro-batch that fits a budget")
    _add_scenario_flags(m)
    m.add_argument("--budget", required=True, help="80GiB, 80GB or plain bytes")
    m.add_argument("--json", action="store_true")
    m.set_defaults(func=cmd_max_batch)
    c = sub.add_parser("compare", help="several scenarios side by side")
    _add_scenario_flags(c)
    c.add_argument("--case", action="append", help="'name: key=value ...' changes to the base scenario")
    c.add_argument("--peers", action="store_true",
                   help="ZeRO stages 0-3: peakledger per rank vs the ZeRO paper and DeepSpeed's estimators")
    c.add_argument("--json", action="store_true")
    c.set_defaults(func=cmd_compare)
    v = sub.add_parser("validate", help="run the scenario for real on CPU and hold the simulation against it")
    _add_scenario_flags(v)
    v.add_argument("--tolerance", type=float, help="exit 1 when |peak error| is larger (0.01 = 1%%)")
    v.add_argument("--plot", metavar="FILE", help="PNG overlaying measured and predicted totals")
    v.add_argument("--json", action="store_true")
    v.add_argument("--pg-backend", choices=["gloo", "fake"],
                   help="--world-size > 1: real gloo processes on 127.0.0.1, or torch's fake process group")
    v.add_argument("--trace", metavar="FILE",
                   help="compare against a saved trace (peakledger capture) instead of a new "
                        "run; its recorded scenario is used, flags override fields of it")
    v.add_argument("--force", action="store_true", help="run even when the estimated host memory is over the limit")
    v.set_defaults(func=cmd_validate)
    x = sub.add_parser("explain", help="why a scenario (or a measured trace) does not fit a budget, and ranked fixes")
    _add_scenario_flags(x)
    x.add_argument("--budget", required=True, help="device memory per rank: 24GiB, 24GB or bytes")
    x.add_argument("--host-budget", help="host memory per rank (checks the host pool too)")
    x.add_argument("--trace", metavar="FILE", help="explain a measured trace (capture JSON or CUDA snapshot pickle)")
    x.add_argument("--json", action="store_true")
    x.set_defaults(func=cmd_explain)
    a = sub.add_parser("checkpointing", help="activation checkpointing policies: peak, recompute, step time; "
                                             "the cheapest layer set that fits a budget")
    _add_scenario_flags(a)
    a.add_argument("--budget", help="find the least-recompute set of checkpointed layers that fits (80GiB, ...)")
    a.add_argument("--plot", metavar="FILE", help="PNG of peak vs recompute per policy")
    a.add_argument("--json", action="store_true")
    a.set_defaults(func=cmd_checkpointing)
    w = sub.add_parser("sweep", help="simulate a grid of inputs on every core into CSV / JSON")
    _add_scenario_flags(w)
    w.add_argument("--grid", action="append", metavar="KEY=V1,V2",
                   help="a field and its values (repeat for more fields; points are the product)")
    w.add_argument("--budget", help="mark which points fit (80GiB, 80GB, bytes)")
    w.add_argument("--max-batch", action="store_true", help="with --budget: the largest micro-batch per point")
    w.add_argument("--jobs", type=int, help="worker processes (default: every core; a cluster: its workers)")
    w.add_argument("--engine", default="local", help="local (processes on this machine), ray or dask "
                                                      "(pip install peakledger[ray] / peakledger[dask])")
    w.add_argument("--address", help="ray / dask: an existing cluster's address (default: a local cluster for the run)")
    w.add_argument("--output", metavar="FILE.csv")
    w.add_argument("--json-output", metavar="FILE.json")
    w.set_defaults(func=cmd_sweep)
    k = sub.add_parser("capture", help="run real training steps on CPU (or a CUDA GPU: --device-kind cuda) and save "
                                       "the exact memory trace")
    _add_scenario_flags(k)
    k.add_argument("--output", required=True, metavar="FILE", help="versioned JSON trace (traces/store.py)")
    k.add_argument("--wall-times", action="store_true",
                   help="keep measured wall-clock times (default: event index, so the file is reproducible)")
    k.add_argument("--device-kind", default="cpu", choices=["cpu", "cuda"], help="where to run (cuda needs a GPU)")
    k.add_argument("--force", action="store_true", help="run even when the estimated host memory is over the limit "
                                                          "(cuda: or the predicted device memory over the GPU's free)")
    k.add_argument("--moe-counts", metavar="FILE", help="mixture of experts: also write the tokens each expert "
                   "received per layer in the run's first micro-batch (for --moe-routing counts:FILE)")
    k.set_defaults(func=cmd_capture)
    r = sub.add_parser("replay", help="replay a CUDA snapshot's requests through the caching-allocator model and "
                                      "compare with what the real allocator did")
    r.add_argument("snapshot", metavar="SNAPSHOT.pickle", help="torch.cuda.memory._dump_snapshot output")
    r.add_argument("--alloc-conf", metavar="CONF", help="allocator settings in PYTORCH_CUDA_ALLOC_CONF syntax "
                   "(default: the snapshot's own defaults), e.g. max_split_size_mb:128")
    r.add_argument("--capacity", help="device capacity (80GiB, 80GB, bytes); default: unlimited (no OOM)")
    r.add_argument("--json", action="store_true", help="print one JSON object")
    r.add_argument("--unit", choices=["GiB", "GB", "MiB", "MB"], help="unit of the text output (default GiB)")
    r.add_argument("--debug", action="store_true", help="on an internal error, print the whole traceback")
    r.set_defaults(func=cmd_replay)
    register_calibrate(sub)
    return parser


class _Terminated(KeyboardInterrupt):
    """SIGTERM, raised where Python runs next so every `finally` (temporary files, worker pools) runs."""


def _on_sigterm(signum, frame):
    raise _Terminated()


def _internal_error(args, e: BaseException) -> int:
    if getattr(args, "debug", False):
        traceback.print_exc()
    print(f"peakledger: internal error (a bug in peakledger, not your input): {type(e).__name__}: {e}"
          + ("" if getattr(args, "debug", False) else "; run again with --debug for the traceback"), file=sys.stderr)
    return 3


def main(argv: list[str] | None = None) -> int:
    """Exit 0 on success (1: a validate outside its tolerance), 2 on bad input (one line naming it), 3 on an
    internal error (a bug: one line, the traceback with --debug), 130 / 143 when interrupted / terminated."""
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:  # argparse's error (one line, `Parser.error`) or --help: its status, not a raise
        return e.code if isinstance(e.code, int) else 2
    previous = signal.signal(signal.SIGTERM, _on_sigterm) if threading.current_thread() is threading.main_thread() \
        else None
    try:
        check_common(args)
        with time_limit(getattr(args, "module_timeout", None)):
            return args.func(args)
    except InputError as e:
        print(f"peakledger: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # output piped into head & co.
        sys.stderr.close()
        return 0
    except KeyboardInterrupt as e:
        print(f"peakledger: {'terminated' if isinstance(e, _Terminated) else 'interrupted'}: nothing written",
              file=sys.stderr)
        return 143 if isinstance(e, _Terminated) else 130
    except ValueError as e:
        if not too_many_digits(e):
            return _internal_error(args, e)
        print(f"peakledger: error: {digits_message('an input')}", file=sys.stderr)  # (a reader that does not say)
        return 2
    except Exception as e:  # the one place an unexpected error becomes a message
        return _internal_error(args, e)
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    sys.exit(main())
