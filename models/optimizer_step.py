"""The optimizer step's ops on one rank, after backward: gradient clipping (HF Trainer's loop), the states made at
the first `step()` (or in the constructor, Adagrad) and the update with its temporaries per implementation, as
models/optimizers.py's registry entry describes them (their foreach / for-loop temporaries, or a plan of ops
for states of any shape, Adafactor's), offloaded states copied in and out (models/offload.py)."""

from __future__ import annotations

from math import prod

from ..simulator.events import Block, Category, OptimizerState, Phase, Pool
from .builder import GraphBuilder
from .config import dtype_bytes
from .lowbit import paged
from .offload import OffloadedStates
from .offload_libraries import TorchaoCpuOffload
from .optimizers import OPTIMIZERS, state_specs, step_pool, update_flops
from .parallel import own_dtype
from .replay import GradState


def clip_grad_norm(builder: GraphBuilder, step: int) -> None:
    """`torch.nn.utils.clip_grad_norm_(params, 1.0)` over the rank's gradients, as HF Trainer calls it before each
    optimizer step (torch/nn/utils/clip_grad.py, torch 2.13: `_get_total_norm`, then `_clip_grads_with_norm_`):
    `_foreach_norm` makes one 0-dim norm per gradient, `torch.stack` gathers them and `vector_norm` gives the
    total (the stack goes at once, the norms when `_get_total_norm` returns); then `total + 1e-6`, `max_norm / it`
    (a reciprocal, then a multiply) and `clamp(max=1.0)`, each a scalar, and `_foreach_mul_` scales the gradients in
    place; the scalars go when it returns."""
    dt = builder.setup.precision.grad
    size = dtype_bytes(dt)
    ph = Phase.OPTIMIZER
    tensors = builder.engine.optim_tensors()
    norms = [builder.block(f"{t.name}.grad_norm", size, Category.TEMPORARY, dt, ()) for t in tensors]
    builder.op(
        "clip_grad_norm_.foreach_norm", ph, step, -1, norms, [], bytes_moved=sum(t.numel for t in tensors) * size
    )
    stacked = builder.block("clip_grad_norm_.stack", size * len(norms), Category.TEMPORARY, dt, (len(norms),))
    builder.op("clip_grad_norm_.stack", ph, step, -1, [stacked], [])
    total = builder.block("clip_grad_norm_.total_norm", size, Category.TEMPORARY, dt, ())
    builder.op("clip_grad_norm_.vector_norm", ph, step, -1, [total], [stacked.id] + [n.id for n in norms])
    scalars = [builder.block(f"clip_grad_norm_.{k}", size, Category.TEMPORARY, dt, ()) for k in ("add", "reciprocal")]
    builder.op("clip_grad_norm_.clip_coef", ph, step, -1, scalars, [])
    coef = builder.block("clip_grad_norm_.mul", size, Category.TEMPORARY, dt, ())
    builder.op("clip_grad_norm_.clip_coef.mul", ph, step, -1, [coef], [scalars[1].id])
    clamped = builder.block("clip_grad_norm_.clamp", size, Category.TEMPORARY, dt, ())
    builder.op("clip_grad_norm_.foreach_mul_", ph, step, -1, [clamped], [total.id, scalars[0].id, coef.id, clamped.id],
         bytes_moved=2 * sum(t.numel for t in tensors) * size)


def optimizer_step(builder: GraphBuilder, step: int, grads: GradState, states_loaded: bool = False,
                    offload: OffloadedStates | TorchaoCpuOffload | None = None) -> None:
    """torch.optim's step over the tensors this rank's optimizer owns (states created at step 1, unless
    they were loaded from a checkpoint), inside the optimizer-state offload when there is one."""
    tensors = builder.engine.optim_tensors()
    create = step == 1 and not states_loaded
    if isinstance(offload, TorchaoCpuOffload):
        offload.step(step, create, create_states, _update)
        builder.engine.after_step(step)
        return
    chunked_first = create and offload is not None and builder.setup.offload.first_step == "chunked"
    groups = builder.engine.optim_groups() if offload is None else [tensors]
    per_param = create and offload is None and OPTIMIZERS[builder.setup.optimizer.name].per_param
    if create and not chunked_first and not per_param:
        created = create_states(builder, step, groups[0], "optimizer.init_state")
        if offload is not None:
            offload.adopt(created)
    fp32_grads = builder.engine.before_step(step, grads)
    if per_param:
        _per_param_first_step(builder, step, groups)
    elif offload is None:
        _update(builder, step, groups[0], "optimizer")
        for k, group in enumerate(groups[1:], 1):  # torch.optim: each group's lazy states, then its update
            if create:
                create_states(builder, step, group, f"optimizer.group{k}.init_state")
            _update(builder, step, group, f"optimizer.group{k}")
    elif create and not chunked_first:  # one whole torch step made every state on the device: now offload them
        _update(builder, step, tensors, "optimizer")
        for k in range(len(offload.chunks)):
            offload.offload(k, step)
    else:
        _offloaded_update(builder, step, offload, create)
    if fp32_grads or builder.engine.master_dtype():
        builder.op("optimizer.copy_master_to_params", Phase.OPTIMIZER, step, -1, [], [g.id for g in fp32_grads],
             bytes_moved=sum(t.numel for t in tensors) * 6)
    builder.engine.after_step(step)


def _per_param_first_step(builder: GraphBuilder, step: int, groups) -> None:
    """The first `step()` of an optimizer that makes each parameter's states just before its own update
    (`OptimizerSpec.per_param`: torchao's `_AdamBase.step`, bitsandbytes' `Optimizer8bit.step`): per parameter, its
    states, then its update."""
    first = True
    for k, group in enumerate(groups):
        name = "optimizer" if k == 0 else f"optimizer.group{k}"
        for t in group:
            create_states(builder, step, [t], f"{name}.init_state.{t.name}", shared=first)
            _update(builder, step, [t], name)
            first = False


def _offloaded_update(builder: GraphBuilder, step: int, offload: OffloadedStates, create: bool) -> None:
    """Chunk by chunk: copy in (`offload_prefetch` chunks ahead; nothing to copy in when the chunk's states
    are created by its own step, the first), a torch step over the chunk's parameters, copy back."""
    issued, transfers = 0, {}
    for k, chunk in enumerate(offload.chunks):
        name = f"optimizer.chunk{k}"
        if create:
            offload.adopt(create_states(builder, step, chunk, f"{name}.init_state"))
        else:
            while issued <= min(k + offload.prefetch, len(offload.chunks) - 1):
                transfers[issued] = offload.load(issued, step)
                issued += 1
        _update(builder, step, chunk, name, after=(transfers[k],) if k in transfers else ())
        offload.offload(k, step)


def create_states(
    builder: GraphBuilder, step: int, tensors, op_name: str, phase: Phase = Phase.OPTIMIZER, shared: bool = True
) -> list[Block]:
    """torch's lazy state init (`_init_group`) for `tensors`: every state of each, on the device (Adam's
    `step` scalar on the host unless fused; torchao's always, `OptimizerSpec.host_step`; bitsandbytes' paged
    states in managed memory, shown as host memory: models/lowbit.py), with the optimizer's shared states where
    `shared`; `phase` LOAD for an optimizer whose constructor makes them."""
    s = builder.setup
    spec = OPTIMIZERS[s.optimizer.name]
    shard = builder.engine.state_shard()
    step_state_pool = step_pool(builder.device.is_cpu, s.optimizer.impl)
    home = builder.engine.state_pool()  # the host where the engine steps there (FSDP2's offload, ZeRO-Offload)
    if home is Pool.HOST or (spec.host_step and not builder.device.is_cpu):
        step_state_pool = Pool.HOST
    states = []
    for t in tensors:
        for state, shape, dtype in state_specs(
            s.optimizer.name, t.numel, own_dtype(builder.tape, t.name) or s.precision.state, t.shape
        ):
            sharded = state is not OptimizerState.STEP
            if not sharded and home is Pool.HOST and not builder.engine.host_step_scalar:
                continue
            managed = paged(s.optimizer.name, state, t.numel) and not builder.device.is_cpu
            states.append(builder.block(f"{t.name}.{state.value}" + (".managed" if managed else ""),
                                  prod(shape) * dtype_bytes(dtype),
                                  Category.OPTIMIZER_STATE, dtype, shape, state=state,
                                  shard=shard if sharded else 1,
                                  pool=Pool.HOST if managed else step_state_pool if not sharded else home))
    for name, shape, dtype in spec.shared_states if shared else ():  # bitsandbytes' qmaps: one pair for all
        states.append(builder.block(name, prod(shape) * dtype_bytes(dtype), Category.OPTIMIZER_STATE, dtype, shape,
                              state=OptimizerState.QUANT_STATE))
    builder.op(op_name, phase, step, -1, states, [], bytes_moved=sum(x.nbytes for x in states))
    return states


def _update(builder: GraphBuilder, step: int, tensors, name: str, after=()) -> None:
    """The update kernels of one torch `step()` over `tensors` (ops named `<name>.<kind>`), with the
    temporaries of `setup.optimizer.impl`; the first op waits for `after`."""
    s = builder.setup
    shard = builder.engine.state_shard()
    state_dtype = s.precision.state
    ph = Phase.OPTIMIZER
    total_numel = sum(t.numel for t in tensors)
    flops = update_flops(s.optimizer.name, total_numel)
    bytes_moved = total_numel * dtype_bytes(state_dtype) * 5
    spec = OPTIMIZERS[s.optimizer.name]
    if spec.temps is not None:  # temporaries of any shape, op by op
        _planned_update(builder, step, tensors, name, after)
    elif spec.foreach_temps and s.optimizer.impl == "foreach":  # every parameter's temporaries at once
        temps = [
            builder.block(
                f"{t.name}.{kind}",
                t.numel * dtype_bytes(own_dtype(builder.tape, t.name) or state_dtype),
                Category.TEMPORARY,
                own_dtype(builder.tape, t.name) or state_dtype,
                t.shape,
                shard=shard,
            )
            for kind in spec.foreach_temps
            for t in tensors
        ]
        builder.op(f"{name}.foreach_update", ph, step, -1, temps, [x.id for x in temps], flops=flops,
             bytes_moved=bytes_moved, after=after)
    elif spec.loop_temps and s.optimizer.impl == "for-loop":  # one parameter after the other
        previous = None  # the last temporary of the parameter before, referenced until this one's replaces it
        for i, t in enumerate(tensors):
            dt = own_dtype(builder.tape, t.name) or state_dtype
            nbytes = t.numel * dtype_bytes(dt)
            temps = [
                builder.block(f"{t.name}.{kind}", nbytes, Category.TEMPORARY, dt, t.shape) for kind in spec.loop_temps
            ]
            frees = [x.id for x in temps[:-1]] + ([previous.id] if previous else [])
            builder.op(f"{name}.update.{t.name}", ph, step, -1, temps, frees,
                 flops=update_flops(s.optimizer.name, t.numel), bytes_moved=t.numel * dtype_bytes(state_dtype) * 5,
                 after=after if i == 0 else ())
            previous = temps[-1]
        if previous:
            builder.op(f"{name}.update.end", ph, step, -1, [], [previous.id])
    else:
        builder.op(f"{name}.{s.optimizer.impl}_update", ph, step, -1, [], [], flops=flops, bytes_moved=bytes_moved,
             after=after)


def _planned_update(builder: GraphBuilder, step: int, tensors, name: str, after=()) -> None:
    """The update as the optimizer's `temps` plan has it (models/optimizers.py `TempOp`): one op per plan op, named
    `<name>.<label>[.<tensor>]`; each tensor's update FLOPs and bytes go with the first op that works on it."""
    s = builder.setup
    dtypes = [own_dtype(builder.tape, t.name) or s.precision.state for t in tensors]
    blocks: dict[int, Block] = {}  # id(Temp) -> its block
    costed: set[int] = set()
    for k, op in enumerate(OPTIMIZERS[s.optimizer.name].temps(s.optimizer.impl, tuple(zip((t.shape for t in tensors),
                                                                                        dtypes)))):
        for x in op.make:
            dt = x.dtype or dtypes[x.index]
            blocks[id(x)] = builder.block(f"{tensors[x.index].name if x.index >= 0 else 'optimizer'}.{x.kind}",
                                    prod(x.shape) * dtype_bytes(dt), Category.TEMPORARY, dt, x.shape,
                                    pool=Pool.HOST if x.host and not builder.device.is_cpu else Pool.DEVICE)
        cost = op.index >= 0 and op.index not in costed
        costed.add(op.index)
        numel = tensors[op.index].numel if cost else 0
        builder.op(
            f"{name}.{op.label}" + (f".{tensors[op.index].name}" if op.index >= 0 else ""),
            Phase.OPTIMIZER,
            step,
            -1,
            [blocks[id(x)] for x in op.make],
            [blocks[id(x)].id for x in op.free],
            flops=update_flops(s.optimizer.name, numel),
            bytes_moved=numel * dtype_bytes(s.precision.state) * 5,
            after=after if k == 0 else (),
        )


class _InBackwardBuilder:
    """The builder seen by an optimizer step run inside the backward: every op it emits goes in the BACKWARD phase
    of the micro-batch whose backward runs it; the rest is the builder's."""

    __slots__ = ("_builder", "_mb")

    def __init__(self, builder: GraphBuilder, mb: int) -> None:
        self._builder, self._mb = builder, mb

    def op(self, name, phase, step, mb, *args, **kwargs):
        return self._builder.op(name, Phase.BACKWARD, step, self._mb, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._builder, name)


class InBackward:
    """Optimizer-in-backward as torchtune 0.6.1 does it (torchtune/training/memory.py `register_optim_in_bwd_hooks`
    and `create_optim_in_bwd_wrapper`): one torch optimizer per trainable parameter, whose post-accumulate-grad
    hook runs `opt.step(); opt.zero_grad()` as soon as the parameter's gradient is accumulated. So, per parameter,
    in the backward right after the node that finished its gradient: at step 1 its states, made lazily by its own
    optimizer's first step(); its update with the temporaries of one parameter (`_update` over it alone: foreach
    and for-loop alike work on one tensor); then zero_grad() (set_to_none) frees the gradient. The optimizer
    phase has nothing left. `states_loaded`: made in the constructors (Adagrad), not by the first step."""

    def __init__(self, builder: GraphBuilder, states_loaded: bool) -> None:
        self.builder = builder
        self.states_loaded = states_loaded
        self.tensors = {t.name: t for t in builder.engine.optim_tensors()}
        # torch 2.13 aten::linear is addmm(bias, x, weight.t()) (HF's Conv1D addmm(bias, x, weight)): the bias's
        # AccumulateGrad is an edge of AddmmBackward0 before the weight's (behind TBackward0), and autograd's ready
        # queue runs AccumulateGrad nodes first (sequence_nr UINT64_MAX), so a linear's bias is stepped first
        self.late = {op.params[0] for op in builder.tape.ops if op.kind == "linear" and len(op.params) > 1}

    def __call__(self, replay, params: list[str]) -> None:
        """The hooks of `params`, whose gradients one backward node just finished, in the order torch runs them."""
        for p in sorted(params, key=lambda p: p in self.late):
            self.step(replay, p)

    def step(self, replay, p: str) -> None:
        """`p`'s hook, in the backward of the replay's micro-batch (GradState.in_backward)."""
        builder, step = _InBackwardBuilder(self.builder, replay.mb), replay.step
        t, name = self.tensors[p], f"optimizer_in_backward.{p}"
        if step == 1 and not self.states_loaded:
            create_states(builder, step, [t], f"{name}.init_state", Phase.BACKWARD)
        _update(builder, step, [t], name)
        grad = replay.grads.blocks.pop(p)
        builder.op(f"{name}.zero_grad", Phase.BACKWARD, step, replay.mb, [], [grad.id])
