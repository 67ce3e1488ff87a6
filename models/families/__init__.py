"""The model families, in one registry: which family a model is (`family_of`), and each family's home.

A family is a kind of model peakledger knows how to describe (base.py `Family`): its config class, its describer,
its config checks, its LoRA targets, the model parallelism simulated on it, its batch, its layers, its presets.
Everything else asks the family (`family_of(model).experts`, `"tp" in family.parallel`, ...) instead of testing
the config's class; `takes` is where a config's class is tested, once per family.

The homes, one folder each: traced/ (any nn.Module, recorded: models/traced), mixtral/ (HF's Mixtral), hf_gpt2/ (HF's
GPT-2), nanogpt/ (nanoGPT's GPT-2 and a small Llama), mlp/ (an MLP). transformer.py holds what the three
transformer homes answer alike. The first family that takes a model describes it: the order below matters
(a Mixtral and an HF GPT-2 are `TransformerConfig`s that nanogpt would take too).

Adding a family:
1. its home, models/families/<name>/: a `FAMILY = Family(...)` with its config class, describer, checks and
   presets (its config and describer may live in the folder too), and the folder in pyproject.toml's `packages`;
2. one line in `FAMILIES` below;
3. its real program, so that `peakledger validate` runs it: a module in traces/reference/ and one line in
   traces/reference/build.py `PROGRAMS`, keyed by the `FAMILY` object. A real torch program belongs to the traces
   layer, which models/ may not import (tests/test_layers.py), so it cannot live in the home.
"""

from __future__ import annotations

from ..config import ConfigError
from . import hf_gpt2, mixtral, mlp, nanogpt, traced
from .base import Cuda, Family

FAMILIES: tuple[Family, ...] = (
    traced.FAMILY,
    mixtral.FAMILY,
    hf_gpt2.FAMILY,
    nanogpt.FAMILY,
    mlp.FAMILY,
)


def family_of(model) -> Family:
    for family in FAMILIES:
        if family.takes(model):
            return family
    raise ConfigError("model", f"no describer takes a {type(model).__name__}; families: "
                               f"{', '.join(f.name for f in FAMILIES)}")


__all__ = ["FAMILIES", "Family", "Cuda", "family_of"]
