"""The forward tape: a describer's account of one micro-batch's forward pass, tensor by tensor.

A describer does not compute memory. It lists the forward ops in execution order (`TapeOp`), each with
the tensors it reads and creates, the tensors autograd saves for its backward, and the parameters it
uses. `models/autograd.py` then replays the tape like torch's autograd would (reference counts,
saved tensors released by their backward node, gradients flowing in reverse) and emits the
simulator's ops with exact alloc/free lists. Views (split, transpose of a contiguous tensor, view)
are not tensors here: ops read the base tensor.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from math import prod

from .config import dtype_bytes


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: str
    requires_grad: bool = True  # float activations on the path to the loss

    @property
    def nbytes(self) -> int:
        return prod(self.shape) * dtype_bytes(self.dtype)


@dataclass(frozen=True)
class ParamSpec:
    """A parameter tensor, named as `model.named_parameters()` names it (tied weights appear once)."""

    name: str
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return prod(self.shape)


@dataclass(frozen=True)
class TapeOp:
    """One forward op.

    inputs       tensor names read (the batch and earlier outputs).
    outputs      tensors created (allocated when the op starts).
    saves        tensor names (inputs or outputs) autograd keeps until this op's backward ran.
    params       parameter names used; each gets a gradient contribution in backward.
    casts        parameter names autocast copies to 16-bit here (the copy is saved for backward).
    passthrough  backward hands grad_output on unchanged to same-shaped inputs (add, dropout-free).
    workspace    forward temporaries alive only during the op.
    bwd_workspace  backward temporaries alive only during the op's backward.
    region       activation-checkpoint region (the layer index) or None.
    """

    name: str
    kind: str
    inputs: tuple[str, ...]
    outputs: tuple[TensorSpec, ...]
    saves: tuple[str, ...] = ()
    params: tuple[str, ...] = ()
    casts: tuple[str, ...] = ()
    passthrough: bool = False
    workspace: tuple[TensorSpec, ...] = ()
    bwd_workspace: tuple[TensorSpec, ...] = ()
    flops: int = 0
    region: int | None = None


@dataclass
class Tape:
    """The forward pass of one micro-batch, plus the parameters it uses."""

    params: list[ParamSpec]
    ops: list[TapeOp] = field(default_factory=list)
    inputs: list[TensorSpec] = field(default_factory=list)  # the batch, allocated before the forward
    buffers: list[TensorSpec] = field(default_factory=list)  # registered module buffers, allocated at load
    held: tuple[str, ...] = ()  # tensors the caller keeps until backward ends (logits, loss)
    loss: str = "loss"

    def add(self, name: str, kind: str, inputs, outputs, **kw) -> tuple[TensorSpec, ...]:
        op = TapeOp(name=name, kind=kind, inputs=tuple(inputs), outputs=tuple(outputs), **kw)
        self.ops.append(op)
        return op.outputs

    @property
    def n_params(self) -> int:
        return sum(p.numel for p in self.params)

    def forward_flops(self) -> int:
        return sum(op.flops for op in self.ops)
