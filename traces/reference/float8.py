"""The measuring side of models/float8.py: torchao 0.18.0's float8 training on the plain-torch reference models, so
an `fp8` scenario on the cpu profile runs for real (`peakledger validate`).

`apply_float8` is what a user's script (and torchtitan 0.3.0's Float8LinearConverter with `float8.emulate`) does:
`convert_to_float8_training(model, module_filter_fn=..., config=Float8LinearConfig.from_recipe_name(recipe))`,
with `emulate=True`, the only way Float8Linear's matmuls run on a CPU. The filter is torchtitan's module_filter_fn
with filter_fqns=["lm_head"] (models/float8.py `converts`). On a CUDA device (a `capture --device-kind cuda`,
traces/cuda_capture.py `place_model`) `device_matmuls` turns the emulation off: the matmuls are `torch._scaled_mm`.
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


def device_matmuls(model: nn.Module) -> nn.Module:
    """Every Float8Linear of `model` with `emulate=False`, as a GPU run builds them: torchao 0.18.0 float8_linear.py
    copies `config.emulate` into the three `ScaledMMConfig`s of `linear_mm_config` at construction, so both change."""
    from torchao.float8.float8_linear import Float8Linear

    for m in model.modules():
        if isinstance(m, Float8Linear) and m.config.emulate:
            m.config = dataclasses.replace(m.config, emulate=False)
            m.linear_mm_config = type(m.linear_mm_config)(*(c._replace(emulate=False) for c in m.linear_mm_config))
    return model


__all__ = ["apply_float8", "device_matmuls"]
