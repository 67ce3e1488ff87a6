"""The replay's state: everything one micro-batch's replay reads and changes, in one object handed to each step.

`MicroBatchReplay` (models/replay/__init__.py) makes one `ReplayState` per micro-batch and passes it to every step
of the replay (forward.py, checkpoint.py, backward_derived.py, backward_recorded.py, grads.py, offload.py,
template.py) and to the engine's hooks (`before_op`, `after_op`, `param_grad`: models/parallel), which read and
change it there; nothing of the replay lives anywhere else. Its fields, in three groups:

- what the replay is of, set when it starts and never replaced: the builder, the tape, the step and micro-batch,
  the parameters' `.grad` blocks (`GradState`, shared by every micro-batch and step), the external tensors, the
  trainable set, every tensor's spec and the tape's plan (plan.py, shared by every micro-batch of the tape);
- what a pass changes (`template.STATE` names them; a pass played from a recording sets them all at once):
  the live blocks and the reasons each is alive, the gradients, what each backward node holds, the parameter
  gradients' sums in progress, autocast's cache, the pieces of viewed tensors' gradients, the cached outputs of
  selective checkpointing;
- what template.py keeps between the forward and the backward: the plan's recordings and the pass's block table.

The reference counting that decides when a block goes (`hold`, `release`, the module docstring of
models/replay/__init__.py) is the state's own: it changes `reasons` and `live` only. The gradients' own types are
here too, as parts of the state: `GradStorage` (an activation's gradient) and `GradState` (the parameters'
`.grad` blocks); grads.py moves gradients between them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ...simulator.events import Block, Category
from ..tape import Tape, TensorSpec
from .plan import ReplayPlan


@dataclass
class GradState:
    """Which parameters hold a `.grad` block right now (persists across micro-batches and steps)."""

    blocks: dict[str, Block] = field(default_factory=dict)
    persistent: bool = False  # fp32 main-grad buffers allocated at load: every contribution is a temporary
    # optimizer-in-backward (models/optimizer_step.py `InBackward`): called as `in_backward(state, params)` with the
    # parameters whose gradient the node just finished, after it (grads.py `grads_ready`); None: off
    in_backward: Any = None
    ready: list[str] = field(default_factory=list)  # parameters whose gradient is final, their hook not yet run


class GradStorage:
    """An activation gradient's memory, shared by the tensors an add hands it to. A `pinned` one is owned
    outside the replay (a pipeline stage's gradient receive buffer): never freed here, and a gradient summed
    into it is summed out of place (autograd's input buffer adds in place only into a tensor it holds the
    last reference to: torch/csrc/autograd/input_buffer.cpp `can_accumulate_inplace`)."""

    def __init__(self, block: Block, refs: int = 1, pinned: bool = False) -> None:
        self.block = block
        self.refs = refs
        self.pinned = pinned


@dataclass(eq=False, slots=True)
class ReplayState:
    """One micro-batch's replay of a tape: what it is of, and the state its passes change (module docstring)."""

    # -- what the replay is of (set at the start, never replaced) ---------------------------------------------
    builder: Any  # models/builder.py GraphBuilder (which imports the engines, which import the replay)
    """The rank's graph builder (models/builder.py): makes each block (`block`) and emits each op (`op`); holds
    the data-parallel engine whose hooks run around each op (`engine`), the setup, the device profile, the
    parameters' sizes and shapes, and the caches of plans (`replay_plans`) and recordings (`replay_templates`)."""
    tape: Tape
    """The tape replayed: its forward ops in order, and for a traced tape the backward the real engine ran."""
    step: int
    """The optimizer step this micro-batch belongs to (every op emitted carries it)."""
    mb: int
    """The micro-batch's index in the step (every op emitted carries it)."""
    grads: GradState
    """Which parameters hold a `.grad` block: the engine's `param_grad` reads and writes it; it outlives the
    replay (every micro-batch and step of the rank shares one)."""
    external: dict[str, tuple[TensorSpec, Block]]
    """Tensors the tape reads that exist outside this replay (a pipeline stage's received activation, the views
    of a whole batch), with their blocks: read and saved, never freed here."""
    trainable: set[str]
    """The trainable parameters (the builder's `trainable`): the plan's key names it by identity."""
    specs: dict[str, TensorSpec]
    """Every tensor's spec by name: the tape's inputs, the external tensors, then the ops' outputs."""
    plan: ReplayPlan
    """What the tape's replay knows before it runs (plan.py): made once per tape and trainable set, read only."""
    plan_key: tuple | None
    """The plan's key in the builder's caches (None: a builder without them): template.py finds the plan's
    recordings by it."""

    # -- what a pass changes (template.STATE) ----------------------------------------------------------------
    live: dict[str, Block] = field(default_factory=dict)
    """The blocks alive now, by tensor name (an offloaded save by its key `<op>.saved.<k>`, an autocast copy by
    its block's name)."""
    reasons: dict[str, int] = field(default_factory=dict)
    """For each tensor, how many reasons keep it alive (forward uses, saves, the caller's reference, a region,
    autocast's cache, the selective-checkpoint cache): it goes when the count reaches 0 (`release`)."""
    grad_of: dict[str, GradStorage] = field(default_factory=dict)
    """Each activation's gradient so far (grads.py `GradStorage`, shared by the tensors an add hands it to)."""
    saved_at: dict[int, tuple[str, ...]] = field(default_factory=dict)
    """What each forward op's backward node holds (the names it releases when it has run), by op index."""
    contributed: set[str] = field(default_factory=set)
    """The parameters with a gradient contribution in this backward (the engine's `param_grad`)."""
    grad_seen: dict[str, int] = field(default_factory=dict)
    """The contributions so far of a parameter read by several ops (a tied weight) in this backward."""
    grad_buffer: dict[str, Block] = field(default_factory=dict)
    """Such a parameter's AccumulateGrad input buffer: the sum of its contributions so far."""
    grad_had: dict[str, bool] = field(default_factory=dict)
    """Whether such a parameter had a `.grad` when its first contribution came."""
    after_node: list[tuple[str, list, list]] = field(default_factory=list)
    """Out-of-place sums into input buffers (name, allocs, frees), emitted once the node that fed them is done
    (grads.py `flush_after_node`)."""
    autocast_cache: list[str] = field(default_factory=list)
    """The 16-bit weight copies (and traced casts) autocast keeps until the forward pass ends."""
    view_pieces: dict[str, list[Block]] = field(default_factory=dict)
    """The pieces of a viewed tensor's gradient in so far (one per view read), concatenated when all are in."""
    cache_pending: dict[int, set[str]] = field(default_factory=dict)
    """For each checkpoint region, the outputs selective checkpointing cached in its first pass that its
    recompute has not reused yet."""
    streams: Any = None
    """activation_offload "streams" (offload_streams.py `StreamsState`): torchtune's tensor ids, forward stash,
    offloaded saves and backward stash; None otherwise (such a replay is never played from a recording)."""

    # -- what template.py keeps from the forward to the backward ---------------------------------------------
    template: object | None = None
    """The plan's recordings (template.py `_Template`) when this replay's forward was played or recorded."""
    tab: list[Block] | None = None
    """The pass's block table: the external blocks, then every block the passes made, by place."""
    tab_index: dict[int, int] | None = None
    """Block id -> place in `tab`, when the forward was recorded (else made again from `tab`)."""

    # -- reference counts --------------------------------------------------------------------------------------
    def new_block(self, spec: TensorSpec, category: Category, name: str | None = None) -> Block:
        """A block for tensor `spec` (named `name`, default the tensor's), made by the builder."""
        return self.builder.block(name or spec.name, spec.nbytes, category, spec.dtype, spec.shape)

    def hold(self, name: str, n: int = 1) -> None:
        """`n` more reasons keep tensor `name` alive."""
        self.reasons[name] = self.reasons.get(name, 0) + n

    def release(self, name: str, frees: list[int]) -> None:
        """One reason fewer keeps `name` alive: at none, its block goes (its id added to `frees`)."""
        self.reasons[name] -= 1
        if self.reasons[name] == 0 and name in self.live:
            frees.append(self.live.pop(name).id)
