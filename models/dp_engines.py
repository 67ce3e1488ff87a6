"""The data-parallel engines, declared in one place: the registry `TrainingSetup.dp_engine` names one of.

Each `DpEngine` says what the rest of the project needs to know of an engine without running it:
- `name`: the value of `dp_engine` (and of `--dp-engine`, `[training] dp_engine`);
- its simulation is its class in models/parallel (`ENGINES` there: the class, or a function choosing one, as
  DeepSpeed's stages do, by direct reference; this module cannot import that package, which imports the config);
- `knobs`: the TrainingSetup fields only this engine reads, each with when it reads them and how to say so; a
  knob set by the user that the setup never reads is refused (models/config.py `check_given_knobs`);
- `summary`: one line for help texts.

Adding an engine is one module in models/parallel (its `Engine` subclass), one `DpEngine(...)` line below and
its class in models/parallel `ENGINES` (tests/test_dp_engines.py holds the two registries to the same names);
the setup's check, the flags' help and `make_engine` read `DP_ENGINES` when they run.
What an engine does is in its module; which engines another feature composes with (pipeline, context and
expert parallelism, the real multi-process runs) is said by that feature, by name, and refuses the others.
This module imports nothing of the project: models/config.py reads it to check a setup, models/parallel reads
it to build the engine.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class DpEngine:
    name: str
    summary: str
    # field -> (does this setup read it?, what it needs); None: read whenever this engine runs
    knobs: dict[str, tuple[Callable, str] | None] = field(default_factory=dict)


def _stage3(s) -> bool:
    return s.zero_stage == 3


DP_ENGINES: dict[str, DpEngine] = {e.name: e for e in (
    DpEngine("deepspeed", "DeepSpeed ZeRO 0-3 (--zero-stage)",
             {"reduce_bucket_size": (lambda s: s.world_size > 1, "dp_engine deepspeed on > 1 rank"),
              "allgather_bucket_size": (lambda s: s.zero_stage in (1, 2), "dp_engine deepspeed with zero_stage 1 or 2"),
              "stage3_prefetch_bucket_size": (_stage3, "zero_stage 3"),
              "stage3_max_live_parameters": (_stage3, "zero_stage 3"),
              "stage3_param_persistence_threshold": (_stage3, "zero_stage 3")}),
    DpEngine("fsdp2", "torch fully_shard per block, then the root",
             {"reshard_after_forward": None, "forward_prefetch": None, "backward_prefetch": None,
              "reduce_dtype": None}),
    DpEngine("ddp", "torch DistributedDataParallel: replicas, gradient buckets all-reduced",
             {"ddp_bucket_cap_mb": None}),
    DpEngine("zero-redundancy-optimizer", "DDP with torch's ZeroRedundancyOptimizer",
             {"ddp_bucket_cap_mb": None}),
)}


def knob_rules() -> dict[str, tuple[Callable, str]]:
    """field -> (applies to a setup?, what it needs) for every engine knob, as models/config.py KNOB_APPLIES
    holds them: a knob several engines read applies under any of them."""
    owners: dict[str, list[tuple[str, tuple[Callable, str] | None]]] = {}
    for e in DP_ENGINES.values():
        for knob, rule in e.knobs.items():
            owners.setdefault(knob, []).append((e.name, rule))
    out = {}
    for knob, engines in owners.items():
        engines = tuple(engines)
        out[knob] = (lambda s, engines=engines: any(s.dp_engine == name and (rule is None or rule[0](s))
                                                    for name, rule in engines),
                     _needs(engines))
    return out


def _needs(engines) -> str:
    """What a knob needs, said as its engines' rules say it: "dp_engine ddp or zero-redundancy-optimizer"."""
    if all(rule is None for _, rule in engines):
        return "dp_engine " + " or ".join(name for name, _ in engines)
    return " or ".join(rule[1] if rule is not None else f"dp_engine {name}" for name, rule in engines)
