"""What a model family is (`Family`): every question the rest of peakledger asks about a model that depends on what
kind of model it is, answered by the family's hooks instead of by testing the config's class.

A hook is a value or a callable the family's home (models/families/<name>/) sets; the defaults here are what a
family that says nothing answers (no experts, no model parallelism, no sequence, no LoRA, no HF equivalent).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from ..config import ConfigError, TrainingSetup
from ..tape import Tape

Cuda = tuple[tuple[int, int], str] | None  # (compute capability, torch version) of a GPU program, None on a CPU


def nothing(model, setup: TrainingSetup) -> None:
    """A check that finds nothing to refuse."""


def refused(field: str, why: str) -> Callable[..., tuple[str, ...]]:
    """A hook that refuses what it is asked: ConfigError(field, why)."""
    def refuse(*_args):
        raise ConfigError(field, why)
    return refuse


@dataclass(frozen=True, eq=False)  # a family is itself (hashable by identity): traces/reference keys its programs by it
class Family:
    """A kind of model peakledger describes, with what the rest of the code asks about it.

    name            the family's name (in messages and tests)
    config          the config class its models are (a trace records its name as `model_kind` and is read back by it)
    takes           whether a model is this family's: the first family of the registry that takes it describes it
    check           its config checks against a setup, run before describing (ConfigError naming the field)
    tape            its describer: (model, setup, cpu, expert-parallel rank, cuda) -> the forward tape
    hand_written    a hand-written describer (else the traced one: the model's own program, recorded)
    transformer     a decoder-only transformer (`TransformerConfig`): n_layer blocks of attention heads named
                    `<model.blocks>.<i>`, over token sequences
    experts         a mixture of experts (models/moe.py): routing, expert parallelism, active parameters
    parallel        the model-parallel dimensions simulated on it ("tp", "pp", "cp", "ep"; models/parallel/checks.py)
                    and measured for real (traces/*_run.py)
    kind            the family in a refusal's words ("an MLP": pipeline parallelism is not simulated for it)
    layers          (model, setup) -> how many layers the checkpointing policies count
    layer_pattern   (model, setup) -> a regex whose group 1 is a layer number inside an op name, and what to divide
                    it by (the per-layer checkpointing search cuts costs per layer with it)
    layer_search    whether the per-layer checkpointing search (`peakledger checkpointing --budget`) runs on it
    lora_targets    (model, setup) -> peft's target_modules for it, checked (ConfigError where LoRA is not modelled)
    seq_len         a hand-written model read as token sequences: (model) -> the default seq_len; None: its batch
                    has no sequence, and a seq_len given is refused with `no_seq_len`
    no_seq_len      why
    tokens          (model, setup) -> whether the batch is token ids whose length seq_len sets (a shorter context is
                    one of the fixes `explain` tries)
    batch_note      (model, setup) -> what the batch is, in the report's words (None: the describer's own batch)
    hf_equivalent   (model) -> the HF config.json a compiled run of it runs (models/transformer/hf_config.py); None:
                    the hand-written model has none (a traced model compiles as itself)
    presets         its named configs (models/presets.py lists every family's)
    """

    name: str
    config: type
    takes: Callable[[object], bool]
    tape: Callable[[object, TrainingSetup, bool, int, Cuda], Tape]
    check: Callable[[object, TrainingSetup], None] = nothing
    hand_written: bool = True
    transformer: bool = False
    experts: bool = False
    parallel: frozenset[str] = frozenset()
    kind: str = "this model"
    layers: Callable[[object, TrainingSetup | None], int] = refused("checkpointing", "no layers to count here")
    layer_pattern: Callable[[object, TrainingSetup | None], tuple[re.Pattern, int]] = \
        refused("checkpointing", "the layer search needs numbered layers; this model has none")
    layer_search: bool = True
    lora_targets: Callable[[object, TrainingSetup], tuple[str, ...]] = refused("lora_r", "LoRA is not modelled here")
    seq_len: Callable[[object], int] | None = None
    no_seq_len: str = ""
    tokens: Callable[[object, TrainingSetup], bool] = lambda model, setup: False
    batch_note: Callable[[object, TrainingSetup], str | None] = lambda model, setup: None
    hf_equivalent: Callable[[object], dict] | None = None
    presets: tuple = ()


__all__ = ["Family", "Cuda", "nothing", "refused"]
