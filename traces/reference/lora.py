"""The measuring side of models/lora.py: peft LoRA (and bitsandbytes 4-bit base linears) on the plain-torch
reference models, so a LoRA / QLoRA scenario runs for real on the CPU (`peakledger validate`).

`apply_lora` is what a user's script does: `peft.get_peft_model(model, LoraConfig(...))` (autocast_adapter_dtype
left at its default True), then the underlying model with its LoRA layers injected is trained
(`PeftModel.get_base_model()`: parameter names as the describer's, without peft's `base_model.model.` prefix).
"""

from __future__ import annotations

import torch.nn as nn

from ...models.config import TrainingSetup, TransformerConfig
from ...models.families import family_of
from .qlora import quantize_linears


def apply_lora(model: nn.Module, cfg: TransformerConfig, setup: TrainingSetup) -> nn.Module:
    """peft LoRA on `model` as `setup` says; with quantize "nf4" every block linear is a bitsandbytes Linear4bit
    first (qlora.py). Returns the model with adapters, only they trainable."""
    from peft import LoraConfig, get_peft_model

    chosen = family_of(cfg).lora_targets(cfg, setup)  # its family's (ConfigError where LoRA is not modelled)
    if setup.lora.quantize != "none":
        quantize_linears(model, cfg, setup)
    config = LoraConfig(r=setup.lora.r, lora_alpha=setup.lora.alpha, lora_dropout=setup.lora.dropout,
                        target_modules=list(chosen), bias="none")
    peft_model = get_peft_model(model, config)
    return peft_model.get_base_model()


__all__ = ["apply_lora"]
