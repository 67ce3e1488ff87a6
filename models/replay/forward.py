"""The forward pass of the replay, and a checkpoint region's recompute of it, op by op.

`run_forward` plays the pass from the plan's recording where it can (template.py), else runs it (`forward_pass`): it
loads the batch, takes the references that outlive the forward (the caller's outputs, the checkpoint regions'
inputs) and runs each op (`run_op`) between the engine's hooks, then lets autocast's weight cache go. `run_op`
is one op: its outputs (or, in a recompute, the selective-checkpoint cache's outputs handed back, or a copy
dropped at once of one still alive), its saves, autocast's 16-bit weight copies, the host copies of an
offloaded op's saves (offload.py), its workspace, and the forward-use references its last reads let go; a
recompute (checkpoint.py) runs the same ops with their saves. The reasons each tensor is alive, and when each
goes, are the package's (models/replay/__init__.py, its module docstring); `drop_output` ends a forward-only pass.
Every step takes the replay's state (state.py `ReplayState`) and reaches the builder through it.
"""

from __future__ import annotations

from ...simulator.events import Block, Category, Phase
from ..config import ConfigError, dtype_bytes
from ..tape import TapeOp
from . import offload_streams, template
from .offload import copy_op, pack, saves_param
from .state import ReplayState


def run_forward(state: ReplayState) -> None:
    """The micro-batch's forward pass: played from the plan's recording, or run (`forward_pass`); under
    activation_offload "streams" always run (offload_streams.py keeps state a recording does not)."""
    if offload_streams.active(state):
        if not any(op.offloaded for op in state.tape.ops):
            raise ConfigError("activation_offload", "streams is modelled for the hand-written transformer tapes "
                                                    "(model families nanogpt and llama); not for this model's")
        state.streams = offload_streams.StreamsState()
        forward_pass(state)
        return
    template.forward(state, forward_pass)


def forward_pass(state: ReplayState) -> None:
    """The forward pass as it runs: the batch loaded, the references that outlive it taken, each op between the
    engine's hooks, then autocast's cache let go."""
    builder, plan = state.builder, state.plan
    allocs = []
    for t in state.tape.inputs:
        blk = state.new_block(t, Category.INPUT)
        state.live[t.name] = blk
        allocs.append(blk)
        state.hold(t.name, 2 if t.name in plan.last_use else 1)  # the caller's reference + forward use
    for name, (_, blk) in state.external.items():  # their owner's reference (never let go here) + forward use
        state.live[name] = blk
        state.hold(name, 2 if name in plan.last_use else 1)
    if allocs or not state.external:
        builder.op("batch.load", Phase.FORWARD, state.step, state.mb, allocs, [])
    for name in state.tape.held:
        state.hold(name)
    for r, names in plan.region_inputs.items():
        for name in names:
            state.hold(name)
    before_op, after_op = builder.engine.before_op, builder.engine.after_op
    for i, op in enumerate(state.tape.ops):
        before_op(state, i, Phase.FORWARD)
        run_op(state, i, op, recomputing=False, uses=plan.last_use)
        after_op(state, i, Phase.FORWARD)
    frees: list[int] = []
    for name in state.autocast_cache:
        state.release(name, frees)
    if frees:  # casts nothing saved (checkpointed or offloaded ops) lived in the cache until here
        builder.op("autocast.exit", Phase.FORWARD, state.step, state.mb, [], frees)


def run_op(state: ReplayState, i: int, op: TapeOp, recomputing: bool, uses: dict[str, int],
           skip_outputs: bool = False) -> None:
    """Forward op `i` (`op`), in the first pass or a recompute (`recomputing`), `uses` giving each tensor's last
    forward use; `skip_outputs`: a recompute's last op whose outputs torch's checkpoint never makes (checkpoint.py)."""
    builder, plan, live, hold, release = state.builder, state.plan, state.live, state.hold, state.release
    allocs, frees = [], []
    saves = () if op.region is not None and not recomputing else plan.saves[i]
    kept = plan.kept_in_recompute if recomputing else plan.kept_in_forward
    duplicates = set()
    outputs = () if skip_outputs else op.outputs
    reused = recomputing and op.cached and op.region is not None
    offload = op.offloaded and bool(saves)
    for o in outputs:
        if reused:  # selective checkpointing hands back the first pass's output: a forward use, no memory
            hold(o.name)
            state.cache_pending[op.region].discard(o.name)
            release(o.name, frees)  # the cache's reason
            continue
        if recomputing and o.name in live:
            # still alive from the first pass (held by the caller): the recomputed copy is dropped at once
            dup = state.new_block(o, Category.TEMPORARY, name=f"{o.name}.recomputed")
            allocs.append(dup)
            frees.append(dup.id)
            duplicates.add(o.name)
            continue
        category = Category.ACTIVATION if (o.name in kept or o.name in state.tape.held) else Category.TEMPORARY
        blk = state.new_block(o, category)
        live[o.name] = blk
        allocs.append(blk)
        hold(o.name)  # forward use, released below at its last use
        if o.name in op.autocast_cached and not recomputing:  # a traced cast autocast's cache holds
            hold(o.name)
            state.autocast_cache.append(o.name)
        if o.name in plan.cached and not recomputing:
            hold(o.name)  # the selective-checkpoint cache, until the recompute reuses it
            state.cache_pending.setdefault(op.region, set()).add(o.name)
    if not offload:
        for s in saves:
            hold(s)
    casts = []
    for p in op.casts:  # autocast's 16-bit parameter copies; the weight's is saved for backward when there is one
        held = bool(saves) and not offload and saves_param(state, op, p)
        # autocast caches its casts of trainable parameters until the forward pass ends (its context exits)
        cached_cast = not recomputing and p in state.trainable
        cdt = builder.setup.precision.compute
        cast = builder.block(f"{p}.autocast_copy", builder.param_numel[p] * dtype_bytes(cdt),
                             Category.ACTIVATION if held else Category.TEMPORARY, cdt, builder.param_shape[p])
        allocs.append(cast)
        casts.append(cast)
        if held or cached_cast:
            live[cast.name] = cast
        if held:
            hold(cast.name)
            saves = saves + (cast.name,)
        if cached_cast:
            hold(cast.name)
            state.autocast_cache.append(cast.name)
        if not (held or cached_cast):
            frees.append(cast.id)
    packed: dict[str, Block] = {}
    streams = offload and state.streams is not None  # torchtune's OffloadActivations (offload_streams.py)
    if streams:
        kept, packed, pre, pre_frees, post_frees = offload_streams.pack(state, op, saves, casts)
        saves = kept + tuple(packed)
    elif offload:
        packed = pack(state, op, saves, casts)
        allocs += packed.values()
        saves = tuple(packed)
    state.saved_at[i] = saves
    workspace = [builder.block(w.name, w.nbytes, Category.TEMPORARY, w.dtype, w.shape)
                 for w in (() if skip_outputs else op.workspace)]
    allocs += workspace
    frees += [w.id for w in workspace]
    for name in dict.fromkeys(op.inputs + op.releases):  # one forward-use reason per tensor, however often read
        if uses.get(name) == i:
            release(name, frees)
    for o in outputs:
        if o.name not in uses and o.name not in duplicates:
            release(o.name, frees)
    if streams:  # the saves packed before the kernel, the kernel, the saves of its outputs, then Python's frees
        allocs, frees, late = offload_streams.split_op(state, op, allocs, frees, casts, workspace, packed, pre,
                                                       pre_frees, post_frees)
    bytes_moved = sum([a.nbytes for a in allocs]) + plan.input_bytes[i]
    suffix = ".cached" if reused else ".recompute" if recomputing else ""
    builder.op(op.name + suffix, Phase.BACKWARD if recomputing else Phase.FORWARD, state.step, state.mb, allocs,
               frees, flops=0 if reused else op.flops, bytes_moved=0 if reused else bytes_moved,
               recompute=recomputing, gemm=None if skip_outputs else "cublaslt" if plan.lt[i] else "cublas")
    if streams:
        late()
    elif packed:
        copy_op(state, f"{op.name}.offload", Phase.FORWARD, sum(b.nbytes for b in packed.values()))


def drop_output(state: ReplayState) -> None:
    """A forward-only pass (`passes` "forward") ends: the caller drops `out`, and with it the autograd graph
    and everything it saved; the batch goes too."""
    frees = [blk.id for blk in state.live.values()]
    state.live.clear()
    state.reasons.clear()
    state.builder.op("output.release", Phase.FORWARD, state.step, state.mb, [], frees)
