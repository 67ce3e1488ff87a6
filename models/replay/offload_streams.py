"""torchtune's activation offloading with streams (`activation_offload` "streams") in the replay.

The rules are torchtune 0.6.1's torchtune/training/_activation_offloading.py `OffloadActivations(use_pin_memory=True,
use_streams=True, max_fwd_stash_size=S, min_offload_size=M)`, which its recipes enter around `logits = model(batch)`
with the output head under `NoOpManager` (`get_act_offloading_ctx_manager`): the describer marks every op before the
head `TapeOp.offloaded` (models/transformer/nanogpt.py), the head and the loss are not.

Forward (`pack`, its pack hook, once per tensor autograd saves, in order):
- every save gets the next tensor id, offloaded or not;
- a save of `element_size() * nelement()` < M bytes, or an `nn.Parameter` (a norm's weight and bias; a linear's
  weight is saved as its transpose, a view that is no Parameter, and is offloaded), stays as it is: a normal save;
- any other gets a host copy (`torch.empty_like(pin_memory=True)`: pinned host memory, `Pool.HOST`; on a CPU the
  one memory, as save_on_cpu's), copied on the offload stream, and the device tensor goes into the forward stash,
  which keeps it alive until a later offloaded save with an id at least S above it (the compute stream then waits
  for its copy: `fwd_stash`); so up to S ids' worth of device tensors outlive their last use while their copies
  are in flight, and the last of the forward are still there when the backward starts.

Backward (`unpack`, its unpack hook, before the node that saved the tensor runs):
- a tensor still in the forward stash is handed back as it is (no copy); its host copy goes (the tracker entry
  is deleted);
- any other is copied back to a new device tensor (`.to("cuda", non_blocking=True)` on the offload stream, which
  the compute stream waits for at once: no copy runs ahead of its node in 0.6.1) and the host copy goes; the
  device copy is kept in the backward stash until the node after the next one that unpacks an offloaded tensor is
  done (its post-node hook deletes the previous node's), the last ones at the end of the backward (a callback);
  so two nodes' copies are on the device at once. On a CPU `.to("cuda")` is the host tensor itself: that host
  copy, not a device copy, is what the backward stash keeps;
- after the first such node the forward stash is emptied.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ...simulator.events import Block, Category, Phase, Stream
from ..config import dtype_bytes
from ..tape import TapeOp
from .offload import copy_op, host_pool, saves_param
from .offload import unpack as save_on_cpu_unpack
from .state import ReplayState


@dataclass
class StreamsState:
    """One micro-batch's OffloadActivations state (its `tracker`, `fwd_stash`, `bwd_tensor_stash`)."""

    ids: int = 0  # tensor ids handed out so far (get_tensor_id)
    fwd_stash: list[tuple[int, str | None]] = field(default_factory=list)  # (id, device tensor; None: a parameter)
    keys: dict[str, int] = field(default_factory=dict)  # offloaded save (its host block's key) -> tensor id
    bwd_stash: list[str | int] = field(default_factory=list)  # GPU: device copies' block ids; CPU: host keys
    copies: dict[int, int] = field(default_factory=dict)  # tensor id -> the op of its device-to-host copy
    waits: tuple[list[int], list[int]] = field(default_factory=lambda: ([], []))  # copies the pack ops wait for


def active(state: ReplayState) -> bool:
    return state.builder.setup.checkpointing.activation_offload == "streams"


def streams_of(state: ReplayState) -> StreamsState:
    if state.streams is None:
        state.streams = StreamsState()
    return state.streams


def pack(state: ReplayState, op: TapeOp, saves: tuple[str, ...], casts: list[Block]):
    """The pack hook for each of `op`'s saves in order (its saved activations, a view by its own size, then autocast's
    weight copies and the parameters it saves, in autograd's order: `_pack_order`): (the saves kept as they are,
    held as any save; the host copies by key; the keys packed before the kernel runs (autograd saves an op's
    inputs before it, its outputs after); the stash entries let go then, and after)."""
    builder, st = state.builder, streams_of(state)
    outputs = {o.name for o in op.outputs}
    pre: set[str] = set()
    pre_frees: list[int] = []
    post_frees: list[int] = []
    before = True
    setup = builder.setup.checkpointing
    pool = host_pool(state)
    kept: list[str] = []
    packed: dict[str, Block] = {}

    items, weights = [], []  # (name, bytes, dtype, shape, the device tensor the stash keeps or None, a Parameter)
    for name in saves:
        spec = state.specs[name]
        views = op.inputs.count(name)
        items.append((name, spec.nbytes // views if views > 1 else spec.nbytes, spec.dtype, spec.shape, name, False))
    for p, cast in zip(op.casts, casts):
        if saves_param(state, op, p):
            weights.append((cast.name, cast.nbytes, cast.dtype, cast.shape,
                            cast.name if cast.name in state.live else None, False))
    for p in op.saved_params:
        if p in op.casts or not saves_param(state, op, p):
            continue
        dtype = builder.setup.precision.param
        # a linear saves its weight's transpose (a view: no Parameter); a norm saves the Parameter itself
        weights.append((p, builder.param_numel[p] * dtype_bytes(dtype), dtype, builder.param_shape[p], None,
                        op.kind != "linear"))
    for name, nbytes, dtype, shape, device, parameter in _pack_order(op, items, weights):
        before = before and name not in outputs
        frees = pre_frees if before else post_frees
        st.ids += 1
        tid = st.ids
        if nbytes < setup.offload_min_bytes or parameter:
            if not parameter:
                kept.append(name)
                state.hold(name)
            continue
        while st.fwd_stash and st.fwd_stash[0][0] <= tid - setup.offload_stash:
            old, gone = st.fwd_stash.pop(0)
            if old in st.copies:  # `self.s0.wait_event(ev)`: the compute stream waits for that copy
                st.waits[0 if before else 1].append(st.copies.pop(old))
            if gone is not None:
                state.release(gone, frees)
        key = f"{op.name}.saved.{len(kept) + len(packed)}"
        packed[key] = state.live[key] = builder.block(f"{name}.offloaded", nbytes, Category.ACTIVATION, dtype, shape,
                                                      pool=pool)
        state.hold(key)
        st.keys[key] = tid
        if device is not None:
            state.hold(device)  # the forward stash's reference
        st.fwd_stash.append((tid, device))
        if before:
            pre.add(key)
    return tuple(kept), packed, pre, pre_frees, post_frees


def split_op(state: ReplayState, op: TapeOp, allocs: list[Block], frees: list[int], casts: list[Block],
             workspace: list[Block], packed: dict[str, Block], pre: set[str], pre_frees: list[int],
             post_frees: list[int]):
    """An offloaded op as it runs: `<op>.pack` (autocast's weight copies, then the host copies of the saves made
    before the kernel, the stash entries they let go), the kernel (its outputs and workspace: the allocs and frees
    returned), then `late()` emits `<op>.pack_outputs` (the saves of its outputs, then the forward references that
    go as the op returns) and the copies on the offload stream."""
    builder, st = state.builder, state.streams
    cast_ids = {c.id for c in casts}
    ws = {w.id for w in workspace}
    first = [a for a in allocs if a.id in cast_ids] + [packed[k] for k in packed if k in pre]
    pre_waits, post_waits = st.waits
    if first or pre_frees or pre_waits:
        builder.op(f"{op.name}.pack", Phase.FORWARD, state.step, state.mb, first, pre_frees, after=tuple(pre_waits))
    after = [packed[k] for k in packed if k not in pre]
    rest = post_frees + [f for f in frees if f not in ws]

    def late() -> None:
        if after or rest or post_waits:
            builder.op(f"{op.name}.pack_outputs", Phase.FORWARD, state.step, state.mb, after, rest,
                       after=tuple(post_waits))
        st.waits = ([], [])
        if packed:
            copy = offload_copy(state, op, packed)
            for key in packed:
                st.copies[st.keys[key]] = copy
    return [a for a in allocs if a.id not in cast_ids], [f for f in frees if f in ws], late


def _pack_order(op: TapeOp, items: list, weights: list) -> list:
    """The order autograd makes an op's SavedVariables, which is the order of the pack hook's ids (measured with
    torch 2.13 on a CPU, bench/validate_activation_offload.py): a product saves its second operand first (mul, mm:
    a linear without bias saves its weight's transpose, then its input; bmm, matmul), addmm its input first (a
    linear with bias); nn.LayerNorm's node saves weight, input, bias, then mean and rstd; nn.RMSNorm's last mul by
    the weight saves the weight before the normalised input; SDPA (the CPU flash kernel) saves key, query, value,
    logsumexp, output. `items`: the tape's saves in order; `weights`: the
    autocast weight copies, then the saved parameters."""
    if op.kind == "layernorm" and weights and items:
        return [weights[0], items[0], *weights[1:], *items[1:]]
    if op.kind == "rmsnorm" and weights and items:
        return [*items[:-1], *weights, items[-1]]
    if op.kind == "linear":
        return items + weights if len(op.params) > 1 else weights + items
    if op.kind == "sdpa" and len(items) == 5:  # (q, k, v, out, logsumexp) in the tape
        return [items[1], items[0], items[2], items[4], items[3]]
    if op.kind in ("bmm", "matmul", "mul") and len(items) == 2 and not weights:
        return [items[1], items[0]]
    return items + weights


def offload_copy(state: ReplayState, op: TapeOp, packed: dict[str, Block]) -> int:
    """The forward's device-to-host copies of `op`'s packed saves, on the offload stream after the op (its id)."""
    builder = state.builder
    nbytes = sum(b.nbytes for b in packed.values())
    return builder.op(f"{op.name}.offload", Phase.FORWARD, state.step, state.mb, [], [], bytes_moved=nbytes,
               stream=Stream.HOST, duration=nbytes / builder.device.host_link + builder.device.launch_latency,
               after=(builder.last(Stream.COMPUTE),)).id


def unpack(state: ReplayState, i: int) -> list[int]:
    """The unpack hook for op `i`'s offloaded saves, before its node runs (emitted as `<op>.reload`: the copies back
    in, the host copies let go), and what its post-node hook lets go with the node (ids returned): the forward
    stash, the previous node's backward stash."""
    st = state.streams
    saved = state.saved_at.get(i, ())
    mine = [k for k in saved if st is not None and k in st.keys]
    if not mine:
        return []
    builder, live = state.builder, state.live
    cpu = builder.device.is_cpu
    stashed = {tid for tid, _ in st.fwd_stash}
    allocs: list[Block] = []
    frees: list[int] = []
    new_stash: list[str | int] = []
    for key in mine:
        tid = st.keys.pop(key)
        if tid in stashed:  # the device tensor itself (no copy)
            state.release(key, frees)
        elif cpu:  # .to("cuda") of a CPU tensor: the host copy itself, kept by the backward stash
            new_stash.append(key)
        else:
            host = live[key]
            blk = builder.block(host.name.removesuffix(".offloaded") + ".reloaded", host.nbytes, Category.ACTIVATION,
                                host.dtype, host.shape)
            allocs.append(blk)
            new_stash.append(blk.id)
            state.release(key, frees)
    state.saved_at[i] = tuple(k for k in saved if k not in mine)
    name = f"{state.tape.ops[i].name}.reload"
    if allocs:
        copy_op(state, name, Phase.BACKWARD, sum(b.nbytes for b in allocs), allocs)
        if frees:
            builder.op(f"{name}.host_release", Phase.BACKWARD, state.step, state.mb, [], frees)
    elif frees:
        builder.op(name, Phase.BACKWARD, state.step, state.mb, [], frees)
    after: list[int] = []
    for _, device in st.fwd_stash:
        if device is not None:
            state.release(device, after)
    st.fwd_stash.clear()
    after += _let_go(state, st.bwd_stash)
    st.bwd_stash = new_stash
    return after


def unpack_ids(state: ReplayState, i: int) -> list[int]:
    """What op `i`'s backward node lets go when it is done because of offloading: save_on_cpu's device copies
    (offload.py `unpack`), or under activation_offload "streams" what torchtune's post-node hook lets go (`unpack`)."""
    if state.streams is not None:
        return unpack(state, i)
    return [b.id for b in save_on_cpu_unpack(state, i)]


def end_backward(state: ReplayState) -> list[int]:
    """The callback queued at the end of the backward: the last node's backward stash goes."""
    st = state.streams
    if st is None:
        return []
    frees = _let_go(state, st.bwd_stash)
    st.bwd_stash = []
    return frees


def _let_go(state: ReplayState, stash: list[str | int]) -> list[int]:
    frees: list[int] = []
    for item in stash:
        if isinstance(item, int):
            frees.append(item)
        else:
            state.release(item, frees)
    return frees
