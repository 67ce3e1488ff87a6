"""The `peakledger` command.

    peakledger simulate [--preset gpt2 | --hf-config config.json | --scenario file.toml] [flags] [--json] [--plot F]
    peakledger max-batch --budget 80GiB [same model/training flags]
    peakledger compare [--case "name: key=value key=value" ...] [same flags for the base scenario]

Bad input exits 2 with one line naming the field and the allowed values.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import signal
import sys
import threading
import traceback

from . import api
from .analysis.device import gpu_memory
from .cmd_calibrate import register as register_calibrate
from .analysis.explain import moment_json, render_moment
from .analysis.export import write_chrome_trace, write_snapshot
from .analysis.ledger import ROW_ORDER
from .analysis.peers import PEER_NOTES, render_peers
from .analysis.plot import plot_overlay, plot_timeline
from .analysis.validate import render_validation, validation_json
from .analysis.report import render_text, report_json
from .analysis.units import format_bytes, parse_bytes
from .inputs import (DP_INT_FLAGS, MODEL_FLAG_TYPES, VALIDATE_DEFAULTS, check_command_outputs, check_common,
                     check_real_run, real_run_scenario, scenario_flags_given, scenario_for_trace,
                     scenario_from_args)
from .models.config import (CHECKPOINTING, DP_ENGINES, LOAD_MODES, OFFLOAD_FIRST_STEPS, OPTIMIZER_IMPLS,
                            OPTIMIZER_OFFLOADS, OPTIMIZERS, PASSES, PRECISIONS, QUANTIZE, SAVE_MODES, ConfigError)
from .models.costs import DEVICES
from .models.training import StepPlan
from .models.presets import PRESETS
from .scenario import parse_value
from .simulator.files import InputError
from .simulator.timeline import timeline
from .traces.store import load_trace, save_log, with_event_index_times

DEFAULT_CASES = ["fp32-sgd: precision=fp32 optimizer=sgd",
                 "bf16-adamw: precision=bf16-mixed optimizer=adamw",
                 "zero2-x8: precision=bf16-mixed optimizer=adamw zero_stage=2 world_size=8"]


def _add_scenario_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--scenario", help="TOML scenario file ([model], [training], [run]); flags override it")
    g.add_argument("--preset", help=f"one of: {', '.join(PRESETS)} (default gpt2)")
    g.add_argument("--hf-config", help="a HF transformers config.json (any model type transformers builds)")
    g.add_argument("--module", metavar="FILE.py:FACTORY",
                   help="your own model: FACTORY() returns (model, batch, loss_fn); traced on fake tensors")
    g.add_argument("--describer", help="auto (default), traced, hand-written: how --hf-config is described")
    for name, kind in MODEL_FLAG_TYPES:
        g.add_argument("--" + name.replace("_", "-"), type=kind, dest=f"model_{name}", help=argparse.SUPPRESS)
    t = p.add_argument_group("training")
    t.add_argument("--micro-batch", type=int)
    t.add_argument("--seq-len", type=int)
    t.add_argument("--grad-accum", type=int)
    t.add_argument("--steps", type=int, help="default 2, so the steady state is visible")
    t.add_argument("--precision", help=", ".join(PRECISIONS))
    t.add_argument("--passes", choices=PASSES, help="train (default): forward, loss, backward, optimizer step; "
                   "forward: `out = model(batch)` with autograd on, no loss, backward or step")
    t.add_argument("--fp32-grads", action="store_true", default=None, help="mixed precision: fp32 gradients")
    t.add_argument("--optimizer", help=", ".join(OPTIMIZERS))
    t.add_argument("--optimizer-impl", help=", ".join(OPTIMIZER_IMPLS))
    t.add_argument("--no-set-to-none", dest="set_to_none", action="store_false", default=None,
                   help="zero_grad(set_to_none=False): gradients stay allocated between steps")
    t.add_argument("--freeze", action="append", metavar="PATTERN", help="freeze parameters matching a glob")
    t.add_argument("--world-size", type=int)
    t.add_argument("--zero-stage", type=int)
    t.add_argument("--checkpointing", help=", ".join(CHECKPOINTING))
    t.add_argument("--checkpoint-every-k", type=int, help="checkpointing every-k: layers 0, k, 2k, ... (default 2)")
    t.add_argument("--checkpoint-layers", type=lambda v: tuple(int(x) for x in v.split(",") if x.strip()),
                   help="checkpointing layers: exactly these layer indices, e.g. 0,3,7")
    k = p.add_argument_group("checkpoint save / load")
    k.add_argument("--checkpoint-every", type=int, help="save a checkpoint after every N-th optimizer step (0: never)")
    k.add_argument("--save-mode", help=", ".join(SAVE_MODES))
    k.add_argument("--load-mode", help=", ".join(LOAD_MODES) + " (a checkpoint loaded before the first step)")
    o = p.add_argument_group("optimizer-state offload")
    o.add_argument("--optimizer-offload", help=", ".join(OPTIMIZER_OFFLOADS) + " (states in host memory between steps)")
    o.add_argument("--offload-chunk-params", type=int,
                   help="chunked: parameter elements whose states are copied and updated together (default 100000000)")
    o.add_argument("--offload-prefetch", type=int, help="chunked: chunks copied in ahead of the one updated (default 1)")
    o.add_argument("--offload-first-step", help=", ".join(OFFLOAD_FIRST_STEPS) +
                   " (chunked: step 1 as one torch step, or chunk by chunk)")
    lo = p.add_argument_group("LoRA / QLoRA (peft; the whole base model frozen)")
    lo.add_argument("--lora-r", type=int, help="adapter rank (0: no LoRA)")
    lo.add_argument("--lora-alpha", type=float, help="scaling = alpha / r (default 8, peft's)")
    lo.add_argument("--lora-dropout", type=float, help="dropout on the adapters' input, in [0, 1) (default 0)")
    lo.add_argument("--lora-targets", type=lambda v: tuple(x.strip() for x in v.split(",")),
                    help="peft target_modules, e.g. q_proj,k_proj,v_proj,o_proj (default: peft's for the family)")
    lo.add_argument("--quantize", help=", ".join(QUANTIZE) + " (nf4: bitsandbytes 4-bit base linears, QLoRA)")
    me = p.add_argument_group("mixture of experts")
    me.add_argument("--moe-routing", metavar="ROUTING", help="tokens per expert: balanced (default), worst (every token "
                    "to the same top-k experts) or counts:FILE (measured, from capture --moe-counts)")
    d = p.add_argument_group("data parallelism")
    d.add_argument("--dp-engine", help=f"{', '.join(DP_ENGINES)} (default deepspeed: --zero-stage applies)")
    d.add_argument("--no-reshard-after-forward", dest="reshard_after_forward", action="store_false", default=None,
                   help="fsdp2: keep unsharded parameters from forward to backward")
    for name in DP_INT_FLAGS:
        d.add_argument("--" + name.replace("_", "-"), type=int, help=argparse.SUPPRESS)
    r = p.add_argument_group("run")
    r.add_argument("--device", help=", ".join(DEVICES))
    r.add_argument("--headroom", type=float, help="capacity needed = peak x (1 + headroom); 0.1 = 10%%")
    r.add_argument("--alloc-conf", metavar="CONF", help="CUDA caching allocator settings on GPU device profiles, in "
                   "PYTORCH_CUDA_ALLOC_CONF syntax, e.g. expandable_segments:True,max_split_size_mb:128")
    r.add_argument("--empty-cache-before-save", action="store_true", default=None,
                   help="the program calls torch.cuda.empty_cache() before each checkpoint save (GPU profiles)")
    r.add_argument("--torch-version", help="whose CUDA caching-allocator rules apply: 2.6 (default) or 2.11")
    r.add_argument("--unit", choices=["GiB", "GB", "MiB", "MB"],
                   help="print sizes in this unit (default GiB; validate: MiB); --json always gives bytes")
    r.add_argument("--debug", action="store_true", help="on an internal error, print the whole traceback")


def _budget(args, name: str = "budget") -> int | None:
    """A size flag as bytes (None when not given; an empty value is an error, never "no budget")."""
    value = getattr(args, name, None)
    return None if value is None else parse_bytes(value, name)


def _parse_case(text: str) -> tuple[str, dict]:
    name, sep, rest = text.partition(":")
    if not sep or not name.strip():
        raise ConfigError("case", f"expected 'name: key=value ...', got {text!r}")
    changes = {}
    for item in rest.split():
        key, eq, value = item.partition("=")
        if not eq:
            raise ConfigError("case", f"expected key=value in {text!r}, got {item!r}")
        if key == "name":
            raise ConfigError("case", f"the case's name is the text before ':' in {text!r}; 'name' is not a field "
                                      "to change")
        if key in changes:
            raise ConfigError("case", f"{key} is given twice in {text!r}")
        changes[key] = parse_value(value)
    return name.strip(), changes


def _write_json(obj) -> None:
    sys.stdout.write(json.dumps(obj, indent=2) + "\n")


def cmd_simulate(args) -> int:
    check_command_outputs(args, ["plot", "export_snapshot", "export_chrome"])
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
    written = [x for x in (args.plot, args.export_snapshot, args.export_chrome) if x]
    repeats = StepPlan.of(report.log.metadata).summary()
    if args.json:
        _write_json(report_json(report))
    else:
        print(render_text(report, args.unit))
        if written:
            print(f"written: {', '.join(written)}" + (f" (they show the simulated steps: {repeats})" if repeats else ""))
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
        result["effective_batch_at_max"] = best * scenario.setup.grad_accum * scenario.setup.world_size
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


def cmd_explain(args) -> int:
    budget = _budget(args)
    host_budget = _budget(args, "host_budget")
    u = args.unit
    if args.trace:
        return _explain_trace(args, budget, host_budget)
    scenario = scenario_from_args(args)
    x = api.explain(scenario, budget, host_budget)
    setup = dataclasses.asdict(scenario.setup)
    if args.json:
        _write_json({"scenario": x.scenario, "budget": budget, "host_budget": host_budget, "peak": x.peak,
                     "capacity_needed": x.capacity_needed, "step_time_s": x.step_time,
                     "moment": moment_json(x.moment, setup),
                     "host_moment": moment_json(x.host_moment, setup) if x.host_moment else None,
                     "fixes": [{"name": fx.name, "changes": {k: list(v) if isinstance(v, tuple) else v
                                                             for k, v in fx.changes.items()},
                                "peak": fx.peak, "capacity_needed": fx.capacity_needed, "fits": fx.fits,
                                "step_time_s": fx.step_time, "changes_training": fx.changes_training,
                                "cost": fx.note} for fx in x.fixes], "gpu": _explain_gpu_json(x)})
        return 0
    f = lambda n: format_bytes(n, u)  # noqa: E731
    print(f"{x.scenario}: peak {f(x.peak)} (capacity needed {f(x.capacity_needed)}) against a budget of {f(budget)}")
    print("\n".join(render_moment(x.moment, u, setup)))
    print("\n".join(_explain_gpu_lines(x, u)))
    if x.host_moment is not None:
        print("\n".join(render_moment(x.host_moment, u, setup)))
    elif host_budget is not None:
        print(f"host budget {f(host_budget)}: nothing of this scenario lives in host memory (no offload, no "
              "host staging), so it always fits")
    print("")
    print(f"fixes, each re-simulated (step time {x.step_time * 1e3:.4g} ms now; fitting first, then by cost):")
    print(f"  {'fix':<52}{'peak':>14}  {'fits':<5}{'step time':>11}  cost")
    for fx in x.fixes:
        ratio = f"{fx.step_time / x.step_time - 1:+.0%}" if x.step_time else "-"
        cost = fx.note + ("; changes the training" if fx.changes_training else "")
        print(f"  {fx.name:<52}{f(fx.peak):>14}  {'yes' if fx.fits else 'no':<5}{ratio:>11}  {cost}")
    return 0


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
        return [f"on the GPU (caching allocator, {conf}): reserved peak {f(x.gpu.reserved_peak.reserved)}, device total "
                f"{f(x.gpu.total_peak.total)} (with the CUDA context, assumed): fits, the allocator freeing its cache "
                "and retrying where it must"]
    e = oom.point.event
    lines = [f"on the GPU (caching allocator, {conf}): OUT OF MEMORY at {e.op} ({e.phase.value}, step {e.step}), "
             f"allocating {e.block.name}; torch would say:", f"  {oom.message}"]
    if x.fragmentation:
        lines.append(f"  fragmentation: the live blocks ({f(oom.point.allocated_blocks)}) and this request fit, but "
                     f"{f(oom.point.fragmentation)} reserved by the cache is unallocated in pieces too small for it "
                     "(largest free block " + f(oom.point.largest_free) + "), even after freeing the whole free segments")
    return lines


def _explain_trace(args, budget: int, host_budget: int | None) -> int:
    """explain --trace: the measured trace alone decides; scenario flags would be silently ignored, so they
    are refused. A truncated trace is said, and its reading is a lower bound. A CUDA snapshot is read in
    allocated terms (blocks handed to tensors) and in reserved terms (segments cudaMalloc holds), each with
    its first moment over the budget, or its peak."""
    from .analysis.explain import live_at_moment, render_reserved_moment, reserved_moment_json

    ignored = scenario_flags_given(args) + (["--host-budget"] if host_budget is not None else [])
    if ignored:
        raise ConfigError("trace", f"explain --trace reads the measured trace only; {', '.join(ignored)} would be "
                                   "ignored: drop them (or explain the scenario without --trace)")
    trace = load_trace(args.trace)
    log = trace.log
    if trace.reserved is None:
        moment, reserved = api.explain_trace(log, budget), None
    else:
        moment, reserved = api.explain_trace(log, budget, trace.reserved)
    # the other view at each moment (a snapshot numbers both views' events together)
    at_reserved = live_at_moment(log, reserved) if reserved else None
    at_moment = live_at_moment(trace.reserved, moment) if reserved else None
    warning = trace.warning()
    if args.json:
        _write_json({"trace": args.trace, "kind": trace.kind, "budget": budget, "truncated": trace.truncated,
                     "lower_bound": trace.truncated, "warning": warning,
                     "moment": {**moment_json(moment, log.metadata.get("setup")),
                                **({"reserved_bytes": at_moment} if at_moment is not None else {})},
                     "reserved_moment": reserved_moment_json(reserved, at_reserved) if reserved else None})
        return 0
    print(f"{args.trace}: {trace.kind} ({log.source}), budget {format_bytes(budget, args.unit)}")
    if warning:
        print(f"WARNING: {warning}")
    if reserved is not None:
        print("allocated (bytes handed to tensors):")
    print("\n".join(render_moment(moment, args.unit, log.metadata.get("setup"))))
    if at_moment is not None:
        print(f"  reserved then {format_bytes(at_moment, args.unit)}")
    if reserved is not None:
        print("")
        print("reserved (segments cudaMalloc holds: what the device must have):")
        print("\n".join(render_reserved_moment(reserved, args.unit, at_reserved)))
    return 0


def cmd_sweep(args) -> int:
    from . import sweep
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
    from .analysis.checkpointing import (optimal_checkpointing, plot_peak_vs_recompute, policy_table, render_optimal,
                                         render_table)
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
    check_real_run(args, scenario)
    if args.device_kind == "cuda":
        from .traces.cuda_capture import capture_cuda
        snapshot = args.output + ".snapshot.pickle"
        trace = capture_cuda(scenario, snapshot)
        save_log(trace.allocated, args.output)
        print(f"captured {len(trace.allocated.events):,} CUDA allocator events of {scenario.name} (peak "
              f"{trace.peak_bytes():,} B allocated) into {args.output}; the raw snapshot is {snapshot}")
        return 0
    recorder = _moe_recorder(args, scenario)
    log = api.measure(scenario, model_hook=recorder.attach if recorder else None)
    save_log(log if args.wall_times else with_event_index_times(log), args.output)
    peak = max(timeline(log).total, default=0)
    print(f"captured {len(log.events):,} events of {scenario.name} (peak {int(peak):,} B) into {args.output}")
    if recorder:
        recorder.write(args.moe_counts, scenario.setup.micro_batch, scenario.setup.seq_len, scenario.name)
        print(f"routing counts (tokens per expert per layer, first micro-batch) written to {args.moe_counts}")
    return 0


def _moe_recorder(args, scenario):
    """capture --moe-counts FILE: a router hook on the real model (models/reference_moe.py), or None."""
    if not args.moe_counts:
        return None
    if args.device_kind == "cuda" or not getattr(scenario.model, "num_local_experts", None):
        raise ConfigError("moe_counts", "records the routers of a mixture-of-experts model (num_local_experts) "
                                        "in a CPU capture")
    from .models.reference_moe import RoutingRecorder
    return RoutingRecorder()


def cmd_validate_ranks(args, scenario) -> int:
    if args.plot:
        raise ConfigError("plot", "validate --world-size N prints one table per rank; --plot draws one run: drop it "
                                  "(or validate one rank's trace with --trace)")
    results, simulated = api.validate_ranks(scenario, backend=args.pg_backend or "gloo")
    if args.json:
        _write_json({"ranks": [validation_json(v) for v, _ in results]})
    else:
        for v, _ in results:
            print(render_validation(v, args.unit or "MiB"))
            print("")
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
        for note in notes:
            print(f"peakledger: {note}", file=sys.stderr)
        result, measured, simulated = api.validate(scenario, trace.log)
    else:
        scenario = real_run_scenario(args)
        if args.pg_backend is not None and scenario.setup.world_size == 1:
            raise ConfigError("pg_backend", "only applies to a real run of world_size > 1 (one process per rank)")
        check_real_run(args, scenario)
        if scenario.setup.world_size > 1:
            return cmd_validate_ranks(args, scenario)
        result, measured, simulated = api.validate(scenario)
    if args.plot:
        plot_overlay(timeline(measured), timeline(simulated), args.plot, title=f"{scenario.name}: measured vs predicted")
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="peakledger", description="Where the memory of a training step goes.")
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
    v.add_argument("--trace", metavar="FILE", help="compare against a saved trace (peakledger capture) instead of a new "
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
    k = sub.add_parser("capture", help="run real training steps on CPU and save the exact memory trace")
    _add_scenario_flags(k)
    k.add_argument("--output", required=True, metavar="FILE", help="versioned JSON trace (traces/store.py)")
    k.add_argument("--wall-times", action="store_true",
                   help="keep measured wall-clock times (default: event index, so the file is reproducible)")
    k.add_argument("--device-kind", default="cpu", choices=["cpu", "cuda"], help="where to run (cuda needs a GPU)")
    k.add_argument("--force", action="store_true", help="run even when the estimated host memory is over the limit")
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


def cmd_replay(args) -> int:
    """The allocator model (simulator/allocator.py) on a measured snapshot (analysis/allocator_replay.py)."""
    from .analysis.allocator_replay import replay_snapshot

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
              f"{f(d['reserved_peak']['predicted'])}; reserved equal after {d['reserved_exact_fraction']:.1%} of events")
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


class _Terminated(KeyboardInterrupt):
    """SIGTERM, raised where Python runs next so every `finally` (temporary files, worker pools) runs."""


def _on_sigterm(signum, frame):
    raise _Terminated()


def main(argv: list[str] | None = None) -> int:
    """Exit 0 on success (1: a validate outside its tolerance), 2 on bad input (one line naming it), 3 on an
    internal error (a bug: one line, the traceback with --debug), 130 / 143 when interrupted / terminated."""
    args = build_parser().parse_args(argv)
    previous = signal.signal(signal.SIGTERM, _on_sigterm) if threading.current_thread() is threading.main_thread() \
        else None
    try:
        check_common(args)
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
    except Exception as e:  # noqa: BLE001 - the one place an unexpected error becomes a message
        if getattr(args, "debug", False):
            traceback.print_exc()
        print(f"peakledger: internal error (a bug in peakledger, not your input): {type(e).__name__}: {e}"
              + ("" if getattr(args, "debug", False) else "; run again with --debug for the traceback"),
              file=sys.stderr)
        return 3
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    sys.exit(main())
