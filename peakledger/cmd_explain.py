"""`peakledger explain` (a scenario against a budget, or a measured trace) and `peakledger replay` (a CUDA snapshot
through the caching-allocator model): why memory runs out, in allocated and in reserved terms."""

from __future__ import annotations

import json

from . import diagnosis
from .analysis.allocator_replay import replay_snapshot
from .analysis.explain import (
    live_at_moment,
    moment_json,
    render_moment,
    render_reserved_moment,
    reserved_moment_json,
    worst_moment,
)
from .analysis.export import write_html
from .analysis.export_html import html_report
from .analysis.phases import phase_lines
from .analysis.units import format_bytes, parse_bytes
from .assumed import assumed, assumed_lines
from .cli_common import (
    FitVerdict,
    add_check_flag,
    add_host_flags,
    add_scenario_flags,
    budget_flag,
    budget_of,
    check_line,
    decide,
    host_json,
    host_limits,
    host_verdict,
    write_json,
)
from .inputs import check_command_outputs, scenario_flags_given, scenario_from_args
from .kept import keep
from .models.config import ConfigError
from .progress import progress
from .simulator.events import Pool
from .traces.store import load_trace


def cmd_explain(args) -> int:
    host_budget = budget_flag(args, "host_budget")
    u = args.unit
    if args.trace and args.html:
        raise ConfigError("html", "explain --trace reads a measured trace; --html draws a simulated run (explain a "
                                  "scenario, or simulate --html): drop one")
    check_command_outputs(args, ["html"])
    if args.trace:
        budget = budget_flag(args)
        if budget is None:
            raise ConfigError("budget", "explain --trace needs --budget: the device the trace is held against")
        return _explain_trace(args, budget, host_budget)
    scenario = scenario_from_args(args)
    budget = budget_of(args, scenario, "explain")
    with progress(f"explaining {scenario.name}") as bar:
        x = diagnosis.explain(scenario, budget, host_budget, host_limits(args), progress=bar)
    keep(x)  # (peakledger/kept.py: not freed one by one before the exit)
    setup = scenario.setup
    host = host_verdict(args, scenario, x.report.log, x.report.index)  # the node's host verdict; None: not judged
    verdict = FitVerdict(x.fits and (host is None or host.fits), x.capacity_needed, budget, host=host,
                         device_fits=x.fits if host is not None else None)
    host_moment = x.host_moment
    if host_moment is None and host is not None and not host.fits_ram:  # where a rank outgrows its even share
        share = max(0, host.host_memory // host.gpus_per_node - host.baseline)
        host_moment = worst_moment(x.report.log, share, Pool.HOST)
    status = decide(args, 1 if args.check and not verdict.fits else 0)
    if args.html:
        write_html(args.html, html_report(
            x.report, u, budget=budget, verdict=(verdict.fits, verdict.line(u)) if host_json(args, host) else
            (x.fits, check_line(x.fits, x.capacity_needed, budget, u)),
            fixes=diagnosis.fixes_table(x, u),
            notes=[f"{'where it runs out' if not x.fits else 'its highest moment'}: {x.where}"] + x.first_step))
    if args.json:
        write_json({"scenario": x.scenario, "budget": budget, "host_budget": host_budget, "peak": x.peak,
                     "capacity_needed": x.capacity_needed, "fits": x.fits, "step_time_s": x.step_time,
                     "where": x.where, "first_step": x.first_step,
                     "phases": [p.as_json() for p in x.phases], "risks": x.risks,
                     "moment": moment_json(x.moment, setup, x.binding),
                     "host_moment": moment_json(host_moment, setup) if host_moment else None, **host_json(args, host),
                     "fixes_tried": x.tried,
                     "fixes": [{"name": fx.name, "changes": {k: list(v) if isinstance(v, tuple) else v
                                                             for k, v in fx.changes.items()},
                                "peak": fx.peak, "capacity_needed": fx.capacity_needed, "fits": fx.fits,
                                "step_time_s": fx.step_time, "changes_training": fx.changes_training,
                                "cost": fx.note} for fx in x.fixes], "gpu": _explain_gpu_json(x),
                    "assumed": assumed(scenario)})
        return status
    f = lambda n: format_bytes(n, u)  # noqa: E731
    said = "fits" if x.fits else "DOES NOT FIT"
    print(f"{x.scenario}: {said} a budget of {f(budget)}: peak {f(x.peak)}, capacity needed "
          f"{f(x.capacity_needed)}")
    print(f"{'where it runs out' if not x.fits else 'its highest moment'}: {x.where}")
    if x.first_step:
        print("what the first step (or save) does there:")
        print("\n".join(f"  - {line}" for line in x.first_step))
    print("\n".join(render_moment(x.moment, u, setup, x.binding)))
    print("\n".join(_explain_gpu_lines(x, u)))
    if host is not None and host.said:
        print("\n".join(host.lines(u)))
    if host_moment is not None:
        if x.host_moment is None:
            print(f"the host's moment, against a rank's even share of the node ({host.gpus_per_node} rank(s)) less "
                  "its baseline:")
        print("\n".join(render_moment(host_moment, u, setup)))
    elif host_budget is not None:
        print(f"host budget {f(host_budget)}: nothing of this scenario lives in host memory (no offload, no "
              "host staging), so it always fits")
    print("")
    print("\n".join(phase_lines(x.phases, u, budget)))
    print("")
    if x.risks:
        print("it fits; what commonly makes a real first step worse than this simulation assumed:")
        print("\n".join(f"  - {line}" for line in x.risks))
        print("")
    title, head, rows = diagnosis.fixes_table(x, u)
    print(title)
    width = max([52] + [len(r[0]) + 1 for r in rows])  # the fix names' column, as wide as the longest
    for name, peak, fits, ratio, cost in [head] + rows if rows else []:
        print(f"  {name:<{width}}{peak:>14}  {fits:<5}{ratio:>11}  {cost}")
    print("\n".join(["", *assumed_lines(scenario), "  (the scenario's; each fix changes what it names)"]))
    if args.check:
        print(verdict.line(u))
    return status


def _explain_gpu_json(x) -> dict | None:
    if x.gpu is None:
        return None
    oom = x.gpu_oom
    return {"alloc_conf": x.gpu.alloc_conf, "reserved_peak": x.gpu.reserved_peak.reserved,
            "device_total_peak": x.gpu.total_peak.total, "fragmentation": x.fragmentation,
            "oom": None if oom is None else {"message": oom.message, "op": oom.point.event.op,
                                             "phase": oom.point.event.phase.value, "step": oom.point.event.step,
                                             "tensor": oom.point.event.block.name, "requested": oom.requested,
                                             "allocated": oom.point.allocated_blocks, "reserved": oom.point.reserved,
                                             "device_total": oom.point.total}}


def _explain_gpu_lines(x, u: str) -> list[str]:
    """The GPU's side of an explanation: the caching allocator's first OOM in torch's words, and whether the
    cache's fragmentation, not the tensors, causes it."""
    if x.gpu is None:
        return []
    f = lambda n: format_bytes(n, u)  # noqa: E731
    oom, conf = x.gpu_oom, x.gpu.alloc_conf or "default settings"
    if oom is None:
        return [f"on the GPU (caching allocator, {conf}): "
                f"reserved peak {f(x.gpu.reserved_peak.reserved)}, device total "
                f"{f(x.gpu.total_peak.total)} (with the CUDA context, assumed): fits, the allocator freeing its cache "
                "and retrying where it must"]
    e = oom.point.event
    lines = [f"on the GPU (caching allocator, {conf}): OUT OF MEMORY at {e.op} ({e.phase.value}, step {e.step}), "
             f"allocating {e.block.name}; torch would say:", f"  {oom.message}"]
    if x.fragmentation:
        lines.append(f"  fragmentation: the live blocks ({f(oom.point.allocated_blocks)}) and this request fit, but "
                     f"{f(oom.point.fragmentation)} reserved by the cache is unallocated in pieces too small for it "
                     "(largest free block " + f(oom.point.largest_free)
                     + "), even after freeing the whole free segments")
    return lines


def _explain_trace(args, budget: int, host_budget: int | None) -> int:
    """explain --trace: the measured trace alone decides; scenario flags would be silently ignored, so they
    are refused. A truncated trace is said, and its reading is a lower bound. A CUDA snapshot is read in
    allocated terms (blocks handed to tensors) and in reserved terms (segments cudaMalloc holds), each with
    its first moment over the budget, or its peak."""
    ignored = scenario_flags_given(args) + (["--host-budget"] if host_budget is not None else []) + [
        f"--{n.replace('_', '-')}" for n in ("host_memory", "pinned_limit", "gpus_per_node")
        if getattr(args, n, None) is not None]
    if ignored:
        raise ConfigError("trace", f"explain --trace reads the measured trace only; {', '.join(ignored)} would be "
                                   "ignored: drop them (or explain the scenario without --trace)")
    trace = load_trace(args.trace)
    log = trace.log
    if trace.reserved is None:
        moment, reserved = diagnosis.explain_trace(log, budget), None
    else:
        moment, reserved = diagnosis.explain_trace(log, budget, trace.reserved)
    # the other view at each moment (a snapshot numbers both views' events together)
    at_reserved = live_at_moment(log, reserved) if reserved else None
    at_moment = live_at_moment(trace.reserved, moment) if reserved else None
    warning = trace.warning()
    if args.json:
        write_json({"trace": args.trace, "kind": trace.kind, "budget": budget, "truncated": trace.truncated,
                     "lower_bound": trace.truncated, "warning": warning,
                     "moment": {**moment_json(moment, log.metadata.setup),
                                **({"reserved_bytes": at_moment} if at_moment is not None else {})},
                     "reserved_moment": reserved_moment_json(reserved, at_reserved) if reserved else None})
        return 0
    print(f"{args.trace}: {trace.kind} ({log.source}), budget {format_bytes(budget, args.unit)}")
    if warning:
        print(f"WARNING: {warning}")
    if reserved is not None:
        print("allocated (bytes handed to tensors):")
    print("\n".join(render_moment(moment, args.unit, log.metadata.setup)))
    if at_moment is not None:
        print(f"  reserved then {format_bytes(at_moment, args.unit)}")
    if reserved is not None:
        print("")
        print("reserved (segments cudaMalloc holds: what the device must have):")
        print("\n".join(render_reserved_moment(reserved, args.unit, at_reserved)))
    return 0


def cmd_replay(args) -> int:
    """The allocator model (simulator/allocator.py) on a measured snapshot (analysis/allocator_replay.py)."""
    capacity = parse_bytes(args.capacity, "capacity") if args.capacity is not None else None
    result = replay_snapshot(args.snapshot, args.alloc_conf, capacity)
    if args.json:
        print(json.dumps(result, sort_keys=True, default=str))
        return 0
    f = lambda n: format_bytes(n, args.unit)  # noqa: E731
    for d in result["devices"]:
        print(f"replay {args.snapshot} device {d['device']}: {d['trace_events']:,} trace events, start state "
              f"{d['start_segments']} segments / {d['start_blocks']} blocks (rebuilt from the final segments)")
        print(f"  segment events matched  {d['segments_matched']:,} of {d['segments_measured']:,} measured "
              f"({d['segments_predicted']:,} predicted)"
              + (f"; first difference: {d['first_segment_difference']}" if d["first_segment_difference"] else ""))
        print(f"  reserved peak           measured {f(d['reserved_peak']['measured'])}, predicted "
              f"{f(d['reserved_peak']['predicted'])}; "
              f"reserved equal after {d['reserved_exact_fraction']:.1%} of events")
        print(f"  allocated peak          measured {f(d['allocated_peak']['measured'])}, predicted "
              f"{f(d['allocated_peak']['predicted'])} (requested bytes; in blocks: "
              f"{f(d['allocated_block_peak_predicted'])})")
        print(f"  block addresses         {d['block_addresses_matched']:,} of {d['allocs']:,} equal; final layout "
              f"{'equal block by block' if d['final_layout_matches'] else 'differs'}")
        inf = d["capacity_inferred"]
        given = args.capacity is not None
        print("  device capacity         " + (f"{f(d['capacity'])} (given)" if given else
              f"{f(inf['capacity'])} inferred" + (f" (anything up to {f(inf['high'])} fits the trace)"
                                                  if inf["high"] not in (None, inf["capacity"]) else "")
              if inf["capacity"] is not None else f"at least {f(inf['low'])}, not needed by the replay")
              + ("" if given else f": {inf['how']}"))
        for oom in d["ooms"]:
            print(f"  OOM: {oom}")
    return 0


def register(sub) -> None:
    """Add explain and replay to the `peakledger` parser's sub-commands."""
    x = sub.add_parser("explain", help="why a scenario (or a measured trace) does not fit a budget, and ranked fixes")
    add_scenario_flags(x)
    x.add_argument("--budget", help="device memory per rank: 24GiB, 24G, 24GB (default: the --device profile's "
                   "memory)")
    x.add_argument("--host-budget", help="host memory per rank: the moment a rank's host pool runs out (the node's "
                   "verdict is --host-memory's)")
    add_host_flags(x)
    x.add_argument("--trace", metavar="FILE", help="explain a measured trace (capture JSON or CUDA snapshot pickle)")
    x.add_argument("--json", action="store_true")
    x.add_argument("--html", metavar="FILE", help="also write one self-contained HTML page (no network): the "
                   "timeline (zoom; the tensors live under the pointer), the ledger, the peak of each phase, the fixes")
    add_check_flag(x)
    x.set_defaults(func=cmd_explain)
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
