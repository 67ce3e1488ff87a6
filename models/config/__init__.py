"""Configs: what the model is and how it is trained. Frozen dataclasses, validated on creation.

A describer reads a model config (`TransformerConfig` or `MLPConfig`) and a `TrainingSetup` and produces an op
graph. Every invalid value raises `ConfigError` naming the field and what is allowed, so the CLI can turn it into a
clear message (exit 2) instead of a traceback or a wrong number.

How the modules compose, bottom up:
    base.py    ConfigError, config files read safely, dtype names, the small checks every config uses
    model.py   TransformerConfig, MLPConfig: what the model is
    knobs.py   a training knob's declaration (section, help, how a command line sets it) and the sections
    checks.py  what each knob may be (the choice tuples) and the checks of each section, run in one order
    setup.py   TrainingSetup: its knobs declared section by section, checked by checks.py on creation
The CLI's flags and the scenario file's [training] keys are generated from setup.py's declarations.
"""

from .base import (
    COUNT_LIMITS,
    INT64_MAX,
    ConfigError,
    dtype_bytes,
    dtype_name,
    read_config_file,
)
from .checks import (
    BUILDS,
    CHECKPOINTING,
    DP_ENGINES,
    KNOB_APPLIES,
    LOAD_MODES,
    OFFLOAD_FIRST_STEPS,
    OPTIMIZER_IMPLS,
    OPTIMIZER_OFFLOADS,
    OPTIMIZERS,
    PASSES,
    PP_SCHEDULES,
    QUANTIZE,
    REDUCE_DTYPES,
    SAVE_MODES,
    check_given_knobs,
)
from .knobs import SECTIONS, SetupKnob, setup_knobs
from .model import ARCHITECTURES, ATTENTION, GPT2_ACTIVATIONS, IMPLEMENTATIONS, MLPConfig, TransformerConfig
from .setup import PRECISIONS, TrainingSetup

__all__ = ["ConfigError", "TransformerConfig", "MLPConfig", "TrainingSetup", "dtype_bytes", "dtype_name",
           "read_config_file", "COUNT_LIMITS", "INT64_MAX", "ARCHITECTURES", "IMPLEMENTATIONS", "GPT2_ACTIVATIONS",
           "ATTENTION",
           "PRECISIONS", "OPTIMIZERS", "OPTIMIZER_IMPLS", "CHECKPOINTING", "DP_ENGINES", "OPTIMIZER_OFFLOADS",
           "OFFLOAD_FIRST_STEPS", "QUANTIZE", "PP_SCHEDULES", "BUILDS", "PASSES", "SAVE_MODES", "LOAD_MODES",
           "REDUCE_DTYPES", "KNOB_APPLIES", "check_given_knobs", "SECTIONS", "SetupKnob", "setup_knobs"]
