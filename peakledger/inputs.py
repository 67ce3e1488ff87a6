"""The CLI's input boundary: command-line flags and files into a checked Scenario, outputs checked before
any work, measured traces read whatever their format, and the cost of a real run estimated before it starts.

Every problem found here is an `InputError` (a `ConfigError` for scenario fields, a `TraceFormatError`
for traces) naming the flag, key or file, what was wrong and what is allowed; the CLI prints it as one
line and exits 2. The checks of each value live with its schema (models/config.py, peakledger/scenario.py,
traces/store.py, traces/cuda_snapshot/); this module only decides which inputs a command has.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass

from .analysis.device import gpu_memory
from .analysis.units import format_bytes
from .models.config import KNOBS, SETUP_KNOBS, ConfigError, dtype_bytes
from .models.families import FAMILIES
from .models.fields import by_name, keys_of
from .models.traced.model import TracedModel, from_module_spec
from .models.training import describe
from .scenario import Scenario, build_scenario, lists_as_tuples, load_toml
from .simulator.engine import simulate
from .simulator.events import Category, Phase, Pool
from .simulator.run_metadata import RunMetadata
from .simulator.safe_io import check_outputs
from .simulator.timeline import timeline
from .traces.store import TraceFile

MODEL_FLAG_TYPES = [("family", str), ("n_layer", int), ("d_model", int), ("n_head", int), ("n_kv_head", int),
                    ("head_dim", int), ("d_ff", int), ("vocab_size", int), ("max_seq_len", int), ("dropout", float),
                    ("attention", str), ("experts_implementation", str)]
MODEL_FLAGS = [name for name, _ in MODEL_FLAG_TYPES]
TRAINING_KNOBS = {k.name: k for k in SETUP_KNOBS if k.knob.cli != "none"}  # with a flag each
RUN_FLAGS = ["device", "headroom", "alloc_conf", "empty_cache_before_save", "torch_version", "simulator"]
SOURCE_FLAGS = ["scenario", "preset", "hf_config", "module"]
MODEL_SOURCES = ["preset", "hf_config", "module"]


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def given_flags(args) -> dict[str, dict]:
    """What the user set on the command line: {"model": ..., "training": ..., "run": ...} (never defaults)."""
    model = {n: getattr(args, f"model_{n}") for n in MODEL_FLAGS if getattr(args, f"model_{n}", None) is not None}
    training = {n: getattr(args, n) for n in TRAINING_KNOBS if getattr(args, n, None) is not None}
    training.update({n: tuple(v) for n, v in training.items() if isinstance(v, list)})  # (a repeated flag's)
    run = {n: getattr(args, n) for n in RUN_FLAGS if getattr(args, n, None) is not None}
    return {"model": model, "training": training, "run": run}


def scenario_flags_given(args) -> list[str]:
    """The scenario flags set on the command line, as the user typed them."""
    given = given_flags(args)
    return [flag(n) for n in SOURCE_FLAGS if getattr(args, n, None)] + [flag(n) for n in given["model"]] + \
        [TRAINING_KNOBS[n].flag for n in given["training"]] + [flag(n) for n in given["run"]]


def scenario_from_args(args, defaults: dict | None = None) -> Scenario:
    """The scenario of a command: a TOML file (`--scenario`), a preset or an HF config, and flags on top.
    `defaults` are the command's own training values, used where neither the file nor a flag sets one."""
    data = load_toml(args.scenario) if args.scenario else {}
    model = dict(data.get("model", {}))
    training = dict(data.get("training", {}))
    run = dict(data.get("run", {}))
    given_sources = [n for n in MODEL_SOURCES if getattr(args, n, None) is not None]
    if "module" in model and not given_sources:
        named = str(model["module"])[:80]
        raise ConfigError("scenario", f"{args.scenario} names a Python file to run (module = {named!r}): a "
                                      "scenario file never names code; give it on the command line with --module")
    if len(given_sources) > 1:
        raise ConfigError(given_sources[0], f"give one of {', '.join(flag(n) for n in given_sources)}, not both")
    if given_sources:
        for n in MODEL_SOURCES:
            model.pop(n, None)
        model[given_sources[0]] = getattr(args, given_sources[0])
    if getattr(args, "describer", None) is not None:
        model["describer"] = args.describer
    given = given_flags(args)
    model.update(given["model"])
    training.update(given["training"])
    run.update(given["run"])
    return build_scenario(model, training, run, name=data.get("name"), defaults=defaults)


def recorded_scenario(metadata: RunMetadata) -> Scenario | None:
    """The scenario a measured trace records (`peakledger capture` writes model, model_kind, setup and
    scenario into its metadata), or None when it records none (a CUDA snapshot, a trace from elsewhere). The
    setup is already read (traces/store.py `read_setup`); the model config is read here."""
    model, training, kind = metadata.model, metadata.setup, metadata.model_kind
    classes = {f.config.__name__: f.config for f in FAMILIES}  # each family's config class (models/families/)
    if not (isinstance(model, dict) and training is not None and
            kind in classes):
        return None
    cls = classes[kind]
    try:
        config = cls(**by_name(cls, {k: v for k, v in lists_as_tuples(model).items() if k in keys_of(cls)}))
        if isinstance(config, TracedModel):  # (a module's file is the user's --module: `_recorded_module`)
            config = dataclasses.replace(config, varies=tuple(config.varies),
                                         defaults=tuple(tuple(d) for d in config.defaults))
    except (TypeError, ConfigError) as e:
        raise ConfigError("trace", f"the scenario recorded in the trace is not one this peakledger reads: {e}") \
            from None
    name = config.name if metadata.scenario is None else metadata.scenario
    return Scenario(name=str(name), model=config, setup=training, device="cpu")


def scenario_for_trace(args, trace: TraceFile, defaults: dict) -> tuple[Scenario, list[str]]:
    """validate --trace: the scenario recorded in the trace, with the flags given on top (each one said), or
    the flags alone when the trace records none. Returns the scenario and what was said about it."""
    recorded = recorded_scenario(trace.log.metadata)
    module_notes = []
    if recorded is not None and isinstance(recorded.model, TracedModel) and recorded.model.kind == "module":
        recorded = _recorded_module(args, trace, recorded)
        args = argparse.Namespace(**{**vars(args), "module": None})  # (the recorded scenario's own model now)
        module_notes = [f"the traced module: {recorded.model.source} (its sha256 is the trace's)"]
    if recorded is None:
        if not any(getattr(args, n, None) for n in SOURCE_FLAGS):
            raise ConfigError("trace", f"{trace.path} ({trace.kind}) records no scenario (model and training "
                                       "setup): give the one that produced it with --preset, --hf-config or "
                                       "--scenario")
        return scenario_from_args(args, defaults), [f"{trace.path} records no scenario: simulating the one the "
                                                    "flags give"]
    if any(getattr(args, n, None) for n in SOURCE_FLAGS):
        source = next(flag(n) for n in SOURCE_FLAGS if getattr(args, n, None))
        return scenario_from_args(args, defaults), [f"{source} overrides the scenario recorded in {trace.path} "
                                                    f"({recorded.name})"]
    given = given_flags(args)
    changes = {**given["model"], **given["training"], **{k: v for k, v in given["run"].items()
                                                                 if k != "device"}}
    if changes.get("world_size", recorded.setup.mesh.world_size) != recorded.setup.mesh.world_size:
        raise ConfigError(
            "world_size",
            f"{trace.path} was measured with world_size {recorded.setup.mesh.world_size}: its "
            "ranks are fixed by the run; capture a trace of the other world size",
        )
    scenario = recorded.with_changes(**changes) if changes else recorded
    notes = [f"scenario recorded in {trace.path}: {recorded.name}"] + module_notes
    names = keys_of(type(recorded.model))  # a model field by its key (models/fields.py)
    for key, value in changes.items():
        in_model = getattr(recorded.model, names.get(key, key), getattr(recorded, key, None))
        old = recorded.setup.knob(key) if key in KNOBS else in_model
        if old != value:
            notes.append(f"overrode {key}: {old!r} in the trace, {value!r} from {flag(key)}")
    return scenario, notes


def _recorded_module(args, trace: TraceFile, recorded: Scenario) -> Scenario:
    """A trace of a user's Python module: the trace says which file and factory, and their sha256, but data never
    names code to run (nor a file to read). The user gives the module with --module; it must be the traced
    factory of a file with the traced bytes. The recorded scenario with the user's file is returned."""
    traced = recorded.model
    if not getattr(args, "module", None):
        raise ConfigError("module", f"{trace.path} was recorded from the Python file {traced.source[:200]}: a trace "
                                    "never names code to run, so give that file with --module PATH:FACTORY (its "
                                    "bytes are checked against the trace's sha256)")
    if any(getattr(args, n, None) for n in SOURCE_FLAGS if n != "module"):
        raise ConfigError("module", "give the traced module with --module alone, not with another model source")
    named = from_module_spec(args.module)
    if named.source.rpartition(":")[2] != traced.source.rpartition(":")[2] or named.digest != traced.digest:
        raise ConfigError("module", f"{args.module} is not the factory {trace.path} was recorded from "
                                    f"({traced.source[:200]}, sha256 {str(traced.digest)[:12]}...; this file's is "
                                    f"{named.digest[:12]}...): give the file as it was traced")
    return dataclasses.replace(recorded, model=dataclasses.replace(traced, source=named.source))


def check_command_outputs(args, outputs: list[str]) -> None:
    """The command's output flags (those given) against each other and its input files, before any work."""
    paths = {flag(n): getattr(args, n) for n in outputs if getattr(args, n, None) is not None}
    if getattr(args, "command", None) == "capture" and getattr(args, "device_kind", None) == "cuda" and args.output:
        paths["--output (its .snapshot.pickle)"] = args.output + ".snapshot.pickle"
    inputs = {flag(n): getattr(args, n) for n in ("scenario", "hf_config", "trace") if getattr(args, n, None)}
    if getattr(args, "module", None):
        inputs["--module"] = args.module.rpartition(":")[0] or args.module
    check_outputs(paths, inputs)


HOST_BASELINE = 600 << 20  # bytes: one Python process with torch imported, before any tensor (measured ~0.5 GiB)


def real_run_limit() -> int:
    """Half of this machine's memory: a real validate / capture run that needs more is refused (--force)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2
    except (ValueError, OSError, AttributeError):
        return 8 << 30


def real_run_estimate(scenario: Scenario) -> int:
    """Host memory a real CPU run of `scenario` needs: the simulated peak of every rank on the "cpu" profile
    (device and host pools: on a CPU both are host memory) plus one torch process per rank."""
    graph = describe(scenario.model, scenario.setup.replace(steps=min(scenario.setup.batch.steps, 2)), "cpu")
    log = simulate(graph)
    total = 0
    for rank, members in graph.metadata.rank_classes.items():
        peak = sum(timeline(log, int(rank), pool).peak().bytes for pool in {e.block.pool for e in log.events})
        total += (peak + HOST_BASELINE) * len(members)
    return total


CUDA_HOST_BYTES = 2 << 30  # assumption: host memory of the CUDA driver, runtime and libraries (cuBLAS, cuDNN)


@dataclass(frozen=True)
class CaptureNeed:
    """What a capture of a scenario needs, from its simulation on a GPU profile."""

    profile: str
    host: int  # bytes of host memory the process holds at most (`host_need`)
    build: int  # of which: the model built on the host (fp32) before it moves to the GPU
    device: int  # the predicted device total (reserved + CUDA context), or the allocated peak on a CPU profile


def host_need(scenario, profile: str, torch_version: str = "2.6", alloc_conf: str = "") -> CaptureNeed:
    """Simulate the scenario on `profile` and say what a CUDA capture of it holds: on the host, the model as
    `build_model` makes it (every floating parameter and buffer in fp32, before the cast and the move) or the
    run's host pool (offloaded states, saved activations), whichever is larger, plus one torch process
    (HOST_BASELINE) and the CUDA libraries (CUDA_HOST_BYTES, assumed); on the device, the simulated total."""
    setup = scenario.setup.replace(steps=min(scenario.setup.batch.steps, 2))
    graph = describe(scenario.model, setup, profile, torch_version=torch_version)
    graph.metadata = graph.metadata.updated(alloc_conf=alloc_conf, torch_version=torch_version)
    log = simulate(graph)
    build = 0
    for e in log.events:
        b = e.block
        if e.phase is Phase.LOAD and e.delta > 0 and b.pool is Pool.DEVICE and \
                b.category in (Category.PARAMETER, Category.BUFFER):
            build += b.nbytes * 4 // dtype_bytes(b.dtype) if b.dtype in ("bf16", "fp16") else b.nbytes
    host_pool = timeline(log, 0, Pool.HOST).peak().bytes if any(e.block.pool is Pool.HOST for e in log.events) else 0
    dm = gpu_memory(log, 0)
    device = dm.total_peak.total if dm is not None else timeline(log, 0).peak().bytes
    return CaptureNeed(profile, max(build, host_pool) + HOST_BASELINE + CUDA_HOST_BYTES, build, device)


REAL_RUN_STEPS = 100  # validate / capture: optimizer steps run for real at most
VALIDATE_DEFAULTS = {"precision": "fp32", "micro_batch": 2, "seq_len": 32}  # seconds on a CPU, for any model


def real_run_scenario(args):
    """validate and capture run for real on this CPU: the tiny GPT by default, and unless a scenario file
    or a flag says otherwise fp32 at micro-batch 2, seq 32 (an MLP has no sequence)."""
    if not (args.scenario or args.preset or args.hf_config or getattr(args, "module", None)):
        args.preset = "tiny"
    return scenario_from_args(args, defaults=None if args.scenario else VALIDATE_DEFAULTS)


def check_real_run(args, scenario) -> None:
    """A real run on this CPU first estimates its memory and refuses what would not fit (unless --force)."""
    if scenario.setup.batch.passes != "train":
        raise ConfigError("passes", f"{args.command} runs real training steps (forward, loss, backward, optimizer "
                                    "step); passes \"forward\" is simulated only: drop --passes")
    if scenario.setup.batch.steps > REAL_RUN_STEPS:
        raise ConfigError(
            "steps",
            f"{scenario.setup.batch.steps:,} is over the limit of {REAL_RUN_STEPS} for a real run "
            f"({args.command} runs every step for real; the simulation takes any number)",
        )
    need, limit = real_run_estimate(scenario), real_run_limit()
    if need > limit and not args.force:
        raise ConfigError("force", f"a real run of {scenario.name} needs about {format_bytes(need, 'GiB')} of host "
                                   f"memory (simulated CPU peak of every rank plus torch), over the limit of "
                                   f"{format_bytes(limit, 'GiB')} (half of this machine's memory): choose a smaller "
                                   "model or micro-batch, or pass --force to run it anyway")


def check_common(args) -> None:
    """Flags whose meaning does not depend on the command: refused where they would be ignored."""
    if getattr(args, "json", False) and args.unit is not None:
        raise ConfigError("unit", "--json always gives bytes; --unit sets the text output's unit: drop one")
    tolerance = getattr(args, "tolerance", None)
    if tolerance is not None and not (0 <= tolerance < float("inf")):
        raise ConfigError("tolerance", f"must be a finite number >= 0 (0.01 = 1%), got {tolerance!r}")
    timeout = getattr(args, "module_timeout", None)
    if timeout is not None:
        if not getattr(args, "module", None) and args.command != "run":
            raise ConfigError("module_timeout", "only applies with --module (a Python file's factory); drop it")
        if not (0 <= timeout <= 86400):
            raise ConfigError("module_timeout", f"must be seconds in [0, 86400] (0: no limit), got {timeout!r}")


__all__ = ["real_run_scenario", "check_real_run", "check_common", "scenario_from_args", "scenario_for_trace",
           "recorded_scenario", "given_flags", "scenario_flags_given",
           "check_command_outputs", "real_run_estimate", "real_run_limit"]
