"""Replay a forward tape the way torch's autograd does, and emit the simulator's ops.

Memory in torch is freed when the last reference goes. Here each tensor has a count of the reasons it
is still alive, and is freed at the end of the op that drops the last one:

- forward use: released by the last forward op that reads it (or by its producer if nothing reads it);
- saved for backward: one per saving op, released when that op's backward node has run;
- held by the caller (logits, the batch): released when the micro-batch's backward ends;
- activation checkpointing: a region's inputs are held until the region's backward is done; inside a
  region nothing is saved in the forward pass, and the region is recomputed (with saves) right before
  its backward, up to its last saving op (torch's non-reentrant checkpoint stops once everything saved
  is saved again; an op that saves only its inputs is not run at all).
- selective activation checkpointing (`TapeOp.cached`, policy "op-policy"): the region's first pass
  also keeps the outputs of its cached ops (torch's SAC storage holds them); the recompute hands
  them back instead of running the op (no FLOPs, no allocation; autocast's weight casts and the node's
  saves still happen) and lets go of them. Outputs the early stop never reaches stay held until the
  region's backward is done.
- autocast's weight cache: a 16-bit copy of a trainable parameter (`TapeOp.casts`) made in the forward
  pass stays in autocast's cache until the forward ends, saved or not (a linear's bias copy is never
  saved; nothing saves the weight copy of a checkpointed or offloaded op); the copies a recompute makes
  live only as long as their saves.
- offloading (`TapeOp.offloaded`, policy "offload", `torch.autograd.graph.save_on_cpu`): each tensor an
  op saves (its saved parameters and autocast weight copies too, a view by its own size) is copied as
  it is saved into a new host block, one per save; the device tensor gets no saved reason, so it goes
  with its last forward use. On a GPU profile the copies are in `Pool.HOST`, and the backward node
  first copies each back into a new device block that lives for that node only. On a CPU profile host
  and device are one memory: the copies stay in the one pool, and the backward reads them as they are.

Gradients flow in reverse: a backward node allocates the gradients of its inputs (an add hands its
grad_output on unchanged), frees the gradients of its outputs, and releases its saved tensors.
A parameter's gradient becomes `.grad` when it is its first contribution in the step; later
contributions (more micro-batches, `set_to_none=False`) are temporaries accumulated in place. A tied
weight's contributions within one backward are summed out of place in its AccumulateGrad node's input
buffer first (`Engine.param_grad`).
A tensor read as equal views (`TapeOp.views`: q, k and v split from one projection, read by one op or
by several) gets one view-sized gradient piece from each view's backward node; its own gradient is made
(SplitBackward's concatenation, the pieces then freed) right after the node that gives the last piece.

The replay is `MicroBatchReplay`, made of one module per concept in this package, each a set of steps that take
the replay's state (`ReplayState`, state.py: every field documented; the live blocks, the reasons each is alive,
`hold` and `release`) and reach the builder through it; the engines' hooks (models/parallel) get the same state:
- state.py (`ReplayState`, `GradStorage`, `GradState`): what one micro-batch's replay is of, and everything its
  passes change;
- plan.py (`ReplayPlan`, `load_plan`): the plan, what the tape's replay knows before it runs, made once per tape;
- forward.py (`run_forward`, `run_op`): the forward pass op by op, and a recompute's ops;
- checkpoint.py (`recompute`, `end_region`): a checkpoint region recomputed before its backward, let go after;
- backward_derived.py (`derived_backward`): a hand-written tape's backward, node by node in reverse;
- backward_recorded.py (`recorded_backward`): a traced tape's backward, as the real engine ran it;
- grads.py (`replace_grad`, `add_grad`, `param_grad`): activation gradients' storages (state.py `GradStorage`) and
  sums, parameter gradients through the engine (state.py `GradState`: which parameters hold a `.grad`);
- offload.py (`pack`, `unpack`): save_on_cpu's pack and unpack hooks;
- template.py: a pass played from the plan's first recording of it where the engine's hooks allow.
"""

from __future__ import annotations

from ...simulator.events import Block
from ..config import dtype_bytes
from ..tape import Tape, TensorSpec
from . import template
from .backward_derived import derived_backward
from .backward_recorded import recorded_backward
from .forward import drop_output, run_forward
from .grads import receive_grad, replace_grad, take_grad
from .plan import load_plan
from .state import GradState, ReplayState

__all__ = ["MicroBatchReplay", "ReplayState", "GradState", "replace_grad", "param_bytes", "run_forward",
           "run_backward"]


class MicroBatchReplay:
    """Emit forward and backward ops for one micro-batch of a tape, through a `builder` (models/builder.py): its
    state (`state`, a `ReplayState`) with its plan (plan.py), its forward (forward.py), its backward derived op by
    op (backward_derived.py) or, for a traced tape, following its recording (backward_recorded.py), with checkpoint
    regions recomputed (checkpoint.py), gradients summed and handed to the engine (grads.py) and offloaded saves
    through save_on_cpu's hooks (offload.py); a pass the plan's first replay recorded is played from that
    recording where the engine's hooks allow it (template.py)."""

    __slots__ = ("state",)

    def __init__(self, builder, tape: Tape, step: int, micro_batch: int, grads: GradState,
                 external: dict[str, tuple[TensorSpec, Block]] | None = None) -> None:
        """`external`: tensors the tape reads that exist outside this replay (a pipeline stage's received
        activation, the views of a whole batch), with their blocks: read and saved, never freed here."""
        external = external or {}
        specs: dict[str, TensorSpec] = {t.name: t for t in tape.inputs}
        specs.update({name: spec for name, (spec, _) in external.items()})
        trainable = builder.trainable
        plan, plan_key = load_plan(builder, tape, trainable, external, specs)
        self.state = ReplayState(builder=builder, tape=tape, step=step, mb=micro_batch, grads=grads,
                                 external=external, trainable=trainable, specs=specs, plan=plan, plan_key=plan_key)

    def run(self) -> None:
        """The micro-batch: its forward, then its backward (or, for passes "forward", the output dropped)."""
        state = self.state
        run_forward(state)
        if state.builder.setup.batch.passes == "forward":
            drop_output(state)
        else:
            run_backward(state)

    def forward(self) -> None:
        run_forward(self.state)

    def backward(self) -> None:
        run_backward(self.state)

    def receive_grad(self, name: str, block: Block) -> None:
        """`name`'s gradient arrives from outside the replay (grads.py `receive_grad`), before `backward()`."""
        receive_grad(self.state, name, block)

    def take_grad(self, name: str) -> Block | None:
        """The gradient the backward left for `name`, a tensor no op of the tape made (grads.py `take_grad`)."""
        return take_grad(self.state, name)


def run_backward(state: ReplayState) -> None:
    """The micro-batch's backward pass: played from the plan's recording where it can (template.py), else a traced
    tape's recorded nodes (backward_recorded.py) or a hand-written tape's, derived (backward_derived.py)."""
    template.backward(state, _backward_pass)


def _backward_pass(state: ReplayState) -> None:
    if state.tape.backward:
        recorded_backward(state)
    else:
        derived_backward(state)


def param_bytes(numel: int, dtype: str, shard: int = 1) -> int:
    """Bytes of one rank's shard of a tensor: ceil(numel / shard) elements (uneven shards are padded)."""
    return -(-numel // shard) * dtype_bytes(dtype)
