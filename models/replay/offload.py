"""Offloading saved tensors (`TapeOp.offloaded`, policy "offload", `torch.autograd.graph.save_on_cpu`) in the replay.

As an offloaded op saves a tensor, a host copy is made (`pack`, the pack hook, one per save: forward.py calls
it), and before its backward node runs each copy is brought back to the device (`unpack`, the unpack hook: the
backward passes call it). On a CPU profile host and device are one memory: the copies stay in the one pool and
nothing comes back. See the module docstring of models/replay/__init__.py for how these blocks live and go.
Each takes the replay's state (state.py `ReplayState`).
"""

from __future__ import annotations

from ...simulator.events import Block, Category, Phase, Pool
from ..config import dtype_bytes
from ..tape import TapeOp
from .state import ReplayState


def host_pool(state: ReplayState) -> Pool:
    """Where offloaded tensors go: the host, or on a CPU device the one memory there is."""
    return Pool.DEVICE if state.builder.device.is_cpu else Pool.HOST


def pack(state: ReplayState, op: TapeOp, saves: tuple[str, ...], casts: list[Block]) -> dict[str, Block]:
    """One host copy per tensor autograd saves for `op` (save_on_cpu's pack hook runs per save):
    the saved activations (a tensor read as k equal views is saved as k view-sized pieces), the
    autocast weight copies, and the parameters it saves. Each is held until the op's backward; the
    keys are the names the op's backward node releases."""
    builder = state.builder
    pool = host_pool(state)
    out: dict[str, Block] = {}

    def pack_one(name: str, nbytes: int, dtype: str, shape) -> None:
        key = f"{op.name}.saved.{len(out)}"
        out[key] = state.live[key] = builder.block(f"{name}.offloaded", nbytes, Category.ACTIVATION, dtype, shape,
                                                   pool=pool, pinned=pool is Pool.HOST)  # save_on_cpu(pin_memory=True)
        state.hold(key)

    for name in saves:
        spec = state.specs[name]
        views = op.inputs.count(name)
        pack_one(name, spec.nbytes // views if views > 1 else spec.nbytes, spec.dtype, spec.shape)
    for p, cast in zip(op.casts, casts):
        if saves_param(state, op, p):
            pack_one(cast.name, cast.nbytes, cast.dtype, cast.shape)
    for p in op.saved_params:
        if p in op.casts or not saves_param(state, op, p):
            continue
        dtype = builder.setup.precision.param
        pack_one(p, builder.param_numel[p] * dtype_bytes(dtype), dtype, builder.param_shape[p])
    return out


def saves_param(state: ReplayState, op: TapeOp, p: str) -> bool:
    """Whether autograd saves parameter `p` (or autocast's copy of it) for `op`: a linear saves its
    weight only for its input's gradient (not for the batch), norms always save theirs."""
    if p not in op.saved_params:
        return False
    return op.kind != "linear" or any(state.plan.rg.get(n) for n in op.inputs)


def unpack(state: ReplayState, i: int) -> list[Block]:
    """save_on_cpu's unpack hook, before op `i`'s backward node runs: on a GPU profile a device copy
    of each offloaded tensor (freed when the node is done); on a CPU profile nothing (the host
    tensor is handed back as it is)."""
    builder, live = state.builder, state.live
    if builder.device.is_cpu or not state.tape.ops[i].offloaded:
        return []
    blocks = [builder.block(live[key].name.removesuffix(".offloaded") + ".reloaded", live[key].nbytes,
                            Category.ACTIVATION, live[key].dtype, live[key].shape)
              for key in state.saved_at.get(i, ()) if key in live]
    if blocks:
        copy_op(state, f"{state.tape.ops[i].name}.reload", Phase.BACKWARD, sum(b.nbytes for b in blocks), blocks)
    return blocks


def copy_op(state: ReplayState, name: str, phase: Phase, nbytes: int, allocs=()) -> None:
    """A device<->host copy over the host link, on the compute stream (save_on_cpu copies in line)."""
    device = state.builder.device
    duration = nbytes / device.host_link + device.launch_latency
    state.builder.op(name, phase, state.step, state.mb, list(allocs), [], bytes_moved=nbytes, duration=duration)
