"""`peakledger run SCRIPT.py [-- ARGS]`: the user's own training script, as it is, predicted on fake tensors (and
with --validate, also run for real on the CPU and held against the prediction)."""

from __future__ import annotations

import dataclasses
import shlex
from pathlib import Path
from typing import TYPE_CHECKING

from .analysis.export import write_chrome_trace, write_snapshot
from .analysis.host import judge_host
from .analysis.report import report_json
from .analysis.report_text import render_text
from .analysis.units import Scale, format_bytes
from .analysis.validate import render_validation, validation_json
from .cli_common import (
    add_check_flag,
    add_host_flags,
    budget_flag,
    budget_of,
    decide,
    fit_verdict,
    flag_float,
    flag_int,
    host_json,
    host_limits,
    write_json,
)
from .inputs import check_command_outputs
from .models.config import ConfigError
from .models.devices import DEVICES
from .models.names import did_you_mean
from .progress import progress
from .simulator.allocator import TORCH_VERSIONS
from .simulator.torch_rules import default_version

if TYPE_CHECKING:
    from .script import ScriptRun

DEFAULT_STEPS = 2


def run_of(args) -> ScriptRun:
    from .script import ScriptRun  # torch, loaded for `run` only (every other command starts without it)

    device = args.device or "cpu"
    if device not in DEVICES:
        raise ConfigError("device", f"{device!r} is not a device profile; allowed: {', '.join(DEVICES)}"
                                    f"{did_you_mean(device, DEVICES)}")
    version = args.torch_version or default_version()
    if version not in TORCH_VERSIONS:
        raise ConfigError("torch_version", f"{version!r} is not modelled; allowed: {', '.join(TORCH_VERSIONS)}"
                                           f"{did_you_mean(version, TORCH_VERSIONS)}")
    steps = DEFAULT_STEPS if args.steps is None else args.steps
    if steps < 0:
        raise ConfigError("steps", f"must be >= 1 (optimizer steps to run), or 0 for the whole script; got {steps}")
    argv = list(getattr(args, "script_args", ()))
    world = 1 if args.world_size is None else args.world_size
    if not 1 <= world <= 1 << 20:
        raise ConfigError("world_size", f"must be a number of ranks in [1, {1 << 20}], got {world}")
    return ScriptRun(args.script, tuple(argv), steps or None, device, version, args.alloc_conf or "",
                     args.module_timeout, world)


def header(report, unit: str) -> list[str]:
    """What the script did and what it ran on: the loop discovered, the values given, the libraries."""
    s = report.metadata.script
    c = s["calls"]
    mbs = sorted(set(c["micro_batches"]))
    per_step = (f"{mbs[0]} micro-batch{'es' if mbs[0] != 1 else ''} (backward calls) each" if len(mbs) == 1 else
                f"{'/'.join(str(m) for m in c['micro_batches'])} micro-batches") if mbs else "no backward"
    asked = s["steps_asked"]
    stop = (f"stopped at the first training forward after step {asked} (--steps {asked})"
            if asked is not None and c["optimizer_steps"] >= asked else "ran to the script's end")
    world = s.get("world_size", 1)
    held = c.get("outputs_held", 0)
    outputs = ("" if not c["backwards"] else
               "; the forward's outputs (logits) held through backward, as `out = model(batch)` keeps them"
               if held == c["backwards"] else
               "; the forward's outputs dropped before backward, as HF Trainer's compute_loss drops them"
               if held == 0 else f"; the forward's outputs held through {held} of {c['backwards']} backwards")
    lines = [f"  loop (the script's own, discovered): {c['optimizer_steps']} optimizer step"
             f"{'s' if c['optimizer_steps'] != 1 else ''} of {', '.join(c['optimizers']) or 'no optimizer'}, "
             f"{per_step}{outputs}; models called: {', '.join(c['models']) or 'none'}; {stop}",
             f"  calls: {c['forwards']} training forwards, {c['backwards']} backwards, {c['zero_grads']} zero_grads, "
             f"{c['clips']} gradient clips, {c['evals']} eval forwards, {c['saves']} saves, {c['generates']} "
             f"generates",
             f"  program: {s['program']}" + (f"; {world} ranks (torch's fake process group), recorded: "
                                              f"{', '.join(report.metadata.rank_class_ranges)}" if world > 1 else "")
             + "; versions: "
             + ", ".join(f"{k} {v}" for k, v in s["versions"].items())]
    if s["stand_ins"]:
        lines.append(f"  values read that fake tensors do not have, given stand-ins (1.0, 1, False; "
                     f"memory does not depend on them): {'; '.join(s['stand_ins'][:6])}"
                     + (f"; and {len(s['stand_ins']) - 6} more places" if len(s["stand_ins"]) > 6 else ""))
    return lines


def try_lines(report, tries: list, budget: int | None, unit: str | None) -> list[str]:
    """The script's own knobs tried (--try), each re-run on fake tensors: fitting the budget first, then lowest."""
    base = report.capacity_needed
    rows = sorted(tries, key=lambda t: (budget is not None and t[1].capacity_needed > budget, t[1].capacity_needed))
    g = Scale.of([base] + [r.capacity_needed for _, r in rows], unit)  # one unit for the table
    f = g.number
    lines = [f"the script's own arguments changed (--try), each run again on fake tensors ({g.unit}"
             + (f"; budget {format_bytes(budget, g.unit)}" if budget is not None else "") + "):",
             f"  {'change':<36}{'needs':>14}{'vs as given':>16}" + ("  fits" if budget is not None else "")]
    for text, r in rows:
        need = r.capacity_needed
        lines.append(f"  {text:<36}{f(need):>14}{('+' if need >= base else '') + f(need - base):>16}"
                     + (f"  {'yes' if fit_verdict(r, budget, 0.0).fits else 'no'}" if budget is not None else ""))
    lines.append(f"  {'(as given)':<36}{f(base):>14}")
    return lines


def cmd_run(args) -> int:
    from .script import predict_script, validate_script, with_args  # torch: for `run` only

    check_command_outputs(args, ["plot", "export_snapshot", "export_chrome"])
    run = run_of(args)
    budget = budget_flag(args)
    if args.check and budget is None:
        budget = budget_of(args, run, "--check")  # (a ScriptRun names its device as a scenario does)
    with progress(f"running {Path(run.path).name} on fake tensors"):
        report, graph = predict_script(run, budget)
    tries = []
    for text in args.tries or ():
        change = shlex.split(text)
        if not change or not change[0].startswith("-"):
            raise ConfigError("try", f"{text!r} is not a change to the script's arguments: give flags, e.g. "
                                     "'--micro-batch 2'")
        changed = dataclasses.replace(run, argv=with_args(run.argv, change), name=run.title + f" [{text}]")
        with progress(f"running {Path(run.path).name} with {text} on fake tensors"):
            tries.append((text, predict_script(changed, budget)[0]))
    validations = []
    if args.validate:
        with progress(f"running {Path(run.path).name} for real on the CPU, tracked"):
            validations = validate_script(run, report)
    if args.plot:
        from .analysis.plot import plot_timeline
        from .simulator.timeline import timeline

        plot_timeline(timeline(report.log, report.peaks.rank), args.plot, unit=args.unit,
                      title=f"device memory of {run.title} over the run (the script on fake tensors)", budget=budget)
    if args.export_snapshot:
        write_snapshot(report.log, args.export_snapshot)
    if args.export_chrome:
        write_chrome_trace(report.log, args.export_chrome, graph)
    host = judge_host(report.log, run.device, host_limits(args),  # the node's host (analysis/host.py); None: not
                      report.index)
    verdict = fit_verdict(report, budget, 0.0, host) if args.check else None
    code = 1 if verdict is not None and not verdict.fits else 0
    if args.tolerance is not None and not all(v.passes(args.tolerance) for v in validations):
        code = 1
    code = decide(args, code)
    if args.json:
        write_json({**report_json(report), "script": report.metadata.script,
                     **({"tries": [{"args": t, "peak": r.peaks.overall.bytes, "capacity_needed": r.capacity_needed,
                                    "fits": None if budget is None else fit_verdict(r, budget, 0.0).fits}
                                   for t, r in tries]} if tries else {}),
                     **({"validation": validation_json(validations[0]),
                         "validation_by_rank": [validation_json(v) for v in validations]} if validations else {}),
                     **({"fit_check": verdict.as_json()} if verdict is not None else {}), **host_json(args, host)})
        return code
    text = render_text(report, args.unit).split("\n")
    print("\n".join(text[:1] + header(report, args.unit) + text[1:]))
    if tries:
        print()
        print("\n".join(try_lines(report, tries, budget, args.unit)))
    for v in validations:
        print()
        print(render_validation(v, args.unit))
    written = [x for x in (args.plot, args.export_snapshot, args.export_chrome) if x]
    if written:
        print(f"written: {', '.join(written)}")
    if host is not None and host.said:
        print("\n".join(host.lines(args.unit)[:1 if verdict is not None else 2]))
    if verdict is not None:
        print(verdict.line(args.unit))
    return code


def register(sub) -> None:
    r = sub.add_parser("run", help="your own training script, as it is: run on fake tensors, its memory predicted",
                       description="Run SCRIPT.py as it is on fake tensors: its models, optimizers, data and steps "
                                   "are its own; the report is simulate's. The script's own arguments follow --: "
                                   "peakledger run train.py --steps 3 -- --lr 1e-4")
    r.add_argument("script", metavar="SCRIPT.py")
    r.add_argument("--steps", type=flag_int, help=f"optimizer steps to run (default {DEFAULT_STEPS}; the run stops "
                                                  "at the next training forward); 0: the whole script")
    r.add_argument("--device", help="the device profile: cpu (default) or a GPU, " + ", ".join(DEVICES))
    r.add_argument("--torch-version", help="whose CUDA rules apply on a GPU profile: 2.6, 2.11 or 2.13; default: "
                                           "the installed torch's, else the nearest modelled")
    r.add_argument("--alloc-conf", metavar="CONF", help="CUDA caching allocator settings (PYTORCH_CUDA_ALLOC_CONF)")
    r.add_argument("--world-size", type=flag_int, help="a distributed script (torchrun's environment, "
                   "init_process_group) runs as this many ranks (default 1): each rank class is recorded with torch's "
                   "fake process group")
    r.add_argument("--budget", help="device capacity (80GiB, 24G, 80GB): record the first OOM")
    add_check_flag(r)
    add_host_flags(r)
    r.add_argument("--try", dest="tries", action="append", metavar="'ARGS'",
                   help="a change to the script's own arguments to predict too (repeat): '--micro-batch 2', "
                        "'--gradient_checkpointing', '--lr=1e-4'; each is run on fake tensors and compared with the "
                        "script as given, fitting the budget first")
    r.add_argument("--validate", action="store_true",
                   help="also run the script for real on the CPU under the allocation tracker and compare")
    r.add_argument("--tolerance", type=flag_float, help="with --validate: exit 1 when the peak is off by more")
    r.add_argument("--time-limit", dest="module_timeout", type=flag_float, metavar="SECONDS",
                   help="the longest the script may run, each time (default 600; 0: no limit)")
    r.add_argument("--json", action="store_true", help="print one JSON object")
    r.add_argument("--plot", metavar="FILE", help="write a PNG of occupancy by category over time")
    r.add_argument("--export-snapshot", metavar="FILE", help="a CUDA memory snapshot pickle of the run")
    r.add_argument("--export-chrome", metavar="FILE", help="a Chrome trace JSON of the run")
    r.add_argument("--unit", choices=["GiB", "GB", "MiB", "MB"], help="print sizes in this unit (default GiB)")
    r.add_argument("--debug", action="store_true", help="on an internal error, print the whole traceback")
    r.set_defaults(func=cmd_run)


__all__ = ["cmd_run", "register"]
