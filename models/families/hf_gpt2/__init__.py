"""The hf-gpt2 family: HF transformers' GPT2LMHeadModel as its code runs (Conv1D, an additive float mask, HF's
loss), described by hand.

- config       `TransformerConfig` with implementation "hf" and architecture gpt2 (what an HF GPT-2 config.json reads
               into: models/transformer/hf_config.py)
- describer    models/transformer/hf_gpt2.py `hf_gpt2_tape`
- checks       seq_len within max_seq_len; no moe_routing; no LoRA (peft on Conv1D is not modelled)
- parallelism  none (data parallelism only)
- batch        token ids (micro_batch, seq_len) and their next-token targets
- layers       the per-layer checkpointing search does not run on it (none or full checkpointing only)
- reference    traces/reference/nanogpt.py `hf_gpt2` (transformers' own class), registered against `FAMILY` in
               traces/reference/build.py `PROGRAMS`
- presets      none: its models come from config.json files
"""

from __future__ import annotations

from ...config import ConfigError, TransformerConfig
from ...lora import NOT_ON_HF
from ...moe import no_routing
from ...transformer import hf_gpt2_tape
from ..base import Family, refused
from ..transformer import TRANSFORMER, check_seq_len


def check(model: TransformerConfig, setup) -> None:
    check_seq_len(model, setup)
    no_routing(model, setup)
    if setup.lora.r:
        raise ConfigError("lora_r", NOT_ON_HF)


FAMILY = Family(
    "hf-gpt2", takes=lambda m: isinstance(m, TransformerConfig) and m.implementation == "hf", check=check,
    tape=lambda model, setup, cpu, ep_rank, cuda: hf_gpt2_tape(model, setup, cpu),
    kind="implementation 'hf'", layer_search=False, lora_targets=refused("lora_r", NOT_ON_HF), **TRANSFORMER)
