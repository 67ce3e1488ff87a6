"""The data-parallel engines, declared in one place: the registry `setup.data_parallel.engine` names one of, and
each engine's knob class.

Each `DpEngine` says what the rest of the project needs to know of an engine without running it:
- `name`: the value of `setup.data_parallel.engine` (and of `--dp-engine`, `[training] dp_engine`);
- its simulation is its class in models/parallel (`ENGINES` there: the class, or a function choosing one, as
  DeepSpeed's stages do, by direct reference; this module cannot import that package, which imports the config);
- `knobs`: its knob class (`DeepSpeedKnobs`, ...), a field of the setup's `DataParallel` section, with when the
  engine reads each knob; a knob set by the user that the setup never reads is refused
  (models/config/applies.py `check_given_knobs`);
- `summary`: one line for help texts.

Adding an engine is one module in models/parallel (its `Engine` subclass), its knob class and one `DpEngine(...)`
line below, a field of `DataParallel` for the knob class, and its class in models/parallel `ENGINES`
(tests/test_dp_engines.py holds the two registries to the same names); the flags, the scenario keys, the setup's
check and `make_engine` read these when they run. What an engine does is in its module; which engines another
feature composes with (pipeline, context and expert parallelism, the real multi-process runs) is said by that
feature, by name, and refuses the others. This module imports only models/knobs.py: models/config reads it to
check a setup, models/parallel reads it to build the engine.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from .knobs import Section, knob, section_knobs


@dataclass(frozen=True, eq=False)
class DeepSpeedKnobs(Section):
    """DeepSpeed's ZeRO config (`setup.data_parallel.deepspeed`): the stage and its bucket sizes, in elements."""

    zero_stage: int = knob(0, "data-parallel", "deepspeed: 0, 1, 2, 3")
    reduce_bucket_size: int = knob(500_000_000, "data-parallel", "deepspeed: elements per gradient reduce bucket",
                                   hidden=True)
    allgather_bucket_size: int = knob(500_000_000, "data-parallel", "deepspeed stages 1-2: elements per parameter "
                                      "all-gather", hidden=True)
    stage3_prefetch_bucket_size: int = knob(50_000_000, "data-parallel", "deepspeed stage 3: elements fetched ahead",
                                            hidden=True)
    stage3_max_live_parameters: int = knob(1_000_000_000, "data-parallel", "deepspeed stage 3: gathered elements "
                                           "kept at most", hidden=True)
    stage3_param_persistence_threshold: int = knob(100_000, "data-parallel", "deepspeed stage 3: smaller parameters "
                                                   "stay whole", hidden=True)
    offload_optimizer: str = knob("none", "data-parallel", "deepspeed stage 2: zero_optimization.offload_optimizer "
                                  "device (ZeRO-Offload: fp32 partition, its gradients and DeepSpeedCPUAdam's states "
                                  "in pinned host memory, the step on the CPU)", choices=("none", "cpu"),
                                  name="zero_offload_optimizer")


# fsdp2's MixedPrecisionPolicy.reduce_dtype: "grad" = torch's None (the gradients' own dtype, the param_dtype)
REDUCE_DTYPES = ("grad", "fp32", "bf16", "fp16")


@dataclass(frozen=True, eq=False)
class Fsdp2Knobs(Section):
    """torch fully_shard's arguments (`setup.data_parallel.fsdp2`)."""

    reshard_after_forward: bool = knob(True, "data-parallel", "fsdp2: keep unsharded parameters from forward to "
                                       "backward", cli="off")
    reduce_dtype: str = knob("grad", "data-parallel", "fsdp2: MixedPrecisionPolicy.reduce_dtype; default grad: the "
                             "gradients' own dtype, torch's None", choices=REDUCE_DTYPES)
    forward_prefetch: int = knob(0, "data-parallel", "fsdp2: units all-gathered ahead of the one running, in forward",
                                 hidden=True)
    backward_prefetch: int = knob(1, "data-parallel", "fsdp2: likewise in backward (FSDP2's default implicit "
                                  "prefetch is 1)", hidden=True)
    cpu_offload: bool = knob(False, "data-parallel", "fsdp2: CPUOffloadPolicy(pin_memory=True): sharded "
                             "parameters, gradients and optimizer states in pinned host memory, the step on the CPU",
                             cli="on", name="fsdp_cpu_offload")


@dataclass(frozen=True, eq=False)
class DdpKnobs(Section):
    """torch DistributedDataParallel's bucket size (`setup.data_parallel.ddp`), read by ddp and by
    zero-redundancy-optimizer (DDP underneath)."""

    bucket_cap_mb: int = knob(25, "data-parallel", "ddp / zero-redundancy-optimizer: DDP gradient bucket size "
                              "(MiB)", hidden=True, name="ddp_bucket_cap_mb")


@dataclass(frozen=True)
class DpEngine:
    name: str
    summary: str
    knobs: type[Section]  # its knob class, a field of the setup's data-parallel section
    # knob name -> (does this setup read it?, what it needs); a knob not listed is read whenever this engine runs
    applies: dict[str, tuple[Callable, str]] = field(default_factory=dict)
    unchecked: tuple[str, ...] = ()  # knobs whose use the setup's own check judges (a ZeRO stage under fsdp2)
    aliases: tuple[str, ...] = ()  # other names users give it, suggested when given (models/names.py), never taken


def _stage3(s) -> bool:
    return s.zero_stage == 3


DP_ENGINES: dict[str, DpEngine] = {e.name: e for e in (
    DpEngine("deepspeed", "DeepSpeed ZeRO 0-3 (--zero-stage)", DeepSpeedKnobs,
             {"reduce_bucket_size": (lambda s: s.world_size > 1, "dp_engine deepspeed on > 1 rank"),
              "allgather_bucket_size": (lambda s: s.zero_stage in (1, 2), "dp_engine deepspeed with zero_stage 1 or 2"),
              "stage3_prefetch_bucket_size": (_stage3, "zero_stage 3"),
              "stage3_max_live_parameters": (_stage3, "zero_stage 3"),
              "stage3_param_persistence_threshold": (_stage3, "zero_stage 3"),
              "zero_offload_optimizer": (lambda s: s.zero_stage == 2 and s.world_size > 1,
                                         "dp_engine deepspeed with zero_stage 2 on > 1 rank")},
             unchecked=("zero_stage",),
             aliases=("zero", "zero1", "zero2", "zero3", "ds")),
    DpEngine("fsdp2", "torch fully_shard per block, then the root", Fsdp2Knobs,
             {"fsdp_cpu_offload": (lambda s: s.world_size > 1, "dp_engine fsdp2 on > 1 rank")},
             aliases=("fsdp", "fsdp1", "fully_shard", "fully-sharded-data-parallel")),
    DpEngine("ddp", "torch DistributedDataParallel: replicas, gradient buckets all-reduced", DdpKnobs,
             aliases=("distributed-data-parallel",)),
    DpEngine("zero-redundancy-optimizer", "DDP with torch's ZeroRedundancyOptimizer", DdpKnobs,
             aliases=("zero-redundancy", "zero-optimizer")),
)}
ENGINE_NAMES = tuple(DP_ENGINES)
ENGINE_ALIASES = {alias: e.name for e in DP_ENGINES.values() for alias in e.aliases}


@dataclass(frozen=True, eq=False)
class DataParallel(Section):
    """The setup's data-parallel section (`setup.data_parallel`): the engine's name and every engine's knobs, each
    engine's in its own class above (a knob set for an engine that does not run is refused by the setup)."""

    engine: str = knob("deepspeed", "data-parallel", "default deepspeed: --zero-stage applies", choices=ENGINE_NAMES,
                       name="dp_engine")
    deepspeed: DeepSpeedKnobs = field(default_factory=DeepSpeedKnobs)
    fsdp2: Fsdp2Knobs = field(default_factory=Fsdp2Knobs)
    ddp: DdpKnobs = field(default_factory=DdpKnobs)


def knob_rules() -> dict[str, tuple[Callable, str]]:
    """knob name -> (applies to a setup's knobs?, what it needs) for every engine knob, as models/config/applies.py
    KNOB_APPLIES holds them: a knob several engines read applies under any of them."""
    owners: dict[str, list[tuple[str, tuple[Callable, str] | None]]] = {}
    for e in DP_ENGINES.values():
        for k in section_knobs(e.knobs):
            if k.name not in e.unchecked:
                owners.setdefault(k.name, []).append((e.name, e.applies.get(k.name)))
    out = {}
    for name, engines in owners.items():
        engines = tuple(engines)
        out[name] = (lambda s, engines=engines: any(s.dp_engine == e and (rule is None or rule[0](s))
                                                    for e, rule in engines),
                     _needs(engines))
    return out


def _needs(engines) -> str:
    """What a knob needs, said as its engines' rules say it: "dp_engine ddp or zero-redundancy-optimizer"."""
    if all(rule is None for _, rule in engines):
        return "dp_engine " + " or ".join(name for name, _ in engines)
    return " or ".join(rule[1] if rule is not None else f"dp_engine {name}" for name, rule in engines)
