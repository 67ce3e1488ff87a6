"""From model config + training setup to the op graph of a whole run: load, then `steps` x
(micro-batches of forward + backward, optimizer step, zero_grad).

The training loop described is the usual one:

    model = Model(cfg).to(device)               # load: parameters (+ fp32 master weights, main grads)
    for step in range(1, steps + 1):
        for mb in range(grad_accum):
            loss = model(batch[mb]); loss.backward()
        optimizer.step()                        # states created here at step 1
        optimizer.zero_grad(set_to_none=...)

ZeRO stages are ideal shard factors on the state rows here (stage 1: optimizer states and master
weights / N, stage 2: + gradients, stage 3: + parameters); one rank (rank 0) is described.
"""

from __future__ import annotations

import fnmatch
from dataclasses import asdict

from ..simulator.events import Block, Category, OptimizerState, Phase, Pool, Stream
from ..simulator.ops import Op, OpGraph
from .autograd import GradState, MicroBatchReplay, param_bytes
from .config import ConfigError, MLPConfig, TrainingSetup, TransformerConfig, dtype_bytes
from .costs import DeviceProfile, device_profile
from .optimizers import BNB_QMAP_BYTES, has_sqrt_temporaries, state_specs, update_flops
from .tape import Tape
from .transformer import mlp_tape, transformer_tape

ModelConfig = TransformerConfig | MLPConfig


def build_tape(model: ModelConfig, setup: TrainingSetup, cpu: bool = False) -> Tape:
    if isinstance(model, TransformerConfig):
        if setup.seq_len > model.max_seq_len:
            raise ConfigError("seq_len", f"{setup.seq_len} exceeds the model's max_seq_len {model.max_seq_len}")
        return transformer_tape(model, setup, cpu)
    return mlp_tape(model, setup, cpu)


def trainable_params(tape: Tape, frozen: tuple[str, ...]) -> set[str]:
    names = [p.name for p in tape.params]
    for pattern in frozen:
        if not any(fnmatch.fnmatchcase(n, pattern) for n in names):
            raise ConfigError("frozen", f"pattern {pattern!r} matches no parameter (names look like {names[0]!r})")
    return {n for n in names if not any(fnmatch.fnmatchcase(n, pat) for pat in frozen)}


class GraphBuilder:
    """Creates blocks and ops with fresh ids, durations from the cost model, and the shard factors."""

    def __init__(self, tape: Tape, setup: TrainingSetup, device: DeviceProfile, rank: int = 0) -> None:
        self.tape = tape
        self.setup = setup
        self.device = device
        self.rank = rank
        self.graph = OpGraph()
        self._next_block = 0
        self._last_on_stream: dict[Stream, int] = {}
        self.trainable = trainable_params(tape, setup.frozen)
        self.param_numel = {p.name: p.numel for p in tape.params}
        self.param_shape = {p.name: p.shape for p in tape.params}
        n, stage = setup.world_size, setup.zero_stage
        self.param_shard = n if stage >= 3 else 1
        self.grad_shard = n if stage >= 2 else 1
        self.state_shard = n if stage >= 1 else 1
        self.contribution_dtype = "fp32" if setup.param_dtype == "fp32" else setup.param_dtype

    def block(self, name: str, nbytes: int, category: Category, dtype: str, shape=(), state=None,
              shard: int = 1, pool: Pool = Pool.DEVICE) -> Block:
        self._next_block += 1
        return Block(id=self._next_block, nbytes=nbytes, category=category, name=name, dtype=dtype,
                     shape=tuple(shape), state=state, shard_factor=shard, rank=self.rank, pool=pool)

    def op(self, name: str, phase: Phase, step: int, micro_batch: int, allocs, frees, flops: int = 0,
           bytes_moved: int = 0, recompute: bool = False, stream: Stream = Stream.COMPUTE) -> Op:
        duration = self.device.duration(flops, bytes_moved, self.setup.compute_dtype)
        op = Op(id=len(self.graph), name=name, stream=stream, phase=phase, step=step, micro_batch=micro_batch,
                duration=duration, rank=self.rank, allocs=tuple(allocs), frees=tuple(frees), flops=flops,
                recompute=recompute)
        previous = self._last_on_stream.get(stream)
        self._last_on_stream[stream] = op.id
        return self.graph.add(op, after=() if previous is None else (previous,))

    def grad_bytes(self, p: str) -> int:
        return param_bytes(self.param_numel[p], self.setup.grad_dtype, self.grad_shard)

    def grad_contribution_bytes(self, p: str) -> int:
        return param_bytes(self.param_numel[p], self.contribution_dtype, self.grad_shard)


def describe(model: ModelConfig, setup: TrainingSetup, device: str | DeviceProfile = "H100-80GB") -> OpGraph:
    """The op graph of `setup.steps` training steps of `model` on one rank."""
    profile = device if isinstance(device, DeviceProfile) else device_profile(device)
    tape = build_tape(model, setup, profile.is_cpu)
    b = GraphBuilder(tape, setup, profile)
    grads = GradState(persistent=setup.fp32_grads)
    _load(b, grads)
    for step in range(1, setup.steps + 1):
        for mb in range(setup.grad_accum):
            MicroBatchReplay(b, tape, step, mb, grads).run()
        _optimizer_step(b, step)
        _zero_grad(b, step, grads)
    forward_flops = tape.forward_flops()
    b.graph.metadata = {
        "model": model.name, "setup": asdict(setup), "device": profile.name,
        "n_params": tape.n_params, "n_trainable": sum(b.param_numel[p] for p in b.trainable),
        "forward_flops_per_microbatch": forward_flops,
        "effective_batch": setup.effective_batch,
        "tokens_per_step": setup.effective_batch * setup.seq_len,
        "assumptions": profile.assumptions(),
    }
    return b.graph


def _load(b: GraphBuilder, grads: GradState) -> None:
    s = b.setup
    params = [b.block(p.name, param_bytes(p.numel, s.param_dtype, b.param_shard), Category.PARAMETER, s.param_dtype,
                      p.shape, shard=b.param_shard) for p in b.tape.params]
    buffers = [b.block(t.name, t.nbytes, Category.BUFFER, t.dtype, t.shape) for t in b.tape.buffers]
    b.op("load.parameters", Phase.LOAD, 0, -1, params + buffers, [], bytes_moved=sum(x.nbytes for x in params))
    trainable = [p for p in b.tape.params if p.name in b.trainable]
    if s.master_dtype:
        master = [b.block(f"{p.name}.master", param_bytes(p.numel, "fp32", b.state_shard), Category.MASTER_PARAMETER,
                          "fp32", p.shape, shard=b.state_shard) for p in trainable]
        b.op("load.master_weights", Phase.LOAD, 0, -1, master, [], bytes_moved=sum(x.nbytes for x in master))
    if grads.persistent:
        main = [b.block(f"{p.name}.main_grad", b.grad_bytes(p.name), Category.GRADIENT, "fp32", p.shape,
                        shard=b.grad_shard) for p in trainable]
        grads.blocks.update({p.name: blk for p, blk in zip(trainable, main)})
        b.op("load.main_grads", Phase.LOAD, 0, -1, main, [], bytes_moved=sum(x.nbytes for x in main))


def _optimizer_step(b: GraphBuilder, step: int) -> None:
    s = b.setup
    trainable = [p for p in b.tape.params if p.name in b.trainable]
    shard_numel = {p.name: -(-p.numel // b.state_shard) for p in trainable}
    state_dtype = s.state_dtype
    ph = Phase.OPTIMIZER
    if step == 1:
        states = []
        step_pool = Pool.HOST if not b.device.is_cpu and s.optimizer_impl != "fused" else Pool.DEVICE
        for p in trainable:
            for state, numel, dtype in state_specs(s.optimizer, shard_numel[p.name], state_dtype):
                sharded = state is not OptimizerState.STEP
                states.append(b.block(f"{p.name}.{state.value}", numel * dtype_bytes(dtype), Category.OPTIMIZER_STATE,
                                      dtype, (numel,) if sharded else (), state=state,
                                      shard=b.state_shard if sharded else 1,
                                      pool=step_pool if not sharded else Pool.DEVICE))
        if s.optimizer == "adam-8bit":
            states.append(b.block("optimizer.qmaps", BNB_QMAP_BYTES, Category.OPTIMIZER_STATE, "fp32", (2, 256),
                                  state=OptimizerState.QUANT_STATE))
        b.op("optimizer.init_state", ph, step, -1, states, [], bytes_moved=sum(x.nbytes for x in states))
    fp32_grads = []
    if s.master_dtype and not s.fp32_grads:
        fp32_grads = [b.block(f"{p.name}.grad_fp32", shard_numel[p.name] * 4, Category.TEMPORARY, "fp32", p.shape,
                              shard=b.state_shard) for p in trainable]
        b.op("optimizer.grads_to_fp32", ph, step, -1, fp32_grads, [], bytes_moved=3 * sum(x.nbytes for x in fp32_grads))
    total_numel = sum(shard_numel.values())
    flops = update_flops(s.optimizer, total_numel)
    bytes_moved = total_numel * dtype_bytes(state_dtype) * 5
    if has_sqrt_temporaries(s.optimizer) and s.optimizer_impl == "foreach":
        temps = [b.block(f"{p.name}.exp_avg_sq_sqrt", shard_numel[p.name] * dtype_bytes(state_dtype), Category.TEMPORARY,
                         state_dtype, p.shape, shard=b.state_shard) for p in trainable]
        b.op("optimizer.foreach_update", ph, step, -1, temps, [t.id for t in temps], flops=flops, bytes_moved=bytes_moved)
    elif has_sqrt_temporaries(s.optimizer) and s.optimizer_impl == "for-loop":
        previous_denom = None
        for p in trainable:
            nbytes = shard_numel[p.name] * dtype_bytes(state_dtype)
            sqrt = b.block(f"{p.name}.exp_avg_sq_sqrt", nbytes, Category.TEMPORARY, state_dtype, p.shape)
            denom = b.block(f"{p.name}.denom", nbytes, Category.TEMPORARY, state_dtype, p.shape)
            frees = [sqrt.id] + ([previous_denom.id] if previous_denom else [])
            n = shard_numel[p.name]
            b.op(f"optimizer.update.{p.name}", ph, step, -1, [sqrt, denom], frees,
                 flops=update_flops(s.optimizer, n), bytes_moved=n * dtype_bytes(state_dtype) * 5)
            previous_denom = denom
        if previous_denom:
            b.op("optimizer.update.end", ph, step, -1, [], [previous_denom.id])
    else:
        b.op(f"optimizer.{s.optimizer_impl}_update", ph, step, -1, [], [], flops=flops, bytes_moved=bytes_moved)
    if s.master_dtype:
        b.op("optimizer.copy_master_to_params", ph, step, -1, [], [g.id for g in fp32_grads],
             bytes_moved=total_numel * 6)


def _zero_grad(b: GraphBuilder, step: int, grads: GradState) -> None:
    frees = []
    if b.setup.set_to_none and not grads.persistent:
        frees = [blk.id for blk in grads.blocks.values()]
        grads.blocks.clear()
    b.op("zero_grad", Phase.ZERO_GRAD, step, -1, [], frees)
