"""The simulation commands: `peakledger simulate`, `max-batch`, `compare`, `checkpointing` and `sweep`, each a scenario
(or a grid of them) described and simulated, nothing run for real."""

from __future__ import annotations

import dataclasses
import sys
from typing import TYPE_CHECKING

from . import (
    api,
    diagnosis,
    sweep,
)
from .analysis.checkpointing import (
    optimal_checkpointing,
    plot_peak_vs_recompute,
    policy_table,
    render_optimal,
    render_table,
)
from .analysis.export import write_chrome_trace, write_html, write_snapshot
from .analysis.export_html import html_report
from .analysis.ledger import ROW_ORDER
from .analysis.peers import PEER_NOTES, render_peers
from .analysis.peers_parallel import PARALLEL_PEER_NOTES, render_parallel_peers
from .analysis.report import report_json
from .analysis.report_text import render_text
from .analysis.units import Scale, format_bytes, format_duration
from .assumed import assumed, assumed_lines
from .batch_budget import cmd_batch_budget
from .cli_common import (
    add_check_flag,
    add_host_flags,
    add_scenario_flags,
    budget_flag,
    budget_of,
    decide,
    fit_verdict,
    flag_int,
    host_json,
    host_verdict,
    parse_case,
    write_json,
)
from .deadline import deadline_budget, parse_count, parse_duration, render_ranking
from .inputs import (
    check_command_outputs,
    scenario_from_args,
)
from .kept import keep
from .models.config import ConfigError
from .models.devices import DEVICES, device_profile
from .models.traced import micro_batch_points
from .models.training import StepPlan
from .progress import progress
from .simulator.gcpause import paused_gc
from .simulator.timeline import timeline

if TYPE_CHECKING:
    from .simulator.graph_nx import CriticalPath

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
    return (f"critical path: {len(path.ops):,} ops, {format_duration(path.seconds)} (the simulated run's length; "
            f"{parts}), "
            f"from {path.ops[0].name} to {path.ops[-1].name}" if path.ops else "critical path: no ops")


def cmd_simulate(args) -> int:
    check_command_outputs(args, ["plot", "export_snapshot", "export_chrome", "export_graph", "html"])
    budget = budget_flag(args)
    if args.stop_at_oom and budget is None:
        raise ConfigError("stop_at_oom", "needs --budget: the OOM it stops at is an allocation over the budget")
    scenario = scenario_from_args(args)
    if args.check and budget is None:
        budget = budget_of(args, scenario, "--check")
    with progress(f"describing and simulating {scenario.name}"), paused_gc():  # one block (simulator/gcpause.py)
        with micro_batch_points(True):  # a deep traced model's first trace: sizes 2-4 too (models/traced)
            graph = api.op_graph(scenario, budget)
        report = api.run(scenario, budget=budget, stop_on_oom=args.stop_at_oom, graph=graph)
    if args.plot:
        from .analysis.plot import plot_timeline, setup_text  # matplotlib, loaded for the picture only

        gpu = report.gpu_series
        oom = report.log.ooms[0] if report.log.ooms else None
        steps = StepPlan.of(report.log.metadata).summary() or f"{report.steps} steps"
        if report.log.metadata.stopped_at_oom:
            steps += ", stopped at the first OOM"
        plot_timeline(timeline(report.log, report.peaks.rank), args.plot, unit=args.unit,
                      title=f"device memory of rank {report.peaks.rank} over the run ({steps}): allocated by "
                            f"category" + (", reserved and the device total" if gpu else ""),
                      reserved=gpu.series if gpu else None, budget=budget, headroom=scenario.headroom,
                      capacity=(scenario.device, DEVICES[scenario.device].memory_bytes) if gpu else None,
                      outside=gpu.context + sum(gpu.outside.values()) if gpu else 0,
                      oom=(oom.event.time, f"{oom.event.op} ({format_bytes(oom.event.block.nbytes, args.unit)})")
                      if oom else None, setup=setup_text(scenario, budget, args.unit))
    if args.export_snapshot:
        write_snapshot(report.log, args.export_snapshot)
    if args.export_chrome:
        write_chrome_trace(report.log, args.export_chrome, graph)
    if args.html:
        write_html(args.html, _html_page(args, scenario, report, budget))
    path = None
    if args.export_graph:
        from .simulator.graph_nx import critical_path, write_graphml  # networkx, loaded for this export only

        write_graphml(graph, args.export_graph)
        path = critical_path(graph)
    written = [x for x in (args.plot, args.export_snapshot, args.export_chrome, args.export_graph, args.html) if x]
    repeats = StepPlan.of(report.log.metadata).summary()
    host = host_verdict(args, scenario, report.log, report.index)  # None: the host not judged
    verdict = fit_verdict(report, budget, scenario.headroom, host) if args.check else None
    code = decide(args, 1 if verdict is not None and not verdict.fits else 0)
    savings = None
    if scenario.setup.compile.on:  # what compile saves: the same run simulated eager, beside it
        with progress(f"simulating {scenario.name} eager, for the comparison"):
            savings = api.compile_savings(scenario, report)
    if args.json:
        write_json({**report_json(report), **({"critical_path": critical_path_json(path)} if path else {}),
                     **({"compile_vs_eager": savings} if savings else {}),
                     **({"fit_check": verdict.as_json()} if verdict is not None else {}),
                     **host_json(args, host)})
    else:
        print(render_text(report, args.unit))
        if path:
            print(critical_path_text(path))
        if written:
            print(f"written: {', '.join(written)}"
                  + (f" (they show the simulated steps: {repeats})" if repeats else ""))
        if savings:
            print("\n".join(_savings_lines(savings, args.unit)))
        if host is not None and host.said:
            print("\n".join(host.lines(args.unit)[:1 if verdict is not None else 2]))  # --check: the verdict's
        if verdict is not None:
            print(verdict.line(args.unit))
    keep(report, graph)  # (peakledger/kept.py: not freed one by one before the exit)
    return code


def _html_page(args, scenario, report, budget: int | None) -> str:
    """simulate --html: the run held against its card (--budget, or else a GPU profile's memory; the cpu profile
    without --budget has none); when it does not fit, the fixes `explain` finds there, each re-simulated."""
    profile = device_profile(scenario.device)
    card = budget if budget is not None else None if profile.is_cpu else profile.memory_bytes
    host = host_verdict(args, scenario, report.log, report.index)
    verdict = fit_verdict(report, card, scenario.headroom, host if host is not None and (host.asked or not host.fits)
                          else None) if card is not None else None
    fixes = None
    if verdict is not None and not verdict.fits:
        with progress(f"explaining {scenario.name}") as bar:
            x = diagnosis.explain(scenario, card, progress=bar)
        fixes = diagnosis.fixes_table(x, args.unit)
    return html_report(report, args.unit, budget=card, fixes=fixes,
                       verdict=(verdict.fits, verdict.line(args.unit)) if verdict is not None else None)


def _savings_lines(s: dict, unit: str) -> list[str]:
    """compile against eager: the peaks, then each ledger row at its run's peak that differs."""
    f = lambda n: format_bytes(n, unit) if n else "0"  # noqa: E731

    def table(head: str, rows: list[dict], key: str, note: str = "") -> list[str]:
        g = Scale.of([r[k] for r in rows for k in ("eager", "compiled", "saved")], unit)  # one unit a table
        return [f"  {head + ' (' + g.unit + ')':<30}{'eager':>14}{'compiled':>14}{'saved':>14}{note}",
                *(f"  {r[key]:<30}{g.number(r['eager']):>14}{g.number(r['compiled']):>14}"
                  f"{g.number(r['saved']):>14}" for r in rows)]

    eager = s["eager_peak"]
    fb = s["forward_backward_peak"]
    return [f"compile against eager (the same run simulated uncompiled): peak {f(eager)} -> {f(s['compiled_peak'])}"
            f" ({-s['saved'] / eager:+.1%})" if eager else "compile against eager: no memory on either side",
            *table("row at each peak", [r for r in s["by_row_at_peak"] if r["saved"]], "row"),
            *table("phase peak", s["by_phase"], "phase"),
            *table("row at forward+backward peak", [r for r in fb["by_row"] if r["eager"] or r["compiled"]], "row",
                   f"   (eager at {fb['eager_at']}, compiled at {fb['compiled_at']})")]


SEARCHED = "the largest that fits (searched; each probe simulated)"


def cmd_max_batch(args) -> int:
    if args.fixed is not None or args.per_sample is not None:  # the abstract model M(B) = fixed + per-sample x B
        return cmd_batch_budget(args)
    scenario = scenario_from_args(args)
    budget = budget_of(args, scenario, "max-batch")
    with progress(f"searching the largest micro-batch of {scenario.name} (each probe simulated)") as bar:
        best = api.max_micro_batch(scenario, budget, progress=bar)
        fixed = api.fixed_state_peak(scenario)
    capped = best >= api.MAX_BATCH_LIMIT
    result = {"budget": budget, "max_micro_batch": best, "fixed_state_bytes": fixed,
              "headroom": scenario.headroom, "scenario": scenario.name, "search_limit_reached": capped,
              "assumed": assumed(scenario, micro_batch=SEARCHED)}
    if best > 0:
        at = api.run(dataclasses.replace(scenario, setup=scenario.setup.replace(micro_batch=best)))
        result["peak_at_max"] = at.peaks.overall.bytes
        result["effective_batch_at_max"] = best * scenario.setup.batch.grad_accum * scenario.setup.mesh.dp
    else:
        one = api.run(dataclasses.replace(scenario, setup=scenario.setup.replace(micro_batch=1)))
        result["capacity_needed_at_1"] = one.capacity_needed
        result["why_none"] = _why_no_batch(best, fixed, one.capacity_needed, budget, args.unit)
    code = decide(args, 1 if args.check and best < 1 else 0)
    if args.json:
        write_json(result)
        return code
    u = args.unit
    print(f"{scenario.name}: budget {format_bytes(budget, u)}, fixed state {format_bytes(fixed, u)}")
    if best < 1:
        print(f"max micro-batch: none fits. {result['why_none']}")
    elif capped:
        print(f"max micro-batch: at least {best:,} (the search stops at {api.MAX_BATCH_LIMIT:,}; the budget holds "
              f"more: peak there {format_bytes(result['peak_at_max'], u)})")
    else:
        print(f"max micro-batch: {best} (peak {format_bytes(result['peak_at_max'], u)}; B_eff "
              f"{result['effective_batch_at_max']} with accumulation {scenario.setup.batch.grad_accum})")
    if args.check:
        print("fit check: FITS (micro-batch 1 and up to the maximum)" if best >= 1 else
              "fit check: DOES NOT FIT (not even micro-batch 1)")
    print("\n".join(["", *assumed_lines(scenario, micro_batch=SEARCHED)]))
    return code


def _why_no_batch(best: int, fixed: int, at_one: int, budget: int, unit: str) -> str:
    """Why no micro-batch fits (best -1: the fixed state alone is over; 0: one sample's activations are)."""
    f = lambda n: format_bytes(n, unit)  # noqa: E731
    if best < 0:
        return (f"Even the fixed state (parameters, gradients, master weights and optimizer states: {f(fixed)}) is "
                f"over the budget of {f(budget)} by {f(fixed - budget)}; shard it (--dp-engine fsdp2 or --zero-stage "
                "3 with more ranks), train less of it (--lora-r, --freeze), or keep smaller states (--optimizer "
                "adam-8bit, --optimizer-offload states); `peakledger explain` ranks these, each re-simulated.")
    return (f"The fixed state fits ({f(fixed)}), but micro-batch 1 needs {f(at_one)}: over the budget of {f(budget)} "
            f"by {f(at_one - budget)}; activation checkpointing (--checkpointing full, or `peakledger "
            "checkpointing`), a shorter --seq-len, or more ranks to shard over; `peakledger explain` ranks these.")


def cmd_peers(args, base) -> int:
    s = base.setup
    parallel = s.mesh.tp * s.mesh.pp * s.mesh.cp * s.mesh.ep > 1  # model parallelism: Megatron's and llm-analysis's
    rows = api.parallel_peers(base) if parallel else api.peers(base)
    if args.json:
        write_json({"scenario": base.name, "peers": rows, "notes": PARALLEL_PEER_NOTES if parallel else PEER_NOTES,
                    "assumed": assumed(base)})
        return 0
    print(render_parallel_peers(rows, args.unit, base.name) if parallel else render_peers(base.name, rows, args.unit))
    print("\n".join(["", *assumed_lines(base), "  (peakledger's rows; each peer's formula assumes its own, above)"]))
    return 0


def cmd_compare(args) -> int:
    base = scenario_from_args(args)
    if args.peers and args.case:
        raise ConfigError("case", "--peers compares DeepSpeed's ZeRO stages of the base scenario; --case does not "
                                  "apply with it: drop one")
    if args.peers and args.plot:
        raise ConfigError("plot", "--plot draws the --case comparison; --peers prints the estimators' table: drop one")
    check_command_outputs(args, ["plot"])
    budget = budget_flag(args)
    if args.peers:
        return cmd_peers(args, base)
    cases = [parse_case(c) for c in (args.case or DEFAULT_CASES)]
    results = []
    with progress("simulating the cases", total=len(cases)) as bar:
        for name, changes in cases:
            bar.advance(0, f"simulating {name}")
            scenario = base.with_changes(name=name, **changes)
            results.append((name, api.run(scenario)))
            bar.advance()
    if args.plot:
        from .analysis.plot import plot_compare, setup_text

        plot_compare(results, args.plot, args.unit, budget=budget, setup="base: " + setup_text(base, budget, args.unit))
    if args.json:
        write_json({"cases": [report_json(r) for _, r in results], "assumed": assumed(base)})
        return 0
    u = args.unit
    rows = ["peak", "first-step peak", "steady peak"]
    all_rows = sorted({row.row: row.category for _, r in results for row in r.ledger}.items(),
                      key=lambda item: (ROW_ORDER.index(item[1]), item[0]))
    width = max(14, *(len(n) + 2 for n, _ in results))
    g = Scale.of([r.peaks.overall.bytes for _, r in results], u)  # one unit for the table, named in its head
    print(f"{'(' + g.unit + ')':<30}" + "".join(f"{n:>{width}}" for n, _ in results))
    for label in rows:
        vals = []
        for _, r in results:
            p = {"peak": r.peaks.overall, "first-step peak": r.peaks.first_step, "steady peak": r.peaks.steady}[label]
            vals.append(g.number(p.bytes) if p else "-")
        print(f"{label:<30}" + "".join(f"{v:>{width}}" for v in vals))
    print("at the peak:")
    for row_name, _ in all_rows:
        vals = []
        for _, r in results:
            match = [x for x in r.ledger if x.row == row_name]
            vals.append(g.number(match[0].bytes) if match else "-")
        print(f"  {row_name:<28}" + "".join(f"{v:>{width}}" for v in vals))
    print("peak reached at:")
    for name, r in results:
        e = r.peaks.overall.event
        print(f"  {name}: {e.op} ({e.phase.value}, step {e.step})")
    if budget is not None:
        verdicts = [f"{name} {'fits' if api.fits(r, budget) else 'does not fit'}" for name, r in results]
        print(f"budget {format_bytes(budget, u)} per rank: {', '.join(verdicts)}")
    print("\n".join(["", *assumed_lines(base), "  (the base scenario's; each case changes what it names)"]))
    if args.plot:
        print(f"plot written to {args.plot}")
    return 0


def cmd_sweep(args) -> int:
    if args.output is None and args.json_output is None and args.plot is None:
        raise ConfigError("output", "give --output FILE.csv, --json-output FILE.json and/or --plot FILE.png")
    check_command_outputs(args, ["output", "json_output", "plot"])
    base = scenario_from_args(args)
    grid = sweep.parse_grid(args.grid or [])
    if args.plot:
        from .analysis.plot import check_sweep_plot

        check_sweep_plot(grid)  # before any work
    budget = budget_flag(args)
    deadline = deadline_budget(args.target_tokens, args.target_steps, args.deadline, args.step_time, budget)
    max_points = sweep.DEFAULT_MAX_POINTS if args.max_points is None else parse_count(args.max_points, "max_points")
    time_limit = None if args.time_limit == "none" else parse_duration(args.time_limit, "time_limit")
    result = sweep.run_sweep(base, grid, budget=budget, max_batch=args.max_batch, jobs=args.jobs,
                             engine=args.engine, address=args.address, deadline=deadline, max_points=max_points,
                             time_limit_s=time_limit, on_estimate=_say_estimate)
    sweep.write(result, base, grid, args.output, args.json_output, deadline)
    if args.plot:
        from .analysis.plot import plot_sweep, setup_text

        plot_sweep(grid, result, args.plot, args.unit, budget=budget,
                   setup=setup_text(base, budget, args.unit, varied=grid))
    failed = sum(1 for p in result if p.result["error"])
    written = " and ".join(x for x in (args.output, args.json_output, args.plot) if x)
    print(f"{len(result)} points simulated ({failed} invalid, each with its error) into {written}")
    print("\n".join([*assumed_lines(base), "  (the base scenario's; each point changes what the grid names)"]))
    if deadline is not None:  # (its last line is the answer)
        print("\n" + render_ranking([(p.values, p.result) for p in result], deadline, args.unit))
    return 0


ESTIMATE_SAID_S = 10.0  # a sweep estimated to take longer says so up front (stderr)


def _say_estimate(estimate: sweep.Estimate) -> None:
    if estimate.total_s >= ESTIMATE_SAID_S and not estimate.over_limit:  # (over it: the error says it)
        print(estimate.line(), file=sys.stderr)


def cmd_checkpointing(args) -> int:
    check_command_outputs(args, ["plot"])
    budget = budget_flag(args)
    scenario = scenario_from_args(args)
    with progress(f"simulating each checkpointing policy of {scenario.name}"
                  + (" and searching the layer set" if budget is not None else "")):
        rows = policy_table(scenario, with_streams=True)
        best = optimal_checkpointing(scenario, budget) if budget is not None else None
    if args.plot:
        from .analysis.plot import setup_text

        plot_peak_vs_recompute(rows, args.plot, title="activation checkpointing: device memory and step time per "
                               "policy" + (", and the least-recompute layer set for the budget" if best else ""),
                               unit=args.unit, budget=budget, chosen=best,
                               setup=setup_text(scenario, budget, args.unit))
    if args.json:
        write_json({"scenario": scenario.name, "policies": [r.as_json() for r in rows],
                     "optimal": best.as_json() if best else None, "assumed": assumed(scenario)})
        return 0
    print(render_table(rows, args.unit))
    if best is not None:
        print("")
        print(render_optimal(best, args.unit))
    print("\n".join(["", *assumed_lines(scenario)]))
    if args.plot:
        print(f"plot written to {args.plot}")
    return 0


def register(sub) -> None:
    """Add simulate, max-batch, compare, checkpointing and sweep to the `peakledger` parser's sub-commands."""
    s = sub.add_parser("simulate", help="simulate a scenario and print the ledger and peaks")
    add_scenario_flags(s)
    s.add_argument("--json", action="store_true", help="print one JSON object")
    s.add_argument("--plot", metavar="FILE", help="write a PNG of occupancy by category over time, the budget, "
                                                  "zooms on the optimizer step and the peak")
    s.add_argument("--budget", help="device capacity (80GiB, 80GB, bytes): record the first OOM")
    s.add_argument("--stop-at-oom", action="store_true", help="with --budget: end the run at the first OOM")
    add_check_flag(s)
    add_host_flags(s)
    s.add_argument("--export-snapshot", metavar="FILE",
                   help="write a CUDA memory snapshot pickle in torch.cuda.memory._snapshot()'s format (python -m "
                        "torch.cuda._memory_viz stats|trace_plot|segment_plot FILE, or pytorch.org/memory_viz): per "
                        "rank, the modelled caching allocator's segments and blocks at the end and its trace "
                        "(segment_alloc/free, alloc, free, oom); on --device cpu, which has no caching allocator, "
                        "each tensor is its own segment")
    s.add_argument("--export-chrome", metavar="FILE",
                   help="write a Chrome trace JSON (Perfetto, chrome://tracing): step, phase and op duration slices "
                        "per rank (pid) and stream (tid), beside counters of the bytes live per category")
    s.add_argument("--html", metavar="FILE",
                   help="write one self-contained HTML page (no network): the headline with the verdict against the "
                        "card (--budget, or else a GPU --device's memory), the timeline (zoom; the tensors live under "
                        "the pointer), the ledger, the peak of each phase and, when the run does not fit the card, "
                        "the fixes `explain` finds, each re-simulated")
    s.add_argument("--export-graph", metavar="FILE",
                   help="write the op graph as GraphML (networkx) and print its critical path")
    s.set_defaults(func=cmd_simulate)
    m = sub.add_parser("max-batch", help="largest micro-batch that fits a budget (a model's, or M(B) = fixed + "
                                         "per-sample x B with --fixed / --per-sample)")
    add_scenario_flags(m)
    m.add_argument("--budget", help="80GiB, 24G, 80GB (default: the --device profile's memory); with --fixed / "
                                    "--per-sample also a whole number in a unit of your own")
    m.add_argument("--fixed", metavar="X", help="the abstract model instead of a simulated one: memory that does not "
                                                "grow with the batch (100, 30GiB); needs --per-sample and --budget")
    m.add_argument("--per-sample", metavar="Y", help="the abstract model's memory per sample (30, 1.5GiB): B fits "
                                                     "when X + Y x B <= budget (peakledger/batch_budget.py)")
    m.add_argument("--json", action="store_true")
    add_check_flag(m)
    m.set_defaults(func=cmd_max_batch)
    c = sub.add_parser("compare", help="several scenarios side by side")
    add_scenario_flags(c)
    c.add_argument("--case", action="append", help="'name: key=value ...' changes to the base scenario")
    c.add_argument("--peers", action="store_true",
                   help="ZeRO stages 0-3: peakledger per rank vs the ZeRO paper and DeepSpeed's estimators")
    c.add_argument("--json", action="store_true")
    c.add_argument("--budget", help="device capacity per rank (80GiB, 80GB, bytes): which cases fit; a line on --plot")
    c.add_argument("--plot", metavar="FILE", help="PNG of each case's peak, stacked by category, and the budget")
    c.set_defaults(func=cmd_compare)
    a = sub.add_parser("checkpointing", help="activation checkpointing policies: peak, recompute, step time; "
                                             "the cheapest layer set that fits a budget")
    add_scenario_flags(a)
    a.add_argument("--budget", help="find the least-recompute set of checkpointed layers that fits (80GiB, ...)")
    a.add_argument("--plot", metavar="FILE", help="PNG of device memory vs step time per policy, the budget and "
                                                  "the chosen layer set")
    a.add_argument("--json", action="store_true")
    a.set_defaults(func=cmd_checkpointing)
    w = sub.add_parser("sweep", help="simulate a grid of inputs on every core into CSV / JSON")
    add_scenario_flags(w)
    w.add_argument("--grid", action="append", metavar="KEY=V1,V2",
                   help="a field and its values (repeat for more fields; points are the product)")
    w.add_argument("--budget", help="mark which points fit (80GiB, 80GB, bytes)")
    w.add_argument("--max-batch", action="store_true", help="with --budget: the largest micro-batch per point")
    w.add_argument("--jobs", type=flag_int, help="worker processes (default: every core; a cluster: its workers)")
    w.add_argument("--engine", default="local", help="local (processes on this machine), ray or dask "
                                                      "(pip install peakledger[ray] / peakledger[dask])")
    w.add_argument("--address", help="ray / dask: an existing cluster's address (default: a local cluster for the run)")
    w.add_argument("--max-points", metavar="N", help=f"refuse a grid of more points than this before any work "
                                                     f"(default {sweep.DEFAULT_MAX_POINTS:,})")
    w.add_argument("--time-limit", metavar="TIME", default="1h",
                   help="the sweep's wall time at most: refused up front when the estimate (from its first points) "
                        "is over it, stopped past it, nothing written (default 1h; none: no limit)")
    w.add_argument("--output", metavar="FILE.csv")
    w.add_argument("--json-output", metavar="FILE.json")
    w.add_argument("--plot", metavar="FILE.png", help="PNG of the device memory each point needs and the budget: a "
                                                      "line over one field, a heatmap over two")
    dg = w.add_argument_group("deadline (peakledger/deadline.py): which points fit the budget and finish in time")
    dg.add_argument("--target-tokens", metavar="N", help="tokens to train on: 2e9, 2000000000, 2B")
    dg.add_argument("--target-steps", metavar="N", help="or optimizer steps to run (instead of --target-tokens)")
    dg.add_argument("--deadline", metavar="TIME", help="wall-clock limit with a unit: 90m, 48h, 2d")
    dg.add_argument("--step-time", metavar="TIME", help="a measured step time (1.9s), for every point, instead of "
                                                        "the cost model's")
    w.set_defaults(func=cmd_sweep)
