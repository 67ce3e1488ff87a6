"""A view written in place gets the backward the real autograd engine builds for it (`view_replays`): one
`AsStridedBackward0` that allocates the base's whole extent, not the view replay fake tensors get."""

from __future__ import annotations

import weakref

import torch
from torch._subclasses.fake_tensor import FakeTensor

INPLACE_KEY = "peakledger_inplace_op"  # a CopySlices node's metadata: the index of the in-place op it wraps


class view_replays:
    """The backward of a view written in place, as the real autograd engine builds it. After an in-place op
    on a view whose base requires grad, autograd gives the base a `CopySlices` node and regenerates the view's
    grad_fn. For a real tensor that node is one `AsStridedBackward0` (torch/csrc/autograd/variable.cpp
    `VariableHooks::grad_fn`), whose backward allocates the base's whole extent and scatters the gradient in
    (FunctionsManual.cpp `as_strided_backward`: `grad.new_zeros(base_size)`); a fake tensor dispatches to
    Python, so autograd replays the view ops instead (torchgen gen_inplace_or_view_type.py records a
    `view_func` when `is_python_dispatch()`), and a `ViewBackward0` allocates nothing. Swinv2's
    `continuous_position_bias_mlp` (modeling_swinv2.py: `nn.ReLU(inplace=True)` on the view F.linear returns)
    is one: the real backward holds one more gradient of the MLP's hidden size per attention block. The node
    the CopySlices wraps (the in-place ReLU's) saves what no `_saved_*` attribute shows; the recorder counts
    those saves, made between the in-place op and `resolve`, as the CopySlices' (record.py `INPLACE_KEY`), so
    the ReLU's result lives until the CopySlices has run, as in the real run.

    `note` sees each forward op (an in-place write on a view that requires grad is remembered), `resolve`
    (at the recorder's next op) finds the replayed chain of view nodes down to the `CopySlices` and hooks it:
    when the chain's gradient for the base is still a view of the gradient it received (no kernel of the chain
    allocated; a `SliceBackward0` allocates the base's extent as the real node does), its last node returns
    what `as_strided_backward` returns instead: a zeroed buffer of the base's extent with the gradient copied
    in. Not covered (they keep the fake program's backward): a view made before an in-place write to its base,
    and views whose memory overlaps (as_strided_backward's index_add path)."""

    def __init__(self) -> None:
        self.weakref = weakref
        self.pending: list = []

    def note(self, func, args, op: int) -> None:
        schema = func._schema
        if not args or not schema.arguments or schema.arguments[0].alias_info is None \
                or not schema.arguments[0].alias_info.is_write:
            return
        t = args[0]
        if isinstance(t, FakeTensor) and t._is_view() and torch.is_grad_enabled():
            base = t._base
            geometry = ((tuple(base.shape), tuple(base.stride()), base.storage_offset()),
                        (tuple(t.shape), tuple(t.stride()), t.storage_offset()))
            self.pending.append((self.weakref.ref(t), geometry, op))

    def resolve(self, now: int) -> None:
        """`now`: the forward ops recorded so far; the saves made since the in-place op (autograd saves its
        result after the view and detach ops it dispatches to build the CopySlices) are the CopySlices'."""
        pending, self.pending = self.pending, []
        for ref, geometry, op in pending:
            t = ref()
            top = t.grad_fn if t is not None and t.requires_grad else None
            chain, node = [], top
            while node is not None and len(chain) < 16 and node.name() != "torch::autograd::CopySlices":
                chain.append(node)
                node = node.next_functions[0][0] if node.next_functions else None
            if node is None or not chain or "peakledger_replay" in chain[-1].metadata:
                continue
            node.metadata.setdefault(INPLACE_KEY, (op, now))  # the CopySlices: the saves of the op it wraps
            chain[-1].metadata["peakledger_replay"] = True
            self._hook(chain[0], chain[-1], *geometry)

    @staticmethod
    def _hook(top, bottom, base, view) -> None:
        received = {}

        def pre(grad_outputs):
            g = grad_outputs[0] if grad_outputs else None
            received["storage"] = g.untyped_storage()._cdata if g is not None else None

        def post(grad_inputs, grad_outputs):
            g = grad_inputs[0] if grad_inputs else None
            seen = received.pop("storage", None)
            if g is None or seen is None or g.untyped_storage()._cdata != seen:
                return None
            sizes, strides, offset = base
            shared = min(offset, view[2])
            extent = max(_min_storage(sizes, strides, offset - shared),
                         _min_storage(view[0], view[1], view[2] - shared))
            z = g.new_zeros((extent,))
            out = z.as_strided(sizes, strides, offset - shared)
            out.copy_(g)
            return (out,) + tuple(grad_inputs[1:])

        top.register_prehook(pre)
        bottom.register_hook(post)


def _min_storage(sizes, strides, offset: int) -> int:
    """Elements a strided tensor spans from its storage's start (ATen's `_min_storage_size`)."""
    if any(s == 0 for s in sizes):
        return offset
    return offset + 1 + sum((s - 1) * st for s, st in zip(sizes, strides))
