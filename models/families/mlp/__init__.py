"""The mlp family: a stack of Linear layers with an activation between them under mean-squared error, described by
hand.

- config       `MLPConfig` (models/config/model.py): d_in, hidden widths, d_out, bias, activation
- describer    models/transformer/mlp.py `mlp_tape`
- checks       no moe_routing; no LoRA (no q_proj / c_attn to target)
- parallelism  none (data parallelism only)
- batch        one vector per sample: (micro_batch, d_in) inputs and (micro_batch, d_out) targets; no seq_len
- layers       one per Linear (with the activation after it), named `layers.<2i>` and `layers.<2i + 1>`
- reference    traces/reference/nanogpt.py `MLP`, registered against `FAMILY` in traces/reference/build.py `PROGRAMS`
- presets      `PRESETS` below
"""

from __future__ import annotations

import re

from ...config import ConfigError, MLPConfig
from ...lora import NOT_ON_MLP
from ...moe import no_routing
from ...transformer import mlp_tape
from ..base import Family, refused


def check(model: MLPConfig, setup) -> None:
    no_routing(model, setup)
    if setup.lora.r:
        raise ConfigError("lora_r", NOT_ON_MLP)


PRESETS = (MLPConfig(name="tiny-mlp", d_in=512, hidden=(512, 512), d_out=512),)

FAMILY = Family(
    "mlp", config=MLPConfig, takes=lambda m: isinstance(m, MLPConfig), check=check,
    tape=lambda model, setup, cpu, ep_rank, cuda: mlp_tape(model, setup, cpu),
    kind="an MLP", layers=lambda model, setup=None: len(model.hidden) + 1,
    layer_pattern=lambda model, setup=None: (re.compile(r"^layers\.(\d+)(?:\.|$)"), 2),
    lora_targets=refused("lora_r", NOT_ON_MLP),
    no_seq_len="an MLP reads one vector per sample, not a sequence: leave seq_len out (micro_batch sets the batch)",
    presets=PRESETS)
