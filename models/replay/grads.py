"""Gradients in the replay: where an activation's gradient lives, and how gradients are summed and handed on.

Mixed into models/autograd.py's `MicroBatchReplay` (`GradientFlow`). An activation's gradient is a `GradStorage`,
shared by every tensor an add hands it on to unchanged (`grad_of`, name -> storage, with a count of those names);
a new contribution to a gradient already there is summed into it in place (the contribution goes with its node),
or, when the gradient is `pinned` (owned outside the replay: a pipeline stage's gradient receive buffer), out of
place once the node is done (`after_node`, emitted by `_flush_after_node`). A parameter's gradient is the
engine's (`GradState`: which parameters hold a `.grad`; `Engine.param_grad` makes, accumulates and shards it).
The backward passes (replay_backward.py, replay_recorded.py) call these; the engines' hooks call `replace_grad`,
and a pipeline stage hands gradients in and out (`receive_grad`, `take_grad`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..simulator.events import Block, Category, Phase


@dataclass
class GradState:
    """Which parameters hold a `.grad` block right now (persists across micro-batches and steps)."""

    blocks: dict[str, Block] = field(default_factory=dict)
    persistent: bool = False  # fp32 main-grad buffers allocated at load: every contribution is a temporary


class GradStorage:
    """An activation gradient's memory, shared by the tensors an add hands it to. A `pinned` one is owned
    outside the replay (a pipeline stage's gradient receive buffer): never freed here, and a gradient summed
    into it is summed out of place (autograd's input buffer adds in place only into a tensor it holds the
    last reference to: torch/csrc/autograd/input_buffer.cpp `can_accumulate_inplace`)."""

    def __init__(self, block: Block, refs: int = 1, pinned: bool = False) -> None:
        self.block = block
        self.refs = refs
        self.pinned = pinned


def replace_grad(replay, tensor: str, block: Block) -> list[int]:
    """`block` becomes `tensor`'s gradient (a new storage of its own); the old storage's block id, in a list, when
    that was its last reference, else an empty list (the engines' hooks that make a gradient anew: DTensor's
    all-reduce and out-of-place sum, the backward of a slice)."""
    storage = replay.grad_of[tensor]
    storage.refs -= 1
    replay.grad_of[tensor] = GradStorage(block)
    return [storage.block.id] if storage.refs == 0 else []


class GradientFlow:
    """Activation gradients' storages and sums, parameter gradients through the engine (the replay's state: tape,
    builder, `grad_of`, `after_node`)."""

    def _param_grad(self, p: str, allocs: list, frees: list) -> None:
        if p in self.trainable:
            self.b.engine.param_grad(self, p, allocs, frees)

    def _add_grad(self, name: str, blk: Block, frees: list[int]) -> None:
        """`blk`, a new gradient of `name`, becomes its gradient, or is summed into the one there: in place (`blk`
        goes with the node), or into a pinned one out of place (`_sum_into_pinned`)."""
        storage = self.grad_of.get(name)
        if storage is None:
            self.grad_of[name] = GradStorage(blk)
        elif storage.pinned:
            self._sum_into_pinned(name, blk)
        else:
            frees.append(blk.id)  # summed into the gradient already there

    def _sum_into_pinned(self, name: str, contribution: Block | None = None) -> None:
        """A gradient summed into `name`'s pinned gradient: out of place, once the node that made it is done
        (the engine adds a node's outputs to the next input buffers then), the sum a new tensor that becomes
        `name`'s gradient; the contribution goes with it (one handed on unchanged, `None`, stays its node's)."""
        spec = self.specs[name]
        total = self.b.block(f"{name}.grad_sum", spec.nbytes, Category.TEMPORARY, spec.dtype, spec.shape)
        self.after_node.append((f"{name}.grad_accumulate", [total], [contribution.id] if contribution else []))
        self.grad_of[name].refs -= 1
        self.grad_of[name] = GradStorage(total)

    def receive_grad(self, name: str, block: Block) -> None:
        """`name`'s gradient arrives from outside the replay, in `block` (a pipeline stage's gradient receive
        buffer, its owner's for good): pinned, before `backward()`."""
        self.grad_of[name] = GradStorage(block, pinned=True)

    def take_grad(self, name: str) -> Block | None:
        """The gradient the backward left for `name`, a tensor no op of the tape made (a pipeline stage's
        received input): handed to the caller, who frees it."""
        storage = self.grad_of.pop(name, None)
        return None if storage is None or storage.pinned else storage.block

    def _flush_after_node(self) -> None:
        """Out-of-place sums in AccumulateGrad input buffers (tied weights), after the node that fed them."""
        for name, allocs, frees in self.after_node:
            self.b.op(name, Phase.BACKWARD, self.step, self.mb, allocs, frees,
                      bytes_moved=3 * sum(a.nbytes for a in allocs))
        self.after_node.clear()
