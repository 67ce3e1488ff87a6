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

The replay is `MicroBatchReplay`, put together from one mixin per concept, each in its own module, all on the
state set up here (the live blocks, the reasons each is alive, `_hold` and `_release`):
- replay_plan.py (`ReplayPlan`): the plan, what the tape's replay knows before it runs, made once per tape;
- replay_forward.py (`ForwardPass`): the forward pass op by op, and a recompute's ops;
- replay_checkpoint.py (`CheckpointRegions`): a checkpoint region recomputed before its backward, let go after;
- replay_backward.py (`DerivedBackward`): a hand-written tape's backward, node by node in reverse;
- replay_recorded.py (`RecordedBackward`): a traced tape's backward, as the real engine ran it;
- replay_grads.py (`GradientFlow`, `GradState`): activation gradients' storages and sums, parameter gradients
  through the engine;
- replay_offload.py (`OffloadedSaves`): save_on_cpu's pack and unpack hooks;
- replay_template.py: a pass played from the plan's first recording of it where the engine's hooks allow.
"""

from __future__ import annotations

from ..simulator.events import Block, Category
from .config import dtype_bytes
from .replay_backward import DerivedBackward
from .replay_checkpoint import CheckpointRegions
from .replay_forward import ForwardPass
from .replay_grads import GradientFlow, GradState, GradStorage, replace_grad
from .replay_offload import OffloadedSaves
from .replay_plan import ReplayPlan
from .replay_recorded import RecordedBackward
from .tape import Tape, TensorSpec

__all__ = ["MicroBatchReplay", "GradState", "replace_grad", "param_bytes"]


class MicroBatchReplay(ReplayPlan, ForwardPass, CheckpointRegions, DerivedBackward, RecordedBackward, GradientFlow,
                       OffloadedSaves):
    """Emit forward and backward ops for one micro-batch of a tape, through a `builder` (training.py): its plan
    (replay_plan.py), its forward (replay_forward.py), its backward derived op by op (replay_backward.py) or, for a
    traced tape, following its recording (replay_recorded.py), with checkpoint regions recomputed
    (replay_checkpoint.py), gradients summed and handed to the engine (replay_grads.py) and offloaded saves through
    save_on_cpu's hooks (replay_offload.py); a pass the plan's first replay recorded is played from that recording
    where the engine's hooks allow it (replay_template.py)."""

    def __init__(self, builder, tape: Tape, step: int, micro_batch: int, grads: GradState,
                 external: dict[str, tuple[TensorSpec, Block]] | None = None) -> None:
        """`external`: tensors the tape reads that exist outside this replay (a pipeline stage's received
        activation, the views of a whole batch), with their blocks: read and saved, never freed here."""
        self.b = builder
        self.external = external or {}
        self.tape = tape
        self.step = step
        self.mb = micro_batch
        self.grads = grads
        self.trainable = builder.trainable
        self.specs: dict[str, TensorSpec] = {t.name: t for t in tape.inputs}
        self.specs.update({name: spec for name, (spec, _) in self.external.items()})
        self.live: dict[str, Block] = {}
        self.reasons: dict[str, int] = {}
        self.grad_of: dict[str, GradStorage] = {}
        self.saved_at: dict[int, tuple[str, ...]] = {}  # what each op's backward node holds
        self.contributed: set[str] = set()  # parameters with a gradient contribution in this backward
        self.grad_seen: dict[str, int] = {}  # contributions so far of a parameter read by several ops
        self.grad_buffer: dict[str, Block] = {}  # its AccumulateGrad input buffer (the sum so far)
        self.grad_had: dict[str, bool] = {}  # whether it had a `.grad` when its first contribution came
        self.after_node: list[tuple[str, list, list]] = []  # input-buffer sums to emit once a node is done
        self.autocast_cache: list[str] = []  # weight casts autocast keeps until the forward pass ends
        self.view_pieces: dict[str, list[Block]] = {}  # the pieces of a viewed tensor's gradient in so far
        self.cache_pending: dict[int, set[str]] = {}  # region -> cached outputs its recompute has not reused yet
        self._load_plan()

    # -- blocks --------------------------------------------------------------------------------------
    def _new_block(self, spec: TensorSpec, category: Category, name: str | None = None) -> Block:
        return self.b.block(name or spec.name, spec.nbytes, category, spec.dtype, spec.shape)

    def _hold(self, name: str, n: int = 1) -> None:
        self.reasons[name] = self.reasons.get(name, 0) + n

    def _release(self, name: str, frees: list[int]) -> None:
        self.reasons[name] -= 1
        if self.reasons[name] == 0 and name in self.live:
            frees.append(self.live.pop(name).id)

    def run(self) -> None:
        self.forward()
        if self.b.setup.passes == "forward":
            self.drop_output()
        else:
            self.backward()


def param_bytes(numel: int, dtype: str, shard: int = 1) -> int:
    """Bytes of one rank's shard of a tensor: ceil(numel / shard) elements (uneven shards are padded)."""
    return -(-numel // shard) * dtype_bytes(dtype)
