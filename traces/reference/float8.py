"""The measuring side of models/float8.py: torchao 0.18.0's float8 training on the plain-torch reference models, so
an `fp8` scenario on the cpu profile runs for real (`peakledger validate`).

`apply_float8` is what a user's script (and torchtitan 0.3.0's Float8LinearConverter with `float8.emulate`) does:
`convert_to_float8_training(model, module_filter_fn=..., config=Float8LinearConfig.from_recipe_name(recipe))`,
with `emulate=True`, the only way Float8Linear's matmuls run on a CPU. The filter is torchtitan's module_filter_fn
with filter_fqns=["lm_head"] (models/float8.py `converts`).
"""

from __future__ import annotations

import dataclasses

import torch.nn as nn

from ...models.config import TrainingSetup
from ...models.float8 import converts


def apply_float8(model: nn.Module, setup: TrainingSetup) -> nn.Module:
    """Swap `model`'s linears for torchao Float8Linear (emulated) as `setup.float8.recipe` says."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = dataclasses.replace(Float8LinearConfig.from_recipe_name(setup.float8.recipe), emulate=True)
    return convert_to_float8_training(
        model, config=config,
        module_filter_fn=lambda mod, fqn: converts(fqn, mod.in_features, mod.out_features))


__all__ = ["apply_float8"]
