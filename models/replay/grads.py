"""Gradients in the replay: where an activation's gradient lives, and how gradients are summed and handed on.

An activation's gradient is a `GradStorage`, shared by every tensor an add hands it on to unchanged
(`ReplayState.grad_of`, name -> storage, with a count of those names); a new contribution to a gradient already
there is summed into it in place (the contribution goes with its node, `add_grad`), or, when the gradient is
`pinned` (owned outside the replay: a pipeline stage's gradient receive buffer), out of place once the node is
done (`sum_into_pinned` queues it in `ReplayState.after_node`, `flush_after_node` emits it). A parameter's
gradient is the engine's (`GradState`: which parameters hold a `.grad`; `Engine.param_grad` makes, accumulates
and shards it: `param_grad`). `GradStorage` and `GradState` are parts of the state (state.py). The backward
passes (backward_derived.py, backward_recorded.py) call these; the engines' hooks call `replace_grad`, and a
pipeline stage hands gradients in and out (`receive_grad`, `take_grad`). Each takes the replay's state
(state.py `ReplayState`).
"""

from __future__ import annotations

from ...simulator.events import Block, Category, Phase
from .state import GradStorage, ReplayState


def replace_grad(state: ReplayState, tensor: str, block: Block) -> list[int]:
    """`block` becomes `tensor`'s gradient (a new storage of its own); the old storage's block id, in a list, when
    that was its last reference, else an empty list (the engines' hooks that make a gradient anew: DTensor's
    all-reduce and out-of-place sum, the backward of a slice)."""
    storage = state.grad_of[tensor]
    storage.refs -= 1
    state.grad_of[tensor] = GradStorage(block)
    return [storage.block.id] if storage.refs == 0 else []


def param_grad(state: ReplayState, p: str, allocs: list, frees: list) -> None:
    """A gradient contribution for parameter `p`, when it trains: the engine's (`Engine.param_grad`)."""
    if p in state.trainable:
        state.builder.engine.param_grad(state, p, allocs, frees)
        grads = state.grads
        if grads.in_backward is not None and state.grad_seen.get(p, 1) == state.plan.grad_uses.get(p, 1):
            grads.ready.append(p)  # its last contribution (grad_accum 1): AccumulateGrad runs the hook next
        offload = getattr(state.builder, "cpu_offload", None)  # torchao's post-accumulate-grad hook, models/
        if offload is not None:  # offload_libraries.py: once the gradient is whole (a tied weight's last use)
            uses = state.plan.grad_uses.get(p, 1)
            if uses == 1 or state.grad_seen.get(p) == uses:
                offload.grad_hook(state, p)


def add_grad(state: ReplayState, name: str, blk: Block, frees: list[int]) -> None:
    """`blk`, a new gradient of `name`, becomes its gradient, or is summed into the one there: in place (`blk`
    goes with the node), or into a pinned one out of place (`sum_into_pinned`)."""
    storage = state.grad_of.get(name)
    if storage is None:
        state.grad_of[name] = GradStorage(blk)
    elif storage.pinned:
        sum_into_pinned(state, name, blk)
    else:
        frees.append(blk.id)  # summed into the gradient already there


def sum_into_pinned(state: ReplayState, name: str, contribution: Block | None = None) -> None:
    """A gradient summed into `name`'s pinned gradient: out of place, once the node that made it is done
    (the engine adds a node's outputs to the next input buffers then), the sum a new tensor that becomes
    `name`'s gradient; the contribution goes with it (one handed on unchanged, `None`, stays its node's)."""
    spec = state.specs[name]
    total = state.builder.block(f"{name}.grad_sum", spec.nbytes, Category.TEMPORARY, spec.dtype, spec.shape)
    state.after_node.append((f"{name}.grad_accumulate", [total], [contribution.id] if contribution else []))
    state.grad_of[name].refs -= 1
    state.grad_of[name] = GradStorage(total)


def receive_grad(state: ReplayState, name: str, block: Block) -> None:
    """`name`'s gradient arrives from outside the replay, in `block` (a pipeline stage's gradient receive
    buffer, its owner's for good): pinned, before the backward."""
    state.grad_of[name] = GradStorage(block, pinned=True)


def take_grad(state: ReplayState, name: str) -> Block | None:
    """The gradient the backward left for `name`, a tensor no op of the tape made (a pipeline stage's
    received input): handed to the caller, who frees it."""
    storage = state.grad_of.pop(name, None)
    return None if storage is None or storage.pinned else storage.block


def flush_after_node(state: ReplayState) -> None:
    """Out-of-place sums in AccumulateGrad input buffers (tied weights), after the node that fed them."""
    for name, allocs, frees in state.after_node:
        state.builder.op(name, Phase.BACKWARD, state.step, state.mb, allocs, frees,
                         bytes_moved=3 * sum(a.nbytes for a in allocs))
    state.after_node.clear()
    grads_ready(state)


def grads_ready(state: ReplayState) -> None:
    """Optimizer-in-backward: each parameter whose gradient the node just finished (its `.grad` made, a tied
    weight's sum done) has its post-accumulate-grad hook run now, its optimizer's step() and zero_grad()
    (`GradState.in_backward`; torch's AccumulateGrad node runs right after the node that fed it, and calls the
    hook once `.grad` is set: torch/csrc/autograd/functions/accumulate_grad.h, torch 2.13)."""
    grads = state.grads
    if grads.ready:
        ready, grads.ready = grads.ready, []
        grads.in_backward(state, ready)
