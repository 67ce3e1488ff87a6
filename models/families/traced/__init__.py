"""The traced family: any model whose own program runs, recorded on fake tensors instead of described by hand (an HF
config.json's transformers class, or a user's factory: `--hf-config`, `--module`).

- config       `TracedModel` (models/traced/model.py): the config's canonical JSON or the factory's path, and
               which batch knobs the factory takes (`varies`)
- describer    models/traced `traced_tape` (its checks are the recording's own)
- parallelism  none simulated (data parallelism only)
- batch        what the program builds: a HF task's inputs, or the factory's batch (`TracedModel.batch_note`)
- layers       the repeated blocks of the recording (models/traced `traced_layers`)
- LoRA         the program's own (a factory that calls peft); lora_r is not read
- compile      compiles as itself (models/compile)
- reference    the same program built for real, traces/reference/traced.py, registered against `FAMILY` in
               traces/reference/build.py `PROGRAMS`
- presets      none
"""

from __future__ import annotations

import re

from ...config import ConfigError, TrainingSetup
from ...traced import traced_layers, traced_tape
from ...traced.model import TracedModel
from ..base import Family


def layer_pattern(model: TracedModel, setup: TrainingSetup | None = None) -> tuple[re.Pattern, int]:
    """One list of numbered blocks, "<prefix>.<i>"."""
    layers = traced_layers(model, setup)
    prefixes = {name.rpartition(".")[0] for name in layers}
    if len(prefixes) != 1 or [name.rpartition(".")[2] for name in layers] != [str(i) for i in range(len(layers))]:
        raise ConfigError("checkpointing", f"the layer search needs one list of numbered layers; this model's "
                                           f"are {', '.join(layers[:4])}{', ...' if len(layers) > 4 else ''}")
    return re.compile(rf"(?:^|\.){re.escape(prefixes.pop())}\.(\d+)\."), 1


FAMILY = Family(
    "traced", config=TracedModel, takes=lambda m: isinstance(m, TracedModel), hand_written=False,
    tape=lambda model, setup, cpu, ep_rank, cuda: traced_tape(model, setup, cpu, cuda),
    kind="a traced model", layers=lambda model, setup=None: len(traced_layers(model, setup)),
    layer_pattern=layer_pattern,
    tokens=lambda model, setup: "seq_len" in model.varies and model.batch_note(setup).startswith("input_ids"),
    batch_note=lambda model, setup: model.batch_note(setup))
