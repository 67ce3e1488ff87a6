"""Optimizer states and the memory an optimizer step needs, per torch.optim (and bitsandbytes for 8-bit): one
registry, `OPTIMIZERS`, of `OptimizerSpec` entries (adding an optimizer is one entry).

States are created lazily, inside the first `step()` (torch's `_init_group`): nothing exists before.
- SGD: none. SGD with momentum: `momentum_buffer` (a clone of the gradient) per parameter.
- Adam / AdamW: `step` (a 4-byte fp32 scalar tensor, on the host unless fused/capturable), `exp_avg`,
  `exp_avg_sq`; AMSGrad adds `max_exp_avg_sq`.
- RMSprop: `step`, `square_avg`. Adagrad: `step`, `sum`, made in the constructor, not lazily.
- Adafactor: `step`, then for a parameter of >= 2 dims its factored second moment, `row_var` (the shape with the
  last dim 1) and `col_var` (the second-to-last dim 1), else `variance` (the parameter's shape): states whose shape
  follows the parameter's shape, not its element count (`OptimizerSpec.by_shape`).
- 8-bit Adam (bitsandbytes 0.50.2 AdamW8bit, checked against its `Optimizer2State.init_state` and a real CPU run in
  tests/test_lowbit_optimizers.py): tensors of >= 4096 elements get two uint8 states plus one fp32 absmax per
  256-element block for each; smaller tensors keep fp32 states; the two 256-entry fp32 quantization maps are shared
  by all parameters. `adam-8bit` (the name stored scenarios use) and `adamw-8bit-bnb` are the same states.
- Low-bit optimizers (torchao 0.18.0 AdamW8bit / AdamW4bit / AdamWFp8, bitsandbytes 0.50.2 AdamW8bit /
  PagedAdamW8bit): models/lowbit.py, their rules cited there.

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
from math import prod

from ..simulator.events import OptimizerState, Pool
from . import lowbit

BNB_BLOCK = 256
BNB_MIN_8BIT_SIZE = 4096
BNB_QMAP_BYTES = 2 * 256 * 4

Shape = tuple[int, ...]
StateSpecs = list[tuple[OptimizerState, Shape, str]]


@dataclass(frozen=True, eq=False)
class Temp:
    """A temporary of an optimizer step, made for the step's tensor `index` (-1: for the step itself), named `kind`
    (the block `<tensor>.<kind>`, or `optimizer.<kind>`), of `shape`, in that tensor's dtype or `dtype`, on the host
    where `host` (a CPU scalar beside host `step` tensors). Compared by identity: two alike are two tensors."""

    index: int
    kind: str
    shape: Shape
    dtype: str | None = None
    host: bool = False


@dataclass(frozen=True)
class TempOp:
    """One op of a step's temporaries, in order: `make` allocated, then `free` (made here or before) freed; `index`
    the tensor it works on (-1: several), `label` its name."""

    label: str
    make: tuple[Temp, ...] = ()
    free: tuple[Temp, ...] = ()
    index: int = -1


TempPlan = Callable[[str, tuple[tuple[Shape, str], ...]], list[TempOp]]


@dataclass(frozen=True)
class OptimizerSpec:
    """One optimizer, all peakledger knows of it, in one entry of `OPTIMIZERS`:
    - `states(shape, state_dtype)`: (state, shape, dtype) of each per-parameter state tensor, in the order torch's
      `_init_group` makes them, a pure function of the tensor's shape;
    - `by_shape`: the states' shapes follow the parameter's shape, not its element count (Adafactor's row and column
      factors): `states` gets the parameter's whole shape, and a partition of it (a flat ZeRO partition, a dim-0
      shard) is not modelled (models/config refuses it); False: each state is the parameter's elements, however they
      are partitioned, and `states` gets `(numel,)`;
    - `foreach_temps`: the state-sized tensors its foreach step makes for every parameter at once (torch's
      `_multi_tensor_*`), all alive until the update ends;
    - `loop_temps`: those its for-loop step makes per parameter (`_single_tensor_*`), in order: all but the last go
      within the parameter's update, the last is still referenced until the next parameter's replaces it;
    - `temps(impl, ((shape, dtype), ...))`: instead of the two above, any temporaries, of any shape: the step's
      ops over those tensors in order (`TempOp`), a pure function of their shapes and dtypes;
    - `flops_per_element` of one update (rough: the arithmetic per element);
    - `torch_class` and `torch_kwargs`: the torch.optim class the real programs build (None: not torch's);
    - `lazy`: states made inside the first `step()` (torch's `_init_group`); False: in the constructor (Adagrad's
      `__init__` fills `sum` and `step` at once);
    - `impls`: the implementations torch has for it (foreach, for-loop, fused);
    - `capture`: traces/cuda_capture.py runs it on a GPU;
    - `reference`: a function returning the optimizer class itself, where it is not torch.optim's (torchao's,
      bitsandbytes'): the real programs build that class with `torch_kwargs` (no impl flags);
    - `per_param`: `step()` makes each parameter's states just before that parameter's own update, one parameter
      after the other (torchao's and bitsandbytes' loops), not all at once before the update;
    - `host_step`: the `step` tensor is made on the host whatever the device (torchao's `torch.tensor(0.0)`);
    - `shared_states`: (name, shape, dtype) of the tensors the optimizer shares across parameters (bitsandbytes'
      two qmaps), made with the first parameter's states;
    - `compiled_step`: the library compiles its step (torchao's `torch.compile(single_param_adam)`): a real run is
      measured by torch.profiler (traces/lowbit_run.py), not by the dispatch tracker."""

    name: str
    states: Callable[[Shape, str], StateSpecs]
    foreach_temps: tuple[str, ...] = ()
    loop_temps: tuple[str, ...] = ()
    temps: TempPlan | None = None
    by_shape: bool = False
    flops_per_element: int = 12
    torch_class: str | None = None
    torch_kwargs: tuple[tuple[str, object], ...] = ()
    lazy: bool = True
    impls: tuple[str, ...] = ("foreach", "for-loop", "fused")
    capture: bool = True
    reference: Callable[[], type] | None = None
    per_param: bool = False
    host_step: bool = False
    shared_states: tuple[tuple[str, Shape, str], ...] = ()
    compiled_step: bool = False


def _none(shape: Shape, dtype: str) -> StateSpecs:
    return []


def _momentum(shape: Shape, dtype: str) -> StateSpecs:
    return [(OptimizerState.MOMENTUM_BUFFER, shape, dtype)]


def _adam(shape: Shape, dtype: str) -> StateSpecs:
    return [(OptimizerState.STEP, (), "fp32"), (OptimizerState.EXP_AVG, shape, dtype),
            (OptimizerState.EXP_AVG_SQ, shape, dtype)]


def _amsgrad(shape: Shape, dtype: str) -> StateSpecs:
    return _adam(shape, dtype) + [(OptimizerState.MAX_EXP_AVG_SQ, shape, dtype)]


def _adam_8bit(shape: Shape, dtype: str) -> StateSpecs:
    numel = prod(shape)
    if numel < BNB_MIN_8BIT_SIZE:
        return [(OptimizerState.EXP_AVG, shape, "fp32"), (OptimizerState.EXP_AVG_SQ, shape, "fp32")]
    blocks = (-(-numel // BNB_BLOCK),)
    return [(OptimizerState.EXP_AVG, shape, "int8"), (OptimizerState.EXP_AVG_SQ, shape, "int8"),
            (OptimizerState.QUANT_STATE, blocks, "fp32"), (OptimizerState.QUANT_STATE, blocks, "fp32")]


def _rmsprop(shape: Shape, dtype: str) -> StateSpecs:
    return [(OptimizerState.STEP, (), "fp32"), (OptimizerState.SQUARE_AVG, shape, dtype)]


def _adagrad(shape: Shape, dtype: str) -> StateSpecs:
    return [(OptimizerState.STEP, (), "fp32"), (OptimizerState.SUM, shape, dtype)]


def _adafactor(shape: Shape, dtype: str) -> StateSpecs:
    if len(shape) < 2:
        return [(OptimizerState.STEP, (), "fp32"), (OptimizerState.VARIANCE, shape, dtype)]
    return [(OptimizerState.STEP, (), "fp32"), (OptimizerState.ROW_VAR, (*shape[:-1], 1), dtype),
            (OptimizerState.COL_VAR, (*shape[:-2], 1, shape[-1]), dtype)]


def _adafactor_temps(impl: str, tensors: tuple[tuple[Shape, str], ...]) -> list[TempOp]:
    """torch/optim/_adafactor.py (torch 2.13), defaults (no weight decay, not maximize). Per parameter: `alpha`'s
    `param.norm(2)` and the update's `update.norm(2)` (0-dim, gone once `.item()` read them); >= 2 dims: `row_mean`
    (the shape, last dim 1), `col_mean` (second-to-last 1), `var_estimate = row_var @ col_var` (the parameter's
    shape) and `row_var.mean(dim=-2)` (both last dims 1); else `grad_squared` and `var_estimate = variance.clone()`;
    `update` is `var_estimate`, updated in place. for-loop (`_single_tensor_adafactor`): each local holds its tensor
    until the next parameter's rebinds it (the old `var_estimate` until `update` is rebound), the last ones until the
    step returns. foreach (`_multi_tensor_adafactor`): per group of one dtype and >= 2 dims or not
    (`_group_tensors_by_device_dtype_and_is_multidim`: the dtypes in the reverse order of their first tensors, as the
    C++ grouping's std::unordered_map gives them back, measured with 2 and 3 dtypes; within a dtype >= 2 dims or not
    in the order of their first tensors), a `torch.tensor(1.0)` on the host for the
    `step`s' `_foreach_add_`, the norms one at a time, each list of means made and deleted at once, and the
    `var_estimates` kept as `updates` until the next group's replace them; a list goes last item first (CPython's
    `list_dealloc`)."""
    return _adafactor_loop(tensors) if impl == "for-loop" else _adafactor_foreach(tensors)


def _row(shape: Shape) -> Shape:
    return (*shape[:-1], 1)


def _col(shape: Shape) -> Shape:
    return (*shape[:-2], 1, shape[-1])


def _norm(i: int, kind: str) -> TempOp:
    t = Temp(i, kind, ())
    return TempOp(kind, (t,), (t,), i)


def _adafactor_loop(tensors: tuple[tuple[Shape, str], ...]) -> list[TempOp]:
    ops: list[TempOp] = []
    held: dict[str, Temp] = {}  # the locals holding a temporary

    def rebind(local: str, temp: Temp) -> tuple[Temp, ...]:
        old = held.get(local)
        held[local] = temp
        return (old,) if old is not None else ()

    for i, (shape, _) in enumerate(tensors):
        ops.append(_norm(i, "param_norm"))
        estimate = Temp(i, "var_estimate", shape)
        if len(shape) >= 2:
            for local, dims in (("row_mean", _row(shape)), ("col_mean", _col(shape))):
                t = Temp(i, local, dims)
                ops.append(TempOp(local, (t,), rebind(local, t), i))
            mean = Temp(i, "row_var_mean", (*shape[:-2], 1, 1))
            ops += [TempOp("var_estimate", (estimate,), (), i),
                    TempOp("row_var_mean", (mean,), (mean, *rebind("update", estimate)), i)]
        else:
            squared = Temp(i, "grad_squared", shape)
            ops += [TempOp("grad_squared", (squared,), rebind("grad_squared", squared), i),
                    TempOp("var_estimate", (estimate,), rebind("update", estimate), i)]
        ops.append(_norm(i, "update_norm"))
    ends = tuple(held[k] for k in ("row_mean", "col_mean", "grad_squared", "update") if k in held)
    return ops + [TempOp("end", (), ends)] if ends else ops


def _adafactor_foreach(tensors: tuple[tuple[Shape, str], ...]) -> list[TempOp]:
    ops: list[TempOp] = []
    by_dtype: dict[str, dict[bool, list[int]]] = {}
    for i, (shape, dtype) in enumerate(tensors):
        by_dtype.setdefault(dtype, {}).setdefault(len(shape) >= 2, []).append(i)
    updates: tuple[Temp, ...] = ()
    for factored, members in (group for kinds in reversed(by_dtype.values()) for group in kinds.items()):
        one = Temp(-1, "step_increment", (), "fp32", host=True)
        ops.append(TempOp("step_increment", (one,), (one,)))
        ops += [_norm(i, "param_norm") for i in members]
        shapes = [tensors[i][0] for i in members]
        estimates = tuple(Temp(i, "var_estimate", shape) for i, shape in zip(members, shapes))
        if factored:
            for kind, dims in (("row_mean", _row), ("col_mean", _col)):
                means = tuple(Temp(i, kind, dims(shape)) for i, shape in zip(members, shapes))
                ops.append(TempOp(f"{kind}s", means, means[::-1]))
            means = tuple(Temp(i, "row_var_mean", (*shape[:-2], 1, 1)) for i, shape in zip(members, shapes))
            ops += [TempOp("var_estimates", estimates), TempOp("row_var_means", means, means[::-1] + updates[::-1])]
        else:
            squared = tuple(Temp(i, "grad_squared", shape) for i, shape in zip(members, shapes))
            ops += [TempOp("grads_squared", squared, squared[::-1]), TempOp("var_estimates", estimates, updates[::-1])]
        updates = estimates
        ops += [_norm(i, "update_norm") for i in members]
    return ops + [TempOp("end", (), updates[::-1])] if updates else ops


def _torchao_temps(kind: str):
    """torchao's compiled `single_param_adam`'s buffers, parameter by parameter (models/lowbit.py's notes)."""

    def plan(impl: str, tensors: tuple[tuple[Shape, str], ...]) -> list[TempOp]:
        ops: list[TempOp] = []
        for i, (shape, _dtype) in enumerate(tensors):
            numel = prod(shape)
            one, inc = Temp(i, "step_one", (), "int64", host=True), Temp(i, "step_add", (), "fp32", host=True)
            ops.append(TempOp("step_increment", (one, inc), (inc, one), i))
            if not lowbit.torchao_quantised(kind, numel):
                continue
            pair = lambda k, s, dt: (Temp(i, f"exp_avg.{k}", s, dt), Temp(i, f"exp_avg_sq.{k}", s, dt))  # noqa: E731
            block = lowbit.TORCHAO_BLOCKS[kind]
            scales = pair("scale", (numel // block,), "fp32")
            if kind == "fp8":  # a last dim that is no multiple of the block: the new codes made apart, then copied
                made = scales + (pair("codes", shape, "fp8_e4m3") if shape and shape[-1] % block else ())
                ops.append(TempOp("compiled_update", made, made, i))
                continue
            moments = pair("f32", shape, "fp32")
            if kind == "8bit":
                ops.append(TempOp("compiled_update", scales + moments, scales + moments, i))
                continue
            halves, codes = pair("codes_half", (numel // 2,), "int8"), pair("codes_u8", (numel,), "int8")
            indices = pair("code_index", (numel,), "int64")
            ops += [TempOp("compiled_update.unpack", halves + codes, halves, i),
                    TempOp("compiled_update", scales + moments + indices, codes + scales + moments + indices, i)]
        return ops

    return plan



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
    OptimizerSpec("adam-8bit", _adam_8bit, flops_per_element=16, capture=False,
                  shared_states=(("optimizer.qmaps", (2, 256), "fp32"),)),
    # models/lowbit.py: torchao 0.18.0 (torchao/optim/adam.py, subclass_{8bit,4bit,fp8}.py) and bitsandbytes 0.50.2
    # (bitsandbytes/optim/optimizer.py, functional.py get_paged); torchao's step is one compiled update per parameter
    # whatever torch's impl flags say; bitsandbytes' one fused CUDA kernel per parameter
    *(OptimizerSpec(f"adamw-{kind}" if kind != "8bit" else "adamw-8bit-torchao", lowbit.torchao_states(kind),
                    temps=_torchao_temps(kind), flops_per_element=16, capture=False, reference=factory,
                    per_param=True, host_step=True, compiled_step=True)
      for kind, factory in (("8bit", lowbit.torchao_adamw8bit), ("4bit", lowbit.torchao_adamw4bit),
                            ("fp8", lowbit.torchao_adamwfp8))),
    OptimizerSpec("adamw-8bit-bnb", _adam_8bit, flops_per_element=16, reference=lowbit.bnb_adamw8bit,
                  per_param=True, shared_states=(("optimizer.qmaps", (2, 256), "fp32"),)),
    OptimizerSpec("paged-adamw-8bit", _adam_8bit, flops_per_element=16,
                  reference=lowbit.bnb_paged_adamw8bit, per_param=True,
                  shared_states=(("optimizer.qmaps", (2, 256), "fp32"),)),
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
    OptimizerSpec("adafactor", _adafactor, temps=_adafactor_temps, by_shape=True, flops_per_element=10,
                  torch_class="Adafactor", impls=("foreach", "for-loop"), capture=False),
)
OPTIMIZERS: dict[str, OptimizerSpec] = {spec.name: spec for spec in OPTIMIZER_SPECS}


def state_specs(optimizer: str, numel: int, state_dtype: str, shape: Shape = ()) -> StateSpecs:
    """(state, shape, dtype) of each state tensor of one tensor the rank's optimizer updates: `numel` elements (a
    parameter, its shard or a flat partition) of `shape` (read only where the states follow the shape,
    `OptimizerSpec.by_shape`; the others are shaped `(numel,)`)."""
    spec = OPTIMIZERS[optimizer]
    if spec.by_shape and prod(shape) != numel:
        raise ValueError(f"{optimizer}'s states follow the whole parameter's shape, not a partition of it: {numel} "
                         f"elements of shape {shape}")
    return spec.states(tuple(shape) if spec.by_shape else (numel,), state_dtype)


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
