"""Optimizer states and the memory an optimizer step needs, per torch.optim (and bitsandbytes for 8-bit): one
registry, `OPTIMIZERS`, of `OptimizerSpec` entries (adding an optimizer is one entry).

States are created lazily, inside the first `step()` (torch's `_init_group`): nothing exists before.
- SGD: none. SGD with momentum: `momentum_buffer` (a clone of the gradient) per parameter.
- Adam / AdamW: `step` (a 4-byte fp32 scalar tensor, on the host unless fused/capturable), `exp_avg`,
  `exp_avg_sq`; AMSGrad adds `max_exp_avg_sq`.
- RMSprop: `step`, `square_avg`. Adagrad: `step`, `sum`, made in the constructor, not lazily.
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

from collections.abc import Callable
from dataclasses import dataclass

from ..simulator.events import OptimizerState, Pool

BNB_BLOCK = 256
BNB_MIN_8BIT_SIZE = 4096
BNB_QMAP_BYTES = 2 * 256 * 4

StateSpecs = list[tuple[OptimizerState, int, str]]


@dataclass(frozen=True)
class OptimizerSpec:
    """One optimizer, all peakledger knows of it, in one entry of `OPTIMIZERS`:
    - `states(numel, state_dtype)`: (state, numel, dtype) of each per-parameter state tensor, in the order torch's
      `_init_group` makes them;
    - `foreach_temps`: the state-sized tensors its foreach step makes for every parameter at once (torch's
      `_multi_tensor_*`), all alive until the update ends;
    - `loop_temps`: those its for-loop step makes per parameter (`_single_tensor_*`), in order: all but the last go
      within the parameter's update, the last is still referenced until the next parameter's replaces it;
    - `flops_per_element` of one update (rough: the arithmetic per element);
    - `torch_class` and `torch_kwargs`: the torch.optim class the real programs build (None: not torch's);
    - `lazy`: states made inside the first `step()` (torch's `_init_group`); False: in the constructor (Adagrad's
      `__init__` fills `sum` and `step` at once);
    - `impls`: the implementations torch has for it (foreach, for-loop, fused);
    - `capture`: traces/cuda_capture.py runs it on a GPU."""

    name: str
    states: Callable[[int, str], StateSpecs]
    foreach_temps: tuple[str, ...] = ()
    loop_temps: tuple[str, ...] = ()
    flops_per_element: int = 12
    torch_class: str | None = None
    torch_kwargs: tuple[tuple[str, object], ...] = ()
    lazy: bool = True
    impls: tuple[str, ...] = ("foreach", "for-loop", "fused")
    capture: bool = True


def _none(numel: int, dtype: str) -> StateSpecs:
    return []


def _momentum(numel: int, dtype: str) -> StateSpecs:
    return [(OptimizerState.MOMENTUM_BUFFER, numel, dtype)]


def _adam(numel: int, dtype: str) -> StateSpecs:
    return [(OptimizerState.STEP, 1, "fp32"), (OptimizerState.EXP_AVG, numel, dtype),
            (OptimizerState.EXP_AVG_SQ, numel, dtype)]


def _amsgrad(numel: int, dtype: str) -> StateSpecs:
    return _adam(numel, dtype) + [(OptimizerState.MAX_EXP_AVG_SQ, numel, dtype)]


def _adam_8bit(numel: int, dtype: str) -> StateSpecs:
    if numel < BNB_MIN_8BIT_SIZE:
        return [(OptimizerState.EXP_AVG, numel, "fp32"), (OptimizerState.EXP_AVG_SQ, numel, "fp32")]
    blocks = -(-numel // BNB_BLOCK)
    return [(OptimizerState.EXP_AVG, numel, "int8"), (OptimizerState.EXP_AVG_SQ, numel, "int8"),
            (OptimizerState.QUANT_STATE, blocks, "fp32"), (OptimizerState.QUANT_STATE, blocks, "fp32")]


def _rmsprop(numel: int, dtype: str) -> StateSpecs:
    return [(OptimizerState.STEP, 1, "fp32"), (OptimizerState.SQUARE_AVG, numel, dtype)]


def _adagrad(numel: int, dtype: str) -> StateSpecs:
    return [(OptimizerState.STEP, 1, "fp32"), (OptimizerState.SUM, numel, dtype)]


ADAM_FOREACH = ("exp_avg_sq_sqrt",)  # torch/optim/adam.py `_multi_tensor_adam`: `_foreach_sqrt(exp_avg_sqs)`
ADAM_LOOP = ("exp_avg_sq_sqrt", "denom")  # `_single_tensor_adam`: `(exp_avg_sq.sqrt() / bc2_sqrt).add_(eps)`
OPTIMIZER_SPECS = (
    OptimizerSpec("sgd", _none, flops_per_element=2, torch_class="SGD", torch_kwargs=(("momentum", 0.0),)),
    OptimizerSpec("sgd-momentum", _momentum, flops_per_element=4, torch_class="SGD",
                  torch_kwargs=(("momentum", 0.9),)),
    OptimizerSpec("adam", _adam, ADAM_FOREACH, ADAM_LOOP, torch_class="Adam"),
    OptimizerSpec("adamw", _adam, ADAM_FOREACH, ADAM_LOOP, torch_class="AdamW"),
    OptimizerSpec("amsgrad", _amsgrad, ADAM_FOREACH, ADAM_LOOP, torch_class="Adam",
                  torch_kwargs=(("amsgrad", True),)),
    OptimizerSpec("adam-8bit", _adam_8bit, flops_per_element=16, capture=False),
    # torch/optim/rmsprop.py (torch 2.13): `_multi_tensor_rmsprop` `avg = torch._foreach_sqrt(square_avgs)`, then
    # `_foreach_add_(avg, eps)`; `_single_tensor_rmsprop` `avg = square_avg.sqrt()`, `avg.add_(eps)` per parameter
    # (defaults: no momentum, not centered); no fused implementation
    OptimizerSpec("rmsprop", _rmsprop, ("avg",), ("avg",), flops_per_element=8, torch_class="RMSprop",
                  impls=("foreach", "for-loop"), capture=False),
    # torch/optim/adagrad.py (torch 2.13): `__init__` makes `step` and `sum` (full_like(p, 0)); `_multi_tensor_adagrad`
    # `std = _foreach_sqrt(state_sums)`, `_foreach_add_(std, eps)`, `numerator = _foreach_mul(grads, minus_clr)`,
    # then `_foreach_addcdiv_`; `_single_tensor_adagrad` `std = state_sum.sqrt().add_(eps)` per parameter
    OptimizerSpec("adagrad", _adagrad, ("std", "numerator"), ("std",), flops_per_element=6, torch_class="Adagrad",
                  lazy=False, capture=False),
)
OPTIMIZERS: dict[str, OptimizerSpec] = {spec.name: spec for spec in OPTIMIZER_SPECS}


def state_specs(optimizer: str, numel: int, state_dtype: str) -> StateSpecs:
    """(state, numel, dtype) of each per-parameter state tensor, for `numel` elements of one rank."""
    return OPTIMIZERS[optimizer].states(numel, state_dtype)


def step_pool(device_is_cpu: bool, optimizer_impl: str) -> Pool:
    """Where the 4-byte `step` tensors live: on the host, unless the optimizer is fused (or capturable) or the
    device is the CPU itself."""
    return Pool.HOST if not device_is_cpu and optimizer_impl != "fused" else Pool.DEVICE


def update_flops(optimizer: str, numel: int) -> int:
    """Elementwise FLOPs of one update (rough: counts the arithmetic ops per element)."""
    return OPTIMIZERS[optimizer].flops_per_element * numel


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
