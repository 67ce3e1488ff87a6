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

Optimizer-state offload (`TrainingSetup.optimizer_offload`): a wrapper around the torch optimizer keeps
its tensor states in host memory between steps and brings them to the device only to update them
(prime-rl's `CPUOffloadOptimizer`, Megatron's `--offload-optimizer-states`; the chunked form is
Megatron-LM PR 6244 / 6544 and prime-rl PR 3109). `step` (a 4-byte scalar) stays where torch puts it.
The host copies are pinned buffers allocated once, at the first offload, and reused (Megatron's
canonical CPU storage; prime-rl since PR 3552); a copy to the device is a fresh allocation, freed once
it has been copied back, so the device holds no state between steps.
- "states": every state comes to the device before `step()` and goes back after it: the device
  needs all of them, and the step's temporaries, during the step only.
- "chunked": the optimizer's tensors, in order, are cut into chunks of at most `offload_chunk_params`
  elements (a larger tensor is a chunk of its own); each chunk is copied in, updated by a `step()`
  over its parameters alone (so a foreach step's temporaries are the chunk's), and copied back, with
  `offload_prefetch` chunks copied in ahead of the one being updated (double buffering: 1).
- The first step: torch creates states lazily, inside `step()`, on each parameter's device. A wrapper
  that runs the first step as one whole `step()` ("whole", what prime-rl's chunked PR and the simple
  wrappers do) has every state and every temporary on the device at once before it can offload any:
  the first step is the peak, above the steady state. "chunked" runs the first step chunk by chunk
  too, so each chunk's states are created and offloaded before the next chunk's exist.
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


def offloaded(state: OptimizerState) -> bool:
    """Whether an optimizer-state offload moves this state to the host (everything but the `step` scalar)."""
    return state is not OptimizerState.STEP


def offload_chunks(numels: list[int], mode: str, chunk_params: int) -> list[list[int]]:
    """The optimizer's tensors (by index, in order) in the groups an offload moves and updates together:
    one group of all for "states"; for "chunked", consecutive tensors up to `chunk_params` elements per
    chunk, a tensor larger than that alone."""
    if mode == "states":
        return [list(range(len(numels)))] if numels else []
    chunks: list[list[int]] = []
    filled = 0
    for i, n in enumerate(numels):
        if not chunks or filled + n > chunk_params:
            chunks.append([])
            filled = 0
        chunks[-1].append(i)
        filled += n
    return chunks
