"""The forward tape: a describer's account of one micro-batch's forward pass, tensor by tensor.

A describer does not compute memory. It lists the forward ops in execution order (`TapeOp`), each with
the tensors it reads and creates, the tensors autograd saves for its backward, and the parameters it
uses. `models/replay/` then replays the tape like torch's autograd would (reference counts,
saved tensors released by their backward node, gradients flowing in reverse) and emits the
simulator's ops with exact alloc/free lists. Views (split, transpose of a contiguous tensor, view)
are not tensors here: ops read the base tensor.

Activation checkpointing policies (`TrainingSetup.checkpointing`) are decided here, per layer, once for
both sides: the describers mark the tape's ops with them, and the plain-torch reference models
(`traces/reference/nanogpt.py`) wrap the same layers in the same torch mechanism, so every policy can be run
for real and held against its simulation. See `checkpoint_segments`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property, lru_cache
from math import isqrt, prod

from .config import ConfigError, TrainingSetup, dtype_bytes


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: str
    requires_grad: bool = True  # float activations on the path to the loss

    @cached_property  # the replay reads it for every block it makes (frozen: computed once per spec)
    def nbytes(self) -> int:
        return prod(self.shape) * dtype_bytes(self.dtype)


@dataclass(frozen=True)
class ParamSpec:
    """A parameter tensor, named as `model.named_parameters()` names it (tied weights appear once)."""

    name: str
    shape: tuple[int, ...]

    @cached_property
    def numel(self) -> int:
        return prod(self.shape)


@dataclass(frozen=True)
class TapeOp:
    """One forward op.

    inputs       tensor names read (the batch and earlier outputs).
    outputs      tensors created (allocated when the op starts).
    saves        tensor names (inputs or outputs) autograd keeps until this op's backward ran, one per saved
                 variable (a tensor two of the op's nodes save is listed twice: one copy each when packed).
    params       parameter names used; each gets a gradient contribution in backward.
    casts        parameter names autocast copies to 16-bit here (kept in autocast's cache until the forward
                 ends; the copy of a saved parameter is what is saved for backward).
    passthrough  backward hands grad_output on unchanged to same-shaped inputs (add, dropout-free).
    workspace    forward temporaries alive only during the op.
    bwd_workspace  backward temporaries alive only during the op's backward.
    region       activation-checkpoint region (the index of its first layer) or None.
    saved_params parameters autograd saves as tensors for this op's backward (linear: its weight; norms:
                 weight and bias). They cost nothing, being parameters, until a pack hook copies them
                 (policy "offload").
    cached       selective activation checkpointing (policy "op-policy"): the region's first pass keeps
                 this op's outputs, and its recompute reuses them instead of running the op.
    offloaded    policy "offload": what this op saves is copied to host memory as it is saved
                 (`torch.autograd.graph.save_on_cpu`) and copied back for its backward.
    views        inputs this op reads as views of a tensor split into equal parts (the q, k, v splits of
                 one projection), one entry per view read. A tensor's views are counted over all the ops
                 that list it: each view's backward gives one view-sized gradient piece, and the tensor's
                 own gradient is made (a concatenation, the split's backward) when the last piece is in.
                 Unlisted, a tensor one op alone reads k times counts as k views of that op.
    releases     tensors whose last reference in the forward pass goes after this op although no later op
                 reads them (a local the code keeps, autocast's cache): a traced tape records when each
                 tensor really went.
    autocast_cached  outputs of this op (a traced tape's cast of a parameter) that autocast's weight cache holds
                 until the forward pass ends, also where a checkpointed region saves nothing.
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
    saved_params: tuple[str, ...] = ()
    cached: bool = False
    offloaded: bool = False
    views: tuple[str, ...] = ()
    releases: tuple[str, ...] = ()
    autocast_cached: tuple[str, ...] = ()


@dataclass(frozen=True)
class GradStep:
    """One step of a recorded backward node: it allocates `allocs` (and, through the parallel engine, the
    gradients of the parameters in `grads`), then frees `frees` (tensors born in backward) and, where
    `release_saved`, releases what its forward op saved."""

    allocs: tuple[TensorSpec, ...] = ()
    frees: tuple[str, ...] = ()
    grads: tuple[str, ...] = ()
    release_saved: bool = False


@dataclass(frozen=True)
class GradNode:
    """An autograd node as the real engine ran it on fake tensors (models/traced), in execution order.
    `op` is the index of the forward op that made it (None: AccumulateGrad and other nodes no op returned)."""

    name: str
    op: int | None
    steps: tuple[GradStep, ...] = ()
    flops: int = 0


@dataclass
class Tape:
    """The forward pass of one micro-batch, plus the parameters it uses.

    A hand-written describer leaves `backward` empty: the replay derives each op's backward node from the
    op (models/replay/). A traced tape (models/traced) carries the backward the real autograd engine
    ran, node by node (`GradNode`), and the replay follows it instead; everything else (saves, regions,
    the engines' hooks, parameter gradients) goes through the same replay.
    """

    params: list[ParamSpec]
    ops: list[TapeOp] = field(default_factory=list)
    inputs: list[TensorSpec] = field(default_factory=list)  # the batch, allocated before the forward
    buffers: list[TensorSpec] = field(default_factory=list)  # registered module buffers, allocated at load
    held: tuple[str, ...] = ()  # tensors the caller keeps until backward ends (logits, loss)
    loss: str = "loss"
    backward: tuple[GradNode, ...] = ()  # a recorded backward (traced tapes), in the order the engine ran it
    layers: tuple[str, ...] = ()  # module paths of the repeated blocks (FSDP units, checkpoint layers); traced
    buffers_follow_params: bool = True  # buffers take the parameters' dtype at load (traced: their own dtype)
    describer: str = "hand-written"
    gradless: tuple[str, ...] = ()  # parameters that get no gradient (traced: frozen, or not on the loss's path)
    param_dtypes: dict[str, str] = field(default_factory=dict)  # parameters not in the setup's dtype (own_dtype)
    # tied parameters a describer knows without op params (compiled): (holder name, source name, how many untied
    # parameters the model registers before the holder), models/parallel/engine.py DeviceBuild
    ties: tuple[tuple[str, str, int], ...] = ()

    def add(self, name: str, kind: str, inputs, outputs, **kw) -> tuple[TensorSpec, ...]:
        op = TapeOp(name=name, kind=kind, inputs=tuple(inputs), outputs=tuple(outputs), **kw)
        self.ops.append(op)
        return op.outputs

    @property
    def n_params(self) -> int:
        return sum(p.numel for p in self.params)

    def forward_flops(self) -> int:
        return sum(op.flops for op in self.ops)


# -- activation checkpointing policies -------------------------------------------------------------

SAC_SAVED_KINDS = ("linear", "addmm", "bmm", "sdpa")  # tape op kinds whose aten ops op-policy saves
SAC_SAVED_ATEN = ("mm", "addmm", "bmm", "_scaled_dot_product_flash_attention_for_cpu",
                  "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
                  "_scaled_dot_product_cudnn_attention")  # the aten ops op-policy saves (whichever exist)


@lru_cache(maxsize=1)
def op_policy():
    """torch's selective activation checkpointing policy of "op-policy" (`create_selective_checkpoint_contexts`,
    torch/utils/checkpoint.py): keep the outputs of matmuls and the SDPA kernels, recompute everything else (norms,
    activations, casts, copies, adds). One function, which the real runs (traces/reference) and the compiled
    describer (models/compile/step.py) both hand torch."""
    import torch
    from torch.utils.checkpoint import CheckpointPolicy

    saves = frozenset(getattr(torch.ops.aten, n).default for n in SAC_SAVED_ATEN if hasattr(torch.ops.aten, n))

    def policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
        return CheckpointPolicy.MUST_SAVE if op in saves else CheckpointPolicy.PREFER_RECOMPUTE

    policy.saves = saves
    return policy


def checkpointed(fn, wrap: str):
    """`fn` run as a `Segment`'s `wrap` says: under non-reentrant `torch.utils.checkpoint.checkpoint` ("checkpoint"),
    with torch's selective checkpoint contexts and `op_policy` ("op-policy"), or under `save_on_cpu` ("offload").
    The one wrapper of the real runs (traces/reference) and of the compiled describer (models/compile/step.py)."""
    import functools

    import torch
    from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

    if wrap == "offload":
        def offloaded(*args, **kwargs):
            with torch.autograd.graph.save_on_cpu(pin_memory=True):
                return fn(*args, **kwargs)
        return offloaded
    if wrap not in ("checkpoint", "op-policy"):
        raise ValueError(f"unknown segment wrap {wrap!r}")
    extra = {"context_fn": functools.partial(create_selective_checkpoint_contexts, op_policy())} \
        if wrap == "op-policy" else {}

    def run(*args, **kwargs):
        return checkpoint(fn, *args, use_reentrant=False, **extra, **kwargs)
    return run


@dataclass(frozen=True)
class Segment:
    """Consecutive layers that run as one unit, and how (`wrap`):

    none        plain: autograd saves what each op saves.
    checkpoint  the whole segment is one `torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`
                region: its forward keeps only the segment's inputs; backward re-runs it (up to the
                last op that saves anything) right before the segment's own backward.
    selective   each layer's attention core alone is one checkpoint region (Megatron's selective
                recomputation): eager attention's q k^T, scale, mask, softmax, dropout and @ v; the
                SDPA op on the sdpa path. Everything else is saved as usual.
    op-policy   the layer is a checkpoint region under torch's selective activation checkpointing
                (`create_selective_checkpoint_contexts`): outputs of matmuls (aten.mm, addmm, bmm) and
                SDPA ops are kept from the first pass and reused, every other op is recomputed.
    offload     the layer runs under `torch.autograd.graph.save_on_cpu(pin_memory=True)`: each tensor
                an op saves is copied to host memory when it is saved (the device copy is freed once
                the forward no longer reads it) and copied back to the device for its backward node.
    """

    layers: range
    wrap: str


def sqrt_segments(n_layer: int) -> tuple[range, ...]:
    """Chen et al. 2016 ("Training deep nets with sublinear memory cost"): ceil(sqrt(n)) segments of
    consecutive layers, as even as possible (the longer ones first). Unlike torch's
    `checkpoint_sequential`, which runs its last segment without a checkpoint, every segment is one."""
    count = isqrt(n_layer - 1) + 1
    size, longer = divmod(n_layer, count)
    out, start = [], 0
    for s in range(count):
        end = start + size + (1 if s < longer else 0)
        out.append(range(start, end))
        start = end
    return tuple(out)


def checkpoint_segments(setup: TrainingSetup, n_layer: int) -> tuple[Segment, ...]:
    """The layers of a model (transformer blocks; an MLP's Linear(+activation) pairs) under
    `setup.checkpointing.policy`, as segments in order:

    none       every layer plain.
    full       every layer its own checkpoint region.
    every-k    layers 0, k, 2k, ... (i % k == 0, k = `checkpoint_every_k`) each their own checkpoint
               region; the others plain. k = 1 is "full"; k >= n_layer checkpoints layer 0 only.
    layers     exactly the layers in `checkpoint_layers`, each its own region (an explicit set, as
               `analysis.checkpointing.optimal_checkpointing` chooses one).
    sqrt       `sqrt_segments`: ceil(sqrt(n_layer)) regions of consecutive layers.
    selective, op-policy, offload: every layer, wrapped so (see `Segment`).
    `activation_offload` "save-on-cpu" is policy "offload".
    """
    policy = setup.checkpointing.policy
    if setup.checkpointing.activation_offload == "save-on-cpu":
        policy = "offload"
    one = lambda i, wrap: Segment(range(i, i + 1), wrap)  # noqa: E731
    if policy == "sqrt":
        return tuple(Segment(r, "checkpoint") for r in sqrt_segments(n_layer))
    if policy in ("selective", "op-policy", "offload"):
        return tuple(one(i, policy) for i in range(n_layer))
    if policy == "every-k":
        chosen = set(range(0, n_layer, setup.checkpointing.every_k))
    elif policy == "layers":
        bad = [i for i in setup.checkpointing.layers if i >= n_layer]
        if bad:
            raise ConfigError("checkpoint_layers", f"layer {bad[0]} is not in 0..{n_layer - 1}")
        chosen = set(setup.checkpointing.layers)
    elif policy == "full":
        chosen = set(range(n_layer))
    else:
        chosen = set()
    return tuple(one(i, "checkpoint" if i in chosen else "none") for i in range(n_layer))
