"""QLoRA: bitsandbytes 4-bit (nf4) base linears under LoRA (models/lora.py). Not modelled yet."""

from __future__ import annotations

from .config import ConfigError


def packed_params(name, shape):
    raise ConfigError("quantize", "nf4 is not modelled yet; allowed: none")


def nf4_linear(w, name, x, out_features, weight, bias):
    raise ConfigError("quantize", "nf4 is not modelled yet; allowed: none")
