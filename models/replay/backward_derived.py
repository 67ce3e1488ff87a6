"""The backward pass of a hand-written tape, derived op by op the way torch's autograd formulas run.

A hand-written tape (no recorded backward) runs its ops' backward nodes in reverse here (`derived_backward`):
each checkpoint region is recomputed before its first node and let go after its last (checkpoint.py), and each
node between the engine's hooks (`run_node`) brings an offloaded op's saves back (offload.py), makes its
inputs' gradients (a tensor read as equal views gets one piece per view, concatenated by the split's backward
once all are in), hands its parameters' gradients to the engine and sums into gradients already there
(grads.py), frees its outputs' gradients and releases its saved tensors; autocast's weight copy gets its
gradient turned fp32 by a node of its own. `end_batch` ends either backward (backward_recorded.py's too): the
caller lets go of its outputs and the batch. The pass is played from the plan's recording where it can, and a
traced tape follows its recorded nodes instead (the package's `run_backward`, models/replay/__init__.py). Each step
takes the replay's state (state.py `ReplayState`).
"""

from __future__ import annotations

from ...simulator.events import Category, Phase
from ..config import dtype_bytes
from ..tape import TapeOp
from .checkpoint import end_region, recompute
from .grads import add_grad, flush_after_node, param_grad, sum_into_pinned
from .offload_streams import end_backward, unpack_ids
from .state import ReplayState


def derived_backward(state: ReplayState) -> None:
    """The backward nodes of the micro-batch's forward ops, in reverse, with the regions recomputed."""
    ops, plan = state.tape.ops, state.plan
    before_op, after_op = state.builder.engine.before_op, state.builder.engine.after_op
    region_done: set[int] = set()
    for i in range(len(ops) - 1, -1, -1):
        op = ops[i]
        if op.region is not None and op.region not in region_done:
            region_done.add(op.region)
            recompute(state, op.region)
        if plan.needs_backward[i]:
            before_op(state, i, Phase.BACKWARD)
            run_node(state, i, op)
            after_op(state, i, Phase.BACKWARD)
        if op.region is not None and i == plan.regions[op.region][0]:
            end_region(state, op.region)
    end_batch(state, [])


def end_batch(state: ReplayState, frees: list[int]) -> None:
    """The micro-batch's backward is done (activation_offload streams: torchtune's end-of-backward callback lets
    its backward stash go): the caller drops its outputs and the batch (with `frees`)."""
    frees += end_backward(state)
    for name in state.tape.held:
        state.release(name, frees)
    for t in state.tape.inputs:
        state.release(t.name, frees)
    state.builder.op("batch.release", Phase.BACKWARD, state.step, state.mb, [], frees)


def run_node(state: ReplayState, i: int, op: TapeOp) -> None:
    """Forward op `i`'s backward node (and the split's and autocast copy's nodes after it)."""
    builder, plan, grad_of = state.builder, state.plan, state.grad_of
    allocs, frees = [], []
    frees += unpack_ids(state, i)
    out0 = op.outputs[0]
    grad_out = grad_of.get(out0.name)
    views = plan.view_reads[i]
    for name in dict.fromkeys(views):
        # e.g. SDPA on (or q k^T and a copy of v from) the q, k, v splits of one projection: one gradient
        # per view, concatenated into the base's gradient by the split's backward once all are in
        spec = state.specs[name]
        pieces = state.view_pieces.setdefault(name, [])
        for _ in range(views.count(name)):
            pieces.append(builder.block(f"{name}.grad.view{len(pieces)}", spec.nbytes // plan.view_count[name],
                                        Category.TEMPORARY, spec.dtype, spec.shape))
            allocs.append(pieces[-1])
    for name in op.inputs:
        if not plan.rg.get(name) or name in views:
            continue
        spec = state.specs[name]
        if op.passthrough and grad_out is not None and spec.shape == out0.shape and spec.dtype == out0.dtype:
            # (a mixed-dtype add casts grad_output for its 16-bit input: a new tensor, below)
            if name in grad_of:
                if grad_of[name].pinned:  # summed out of place: a new tensor becomes its gradient
                    sum_into_pinned(state, name)
                continue  # accumulated in place into the existing gradient
            grad_out.refs += 1
            grad_of[name] = grad_out
            continue
        blk = builder.block(f"{name}.grad", spec.nbytes, Category.TEMPORARY, spec.dtype, spec.shape)
        allocs.append(blk)
        add_grad(state, name, blk, frees)
    cast_grads = []  # autocast: the op's gradient of a 16-bit weight copy, turned fp32 by the next node
    for p in op.params:
        if p in op.casts and p in state.trainable:
            cdt = builder.setup.precision.compute
            tmp = builder.block(f"{p}.autocast_copy.grad", builder.param_numel[p] * dtype_bytes(cdt),
                                Category.TEMPORARY, cdt, builder.param_shape[p])
            allocs.append(tmp)
            cast_grads.append((p, tmp))
        else:
            param_grad(state, p, allocs, frees)
    workspace = [builder.block(w.name, w.nbytes, Category.TEMPORARY, w.dtype, w.shape) for w in op.bwd_workspace]
    allocs += workspace
    frees += [w.id for w in workspace]
    for o in op.outputs:
        storage = grad_of.pop(o.name, None)
        if storage is not None:
            storage.refs -= 1
            if storage.refs == 0 and not storage.pinned:
                frees.append(storage.block.id)
    saved = state.saved_at.get(i, ())
    for s in dict.fromkeys(saved):  # a tensor saved twice goes when its first listing would
        for _ in range(saved.count(s)):
            state.release(s, frees)
    bytes_moved = 2 * sum(a.nbytes for a in allocs)
    builder.op(f"{op.name}.backward", Phase.BACKWARD, state.step, state.mb, allocs, frees,
               flops=2 * op.flops, bytes_moved=bytes_moved)
    flush_after_node(state)
    for name in dict.fromkeys(views):
        if len(state.view_pieces[name]) < plan.view_count[name]:
            continue  # the split's backward waits for the other views' gradients
        spec, pieces = state.specs[name], state.view_pieces.pop(name)
        allocs, frees = [], []
        blk = builder.block(f"{name}.grad", spec.nbytes, Category.TEMPORARY, spec.dtype, spec.shape)
        allocs.append(blk)
        add_grad(state, name, blk, frees)
        frees += [p.id for p in pieces]
        builder.op(f"{op.name}.split.backward", Phase.BACKWARD, state.step, state.mb, allocs, frees,
                   bytes_moved=2 * spec.nbytes)
        flush_after_node(state)
    if cast_grads:  # ToCopyBackward: after the op's node released its saved tensors and grad_output
        allocs, frees = [], []
        for p, tmp in cast_grads:
            param_grad(state, p, allocs, frees)
            frees.append(tmp.id)
        builder.op(f"{op.name}.autocast_copy.backward", Phase.BACKWARD, state.step, state.mb, allocs, frees,
                   bytes_moved=sum(a.nbytes for a in allocs))
        flush_after_node(state)
