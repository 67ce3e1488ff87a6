"""The measuring commands: `peakledger validate` (a scenario run for real on this CPU, or a saved trace, held
against its simulation) and `peakledger capture` (real training steps on the CPU or a CUDA GPU saved as a trace)."""

from __future__ import annotations

import dataclasses
import sys

from . import (
    inputs,  # its host limit by attribute: a test gives another
    validation,
)
from .analysis.device import device_settings, gpu_memory
from .analysis.units import format_bytes
from .analysis.validate import PeakPair, compare_logs, render_validation, validation_json
from .cli_common import add_scenario_flags, decide, flag_float, write_json
from .inputs import (
    VALIDATE_DEFAULTS,
    check_command_outputs,
    check_real_run,
    host_need,
    real_run_scenario,
    scenario_for_trace,
)
from .models.config import ConfigError
from .models.devices import DEVICES, device_profile
from .models.families import family_of
from .models.training import describe
from .progress import progress
from .simulator.allocator import AllocatorConfig
from .simulator.engine import simulate
from .simulator.safe_io import InputError
from .simulator.timeline import timeline
from .traces import cuda_capture  # its GPU probe and capture by attribute: a test stands in for them
from .traces.cuda_capture import allocator_rules, check_capturable, is_cuda_trace
from .traces.store import load_trace, save_log, with_event_index_times


def cmd_capture(args) -> int:
    if args.wall_times and args.device_kind == "cuda":
        raise ConfigError("wall_times", "applies to CPU captures; a CUDA snapshot keeps the allocator's own times")
    check_command_outputs(args, ["output", "moe_counts"])
    scenario = real_run_scenario(args)
    if args.device_kind == "cuda":
        return _capture_cuda(args, scenario)
    check_real_run(args, scenario)
    recorder = _moe_recorder(args, scenario)
    with progress(f"running {scenario.name} for real under the tracker"):
        log = validation.measure(scenario, model_hook=recorder.attach if recorder else None)
    save_log(log if args.wall_times else with_event_index_times(log), args.output)
    peak = max(timeline(log).total, default=0)
    print(f"captured {len(log.events):,} events of {scenario.name} (peak {int(peak):,} B) into {args.output}")
    if recorder:
        recorder.write(args.moe_counts, scenario.setup.batch.micro_batch, scenario.setup.batch.seq_len, scenario.name)
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
    print(f"captured {len(trace.allocated.events):,} CUDA allocator events of {scenario.name} on {meta.gpu} (peak "
          f"{trace.peak_bytes(allow_truncated=True):,} B allocated, {meta.reserved_peak:,} B reserved; steps "
          f"1-{scenario.setup.batch.steps}) into {args.output}; the raw snapshot is {snapshot}")
    if trace.truncated:
        print(f"peakledger: the snapshot is truncated ({'; '.join(trace.problems[:2])}): its peaks are lower bounds",
              file=sys.stderr)
    outside = meta.step_labels["outside"]
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
    if args.device_kind == "cuda" or not family_of(scenario.model).experts:
        raise ConfigError("moe_counts", "records the routers of a mixture-of-experts model (num_local_experts) "
                                        "in a CPU capture")
    from .traces.reference.mixtral import RoutingRecorder
    return RoutingRecorder()


def cmd_validate_ranks(args, scenario) -> int:
    if args.plot:
        raise ConfigError("plot", "validate --world-size N prints one table per rank; --plot draws one run: drop it "
                                  "(or validate one rank's trace with --trace)")
    with progress(f"running {scenario.setup.mesh.world_size} ranks of {scenario.name} for real, then simulating"):
        results, simulated = validation.validate_ranks(scenario, backend=args.pg_backend or "gloo")
    if args.tolerance is not None:
        worst = max((v for v, _ in results), key=lambda v: abs(v.overall.error))
        ok = worst.passes(args.tolerance)
        decide(args, 0 if ok else 1)
    if args.json:
        write_json({"ranks": [validation_json(v) for v, _ in results]})
    else:
        for v, _ in results:
            print(render_validation(v, args.unit))
            print("")
    if scenario.setup.mesh.pp > 1 and not args.json:  # what the stages hold apart: first stage vs last stage
        first, last = results[0][0].overall, results[-1][0].overall
        print(f"last stage - first stage peak: measured {last.measured - first.measured:+,} B, predicted "
              f"{last.predicted - first.predicted:+,} B")
    if args.tolerance is not None:
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
            with progress(f"simulating {scenario.name} against {args.trace}"):
                result, measured, simulated = validation.validate(scenario, trace.log)
    else:
        scenario = real_run_scenario(args)
        if args.pg_backend is not None and scenario.setup.mesh.world_size == 1:
            raise ConfigError("pg_backend", "only applies to a real run of world_size > 1 (one process per rank)")
        check_real_run(args, scenario)
        if scenario.setup.mesh.world_size > 1:
            return cmd_validate_ranks(args, scenario)
        with progress(f"running {scenario.name} for real under the tracker, then simulating"):
            result, measured, simulated = validation.validate(scenario)
    if args.plot:
        from .analysis.plot import plot_overlay  # matplotlib, loaded for the picture only

        plot_overlay(timeline(measured), timeline(simulated), args.plot, unit=args.unit,
                     title=f"{scenario.name}: measured vs predicted")
    ok = result.passes(args.tolerance) if args.tolerance is not None else True
    decide(args, 0 if ok else 1)
    if args.json:
        write_json(validation_json(result))
    else:
        print(render_validation(result, args.unit))
    if args.tolerance is not None:
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
    gpu = meta.gpu or (meta.device if isinstance(meta.device, str) else None)
    cuda_profiles = ", ".join(n for n, p in DEVICES.items() if p.is_cuda)
    if args.device is not None:
        device = args.device
        notes.append(f"simulating on {device} (--device)" + (f"; the trace ran on {gpu}" if gpu else ""))
    elif meta.device_profile:
        device = meta.device_profile
        notes.append(f"simulating on {device}, the profile of {gpu or 'the GPU the trace ran on'}")
    elif meta.compute_capability is not None:
        cc = ".".join(str(x) for x in meta.compute_capability)
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
    elif meta.allocator_rules or meta.torch_version:
        rules = meta.allocator_rules or allocator_rules(meta.torch_version)
        notes.append(f"allocator rules of torch {rules}" + (f" (the trace ran torch {meta.torch_version})"
                                                             if meta.torch_version else ""))
    else:
        rules = scenario.torch_version
    recorded = scenario.alloc_conf if meta.alloc_conf is None else meta.alloc_conf
    conf = args.alloc_conf if args.alloc_conf is not None else recorded
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
    graph.metadata = graph.metadata.updated(**device_settings(scenario))
    simulated = simulate(graph, simulator=scenario.simulator)
    result = compare_logs(measured, simulated, name=scenario.name)
    result.host = None  # a CUDA snapshot sees the device's allocator only: the host is not measured
    reserved = measured.metadata.reserved_peak
    if reserved is None and trace.reserved is not None:
        running = reserved = 0
        for e in trace.reserved.events:
            running += e.delta
            reserved = max(reserved, running)
    dm = gpu_memory(simulated, 0)
    if isinstance(reserved, int) and dm is not None:
        result.reserved = PeakPair("reserved (allocator)", reserved, dm.reserved_peak.reserved)
    return result, measured, simulated


def register(sub) -> None:
    """Add validate and capture to the `peakledger` parser's sub-commands."""
    v = sub.add_parser("validate", help="run the scenario for real on CPU and hold the simulation against it")
    add_scenario_flags(v)
    v.add_argument("--tolerance", type=flag_float, help="exit 1 when |peak error| is larger (0.01 = 1%%)")
    v.add_argument("--plot", metavar="FILE", help="PNG overlaying measured and predicted totals")
    v.add_argument("--json", action="store_true")
    v.add_argument("--pg-backend", choices=["gloo", "fake"],
                   help="--world-size > 1: real gloo processes on 127.0.0.1, or torch's fake process group")
    v.add_argument("--trace", metavar="FILE",
                   help="compare against a saved trace (peakledger capture) instead of a new "
                        "run; its recorded scenario is used, flags override fields of it")
    v.add_argument("--force", action="store_true", help="run even when the estimated host memory is over the limit")
    v.set_defaults(func=cmd_validate)
    k = sub.add_parser("capture", help="run real training steps on CPU (or a CUDA GPU: --device-kind cuda) and save "
                                       "the exact memory trace")
    add_scenario_flags(k)
    k.add_argument("--output", required=True, metavar="FILE", help="versioned JSON trace (traces/store.py)")
    k.add_argument("--wall-times", action="store_true",
                   help="keep measured wall-clock times (default: event index, so the file is reproducible)")
    k.add_argument("--device-kind", default="cpu", choices=["cpu", "cuda"], help="where to run (cuda needs a GPU)")
    k.add_argument("--force", action="store_true", help="run even when the estimated host memory is over the limit "
                                                          "(cuda: or the predicted device memory over the GPU's free)")
    k.add_argument("--moe-counts", metavar="FILE", help="mixture of experts: also write the tokens each expert "
                   "received per layer in the run's first micro-batch (for --moe-routing counts:FILE)")
    k.set_defaults(func=cmd_capture)
