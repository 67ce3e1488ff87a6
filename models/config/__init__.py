"""Configs: what the model is and how it is trained. Frozen dataclasses, validated on creation.

A describer reads a model config (`TransformerConfig` or `MLPConfig`) and a `TrainingSetup` and produces an op
graph. Every invalid value raises `ConfigError` naming the field and what is allowed, so the CLI can turn it into a
clear message (exit 2) instead of a traceback or a wrong number.

How the modules compose, bottom up:
    base.py    ConfigError, config files read safely, dtype names, the small checks every config uses
    model.py   TransformerConfig, MLPConfig: what the model is
    choices.py what each knob may be (the choice tuples)
    checks.py  the checks of the setup's knobs, run in one order (the offloads': offload_checks.py; the RL
               section's: rl.py)
    applies.py which knobs a setup reads: a knob the user set that it never reads is refused
    sections.py the setup's sections (batch, loop, optimizer, checkpointing, mesh, checkpoint I/O, offload, LoRA,
               MoE, compile), their knobs declared with models/knobs.py's `knob`; precision's is
               models/precision.py's, the data-parallel one models/dp_engines.py's
    setup.py   TrainingSetup: the sections, made from knobs by name, checked by checks.py on creation
The CLI's flags, the scenario file's [training] keys and the setup's serialised form are generated from the
sections' declarations.
"""

from ..dp_engines import REDUCE_DTYPES
from ..knobs import FLAG_GROUPS, SetupKnob
from ..precision import PRECISIONS
from .applies import KNOB_APPLIES, check_given_knobs
from .base import (
    COUNT_LIMITS,
    INT64_MAX,
    ConfigError,
    dtype_bytes,
    dtype_name,
    read_config_file,
)
from .choices import (
    BUILDS,
    CHECKPOINTING,
    DP_ENGINES,
    LOAD_MODES,
    OFFLOAD_FIRST_STEPS,
    OPTIMIZER_IMPLS,
    OPTIMIZER_OFFLOADS,
    OPTIMIZERS,
    PASSES,
    PP_SCHEDULES,
    QUANTIZE,
    SAVE_MODES,
)
from .model import ARCHITECTURES, ATTENTION, GPT2_ACTIVATIONS, IMPLEMENTATIONS, MLPConfig, TransformerConfig
from .setup import KNOBS, SETUP_KNOBS, TrainingSetup

__all__ = ["ConfigError", "TransformerConfig", "MLPConfig", "TrainingSetup", "dtype_bytes", "dtype_name",
           "read_config_file", "COUNT_LIMITS", "INT64_MAX", "ARCHITECTURES", "IMPLEMENTATIONS", "GPT2_ACTIVATIONS",
           "ATTENTION",
           "PRECISIONS", "OPTIMIZERS", "OPTIMIZER_IMPLS", "CHECKPOINTING", "DP_ENGINES", "OPTIMIZER_OFFLOADS",
           "OFFLOAD_FIRST_STEPS", "QUANTIZE", "PP_SCHEDULES", "BUILDS", "PASSES", "SAVE_MODES", "LOAD_MODES",
           "REDUCE_DTYPES", "KNOB_APPLIES", "check_given_knobs", "FLAG_GROUPS", "SetupKnob", "SETUP_KNOBS",
           "KNOBS"]
