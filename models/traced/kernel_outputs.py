"""Outputs as the real kernels make them, where an op's fake rule makes them otherwise.

A fake tensor's shape, strides and storage come from the op's meta rule or Python decomposition; the real CPU
and CUDA kernels can differ in two ways that change memory:
- layout: `native_layer_norm_backward`'s decomposition gives grad_input grad_out's strides, the kernel a
  contiguous tensor; a gradient of another layout changes what the next backward ops copy;
- storage size: a reduced loss whose kernel writes the unreduced loss into its output and then shrinks it with
  `resize_` returns a scalar that keeps the full storage (a resize never gives memory back), alive as long as
  the loss is; the meta rule makes a 4-byte scalar.

`real_outputs(func, args, kwargs, out)` is the one entry: the recorder (recorder.py) passes every op's outputs
through it.
"""

from __future__ import annotations

import math

import torch

aten = torch.ops.aten

# layer_norm.cpp `layer_norm_backward_cpu`: `dX = empty_like(*X)` with `X = input.expect_contiguous()` (the CUDA
# kernel likewise): contiguous whatever grad_out's strides (Swin's transposed gradients made every Linear's
# `ViewBackward0` clone on fake tensors, never in the real run)
CONTIGUOUS_OUTPUTS = {aten.native_layer_norm_backward.default}

# aten/src/ATen/native/Loss.cpp, for reduction mean or sum: `mse_loss` and `smooth_l1_loss` (meta:
# `build_borrowing_binary_op` over input and target, then `resize_({})`), `binary_cross_entropy` (CPU and CUDA:
# `loss = at::empty_like(input)`, then `loss.resize_as_(loss_reduced)`), `soft_margin_loss` (`neg_out(output,
# input)`, then `output.resize_({})`). Per op: the arguments whose broadcast shape the unreduced loss has.
FULL_STORAGE_LOSSES = {aten.mse_loss.default: ("self", "target"),
                       aten.smooth_l1_loss.default: ("self", "target"),
                       aten.binary_cross_entropy.default: ("self",),
                       aten.soft_margin_loss.default: ("self",)}
REDUCTION_NONE = 0  # at::Reduction::None


def _argument(func, args, kwargs, name: str):
    for i, a in enumerate(func._schema.arguments):
        if a.name == name:
            if i < len(args):
                return args[i]
            return (kwargs or {}).get(name, a.default_value)
    raise KeyError(name)


def _full_storage(func, args, kwargs, out):
    shapes = FULL_STORAGE_LOSSES.get(func)
    if shapes is None or not isinstance(out, torch.Tensor) or out.dim() != 0:
        return out
    if _argument(func, args, kwargs, "reduction") == REDUCTION_NONE:
        return out
    shape = torch.broadcast_shapes(*(_argument(func, args, kwargs, n).shape for n in shapes))
    numel = math.prod(shape)
    if numel <= 1:
        return out
    return out.new_empty((numel,)).as_strided((), ())


def _layout(func, out):
    if func not in CONTIGUOUS_OUTPUTS or not isinstance(out, (tuple, list)):
        return out
    return type(out)(o.new_empty(o.shape) if isinstance(o, torch.Tensor) and not o.is_contiguous() else o
                     for o in out)


def real_outputs(func, args, kwargs, out):
    """`out` with the layout and the storage size the real kernel gives it."""
    return _full_storage(func, args, kwargs, _layout(func, out))
