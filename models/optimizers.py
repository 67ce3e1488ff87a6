"""Optimizer states and the memory an optimizer step needs, per torch.optim (and bitsandbytes for 8-bit).

States are created lazily, inside the first `step()` (torch's `_init_group`): nothing exists before.
- SGD: none. SGD with momentum: `momentum_buffer` (a clone of the gradient) per parameter.
- Adam / AdamW: `step` (a 4-byte fp32 scalar tensor, on the host unless fused/capturable), `exp_avg`,
  `exp_avg_sq`; AMSGrad adds `max_exp_avg_sq`.
- 8-bit Adam (bitsandbytes defaults, assumed): tensors of >= 4096 elements get two int8 states plus
  one fp32 absmax per 256-element block for each; smaller tensors keep fp32 states; the two 256-entry
  fp32 quantization maps are shared by all parameters.

Step temporaries (Adam family, measured on torch CPU, see shared notes):
- foreach: `_foreach_sqrt(exp_avg_sqs)` materialises one state-sized tensor per parameter, all at once.
- for-loop: per parameter, `exp_avg_sq.sqrt()` then `/ bias_correction2_sqrt`; the previous
  parameter's `denom` is still referenced until it is reassigned.
- fused: no temporaries.
"""

from __future__ import annotations

from ..simulator.events import OptimizerState, Pool

BNB_BLOCK = 256
BNB_MIN_8BIT_SIZE = 4096
BNB_QMAP_BYTES = 2 * 256 * 4


def state_specs(optimizer: str, numel: int, state_dtype: str) -> list[tuple[OptimizerState, int, str]]:
    """(state, numel, dtype) of each per-parameter state tensor, for `numel` elements of one rank."""
    if optimizer == "sgd":
        return []
    if optimizer == "sgd-momentum":
        return [(OptimizerState.MOMENTUM_BUFFER, numel, state_dtype)]
    if optimizer == "adam-8bit":
        if numel < BNB_MIN_8BIT_SIZE:
            return [(OptimizerState.EXP_AVG, numel, "fp32"), (OptimizerState.EXP_AVG_SQ, numel, "fp32")]
        blocks = -(-numel // BNB_BLOCK)
        return [(OptimizerState.EXP_AVG, numel, "int8"), (OptimizerState.EXP_AVG_SQ, numel, "int8"),
                (OptimizerState.QUANT_STATE, blocks, "fp32"), (OptimizerState.QUANT_STATE, blocks, "fp32")]
    specs = [(OptimizerState.STEP, 1, "fp32"), (OptimizerState.EXP_AVG, numel, state_dtype),
             (OptimizerState.EXP_AVG_SQ, numel, state_dtype)]
    if optimizer == "amsgrad":
        specs.append((OptimizerState.MAX_EXP_AVG_SQ, numel, state_dtype))
    return specs


def step_pool(device_is_cpu: bool, optimizer_impl: str) -> Pool:
    """Where Adam's 4-byte `step` tensors live: on the host, unless the optimizer is fused (or capturable)
    or the device is the CPU itself."""
    return Pool.HOST if not device_is_cpu and optimizer_impl != "fused" else Pool.DEVICE


def has_sqrt_temporaries(optimizer: str) -> bool:
    return optimizer in ("adam", "adamw", "amsgrad")


def update_flops(optimizer: str, numel: int) -> int:
    """Elementwise FLOPs of one update (rough: counts the arithmetic ops per element)."""
    return {"sgd": 2, "sgd-momentum": 4, "adam-8bit": 16}.get(optimizer, 12) * numel
