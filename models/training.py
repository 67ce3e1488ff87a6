"""From model config + training setup to the op graph of a whole run: load, then `steps` x
(micro-batches of forward + backward, optimizer step, zero_grad).

The training loop described is the usual one:

    model = Model(cfg).to(device)               # load: parameters (+ fp32 master weights, main grads)
    for step in range(1, steps + 1):
        for mb in range(grad_accum):
            loss = model(batch[mb]); loss.backward()
        optimizer.step()                        # states created here at step 1
        optimizer.zero_grad(set_to_none=...)

With data parallelism, the engine of `setup.dp_engine` (models/parallel.py) decides each rank's layout,
its gathers and reduce buckets; `describe` writes one representative rank per class of identical ranks.
With `setup.optimizer_offload` the optimizer is wrapped (models/optimizers.py, models/offload.py): its
states live on the host between steps and `step()` runs chunk by chunk, each chunk copied in and out.
"""

from __future__ import annotations

import fnmatch
import itertools
from dataclasses import asdict

from ..simulator.events import Block, Category, OptimizerState, Phase, Pool, Stream
from ..simulator.ops import Op, OpGraph
from .autograd import GradState, MicroBatchReplay
from .checkpoint_io import load_checkpoint, rank_signature, save_checkpoint, saves_after
from .config import ConfigError, MLPConfig, TrainingSetup, TransformerConfig, dtype_bytes
from .costs import DeviceProfile, device_profile
from .optimizers import BNB_QMAP_BYTES, has_sqrt_temporaries, state_specs, step_pool, update_flops
from .parallel import make_engine
from .offload import OffloadedStates
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
    """Creates blocks and ops with fresh ids and durations from the cost model, for one rank; several
    builders (one per rank) can share one graph and one block counter."""

    def __init__(self, tape: Tape, setup: TrainingSetup, device: DeviceProfile, rank: int = 0,
                 graph: OpGraph | None = None, block_ids: itertools.count | None = None) -> None:
        self.tape = tape
        self.setup = setup
        self.device = device
        self.rank = rank
        self.graph = graph if graph is not None else OpGraph()
        self._block_ids = block_ids if block_ids is not None else itertools.count(1)
        self._last_on_stream: dict[Stream, int] = {}
        self.trainable = trainable_params(tape, setup.frozen)
        self.param_numel = {p.name: p.numel for p in tape.params}
        self.param_shape = {p.name: p.shape for p in tape.params}
        self.engine = make_engine(self)

    def block(self, name: str, nbytes: int, category: Category, dtype: str, shape=(), state=None,
              shard: int = 1, pool: Pool = Pool.DEVICE) -> Block:
        return Block(id=next(self._block_ids), nbytes=nbytes, category=category, name=name, dtype=dtype,
                     shape=tuple(shape), state=state, shard_factor=shard, rank=self.rank, pool=pool)

    def op(self, name: str, phase: Phase, step: int, micro_batch: int, allocs, frees, flops: int = 0,
           bytes_moved: int = 0, recompute: bool = False, stream: Stream = Stream.COMPUTE,
           duration: float | None = None, after=()) -> Op:
        """Add an op after the previous op of its stream (streams run in order) and after `after`."""
        if duration is None:
            duration = self.device.duration(flops, bytes_moved, self.setup.compute_dtype)
        op = Op(id=len(self.graph), name=name, stream=stream, phase=phase, step=step, micro_batch=micro_batch,
                duration=duration, rank=self.rank, allocs=tuple(allocs), frees=tuple(frees), flops=flops,
                recompute=recompute)
        previous = self._last_on_stream.get(stream)
        self._last_on_stream[stream] = op.id
        deps = tuple(dict.fromkeys(d for d in ((previous,) if previous is not None else ()) + tuple(after)
                                   if d is not None))
        return self.graph.add(op, after=deps)

    def last(self, stream: Stream) -> int | None:
        """The id of the latest op on `stream` of this rank (None before the first)."""
        return self._last_on_stream.get(stream)


def describe(model: ModelConfig, setup: TrainingSetup, device: str | DeviceProfile = "H100-80GB",
             ranks: list[int] | None = None) -> OpGraph:
    """The op graph of `setup.steps` training steps of `model`.

    With data parallelism each rank is described by its engine (models/parallel.py) into the same graph.
    `ranks=None` describes one representative of each class of ranks whose layouts are identical (one
    rank when they are symmetric); the classes are in `metadata["rank_classes"]`."""
    profile = device if isinstance(device, DeviceProfile) else device_profile(device)
    tape = build_tape(model, setup, profile.is_cpu)
    graph, ids = OpGraph(), itertools.count(1)
    if ranks is None:
        classes = rank_classes(tape, setup, profile)
    else:
        bad = [r for r in ranks if not (isinstance(r, int) and 0 <= r < setup.world_size)]
        if bad:
            raise ConfigError("ranks", f"rank {bad[0]!r} is not in 0..{setup.world_size - 1}")
        classes = {r: [r] for r in ranks}
    for rank in classes:
        b = GraphBuilder(tape, setup, profile, rank, graph, ids)
        _describe_rank(b)
    graph.metadata = {
        "model": model.name, "setup": asdict(setup), "device": profile.name,
        "n_params": tape.n_params, "n_trainable": sum(b.param_numel[p] for p in b.trainable),
        "forward_flops_per_microbatch": tape.forward_flops(),
        "effective_batch": setup.effective_batch,
        "tokens_per_step": setup.effective_batch * setup.seq_len,
        "rank_classes": {str(r): members for r, members in classes.items()},
        "assumptions": profile.assumptions(),
    }
    return graph


def rank_classes(tape: Tape, setup: TrainingSetup, profile: DeviceProfile) -> dict[int, list[int]]:
    """Ranks grouped by identical layout (bytes of every parameter shard and optimizer tensor, and what
    each saves): each class is simulated once, by its lowest rank. Engines whose layout is the same on
    every rank by construction (`Engine.symmetric`) are checked on ranks 0 and 1 only, unless the
    checkpoint saves spread tensors over ranks."""
    n = setup.world_size
    first = GraphBuilder(tape, setup, profile, 0)
    key = (first.engine.signature(), rank_signature(first))
    if first.engine.symmetric and n > 2 and key[1] in ((), ("rank0",)):
        second = GraphBuilder(tape, setup, profile, 1)
        if (second.engine.signature(), rank_signature(second)) == key:
            return {0: list(range(n))}
        return {0: [0], 1: list(range(1, n))}
    classes: dict[tuple, list[int]] = {key: [0]}
    for rank in range(1, n):
        builder = GraphBuilder(tape, setup, profile, rank)
        classes.setdefault((builder.engine.signature(), rank_signature(builder)), []).append(rank)
    return {members[0]: members for members in classes.values()}


def _describe_rank(b: GraphBuilder) -> None:
    setup = b.setup
    grads = GradState(persistent=setup.fp32_grads)
    b.engine.load(grads)
    states_loaded = load_checkpoint(b)
    offload = OffloadedStates(b, b.engine.optim_tensors()) if setup.optimizer_offload != "none" else None
    for step in range(1, setup.steps + 1):
        for mb in range(setup.grad_accum):
            MicroBatchReplay(b, b.tape, step, mb, grads).run()
            b.engine.end_backward(step, mb)
        _optimizer_step(b, step, grads, states_loaded, offload)
        b.op("zero_grad", Phase.ZERO_GRAD, step, -1, [], b.engine.zero_grad_frees(grads))
        if saves_after(setup, step):
            save_checkpoint(b, step)


def _optimizer_step(b: GraphBuilder, step: int, grads: GradState, states_loaded: bool = False,
                    offload: OffloadedStates | None = None) -> None:
    """torch.optim's step over the tensors this rank's optimizer owns (states created at step 1, unless
    they were loaded from a checkpoint), inside the optimizer-state offload when there is one."""
    tensors = b.engine.optim_tensors()
    create = step == 1 and not states_loaded
    chunked_first = create and offload is not None and b.setup.offload_first_step == "chunked"
    if create and not chunked_first:
        created = _create_states(b, step, tensors, "optimizer.init_state")
        if offload is not None:
            offload.adopt(created)
    fp32_grads = b.engine.before_step(step, grads)
    if offload is None:
        _update(b, step, tensors, "optimizer")
    elif create and not chunked_first:  # one whole torch step made every state on the device: now offload them
        _update(b, step, tensors, "optimizer")
        for k in range(len(offload.chunks)):
            offload.offload(k, step)
    else:
        _offloaded_update(b, step, offload, create)
    if fp32_grads or b.engine.master_dtype():
        b.op("optimizer.copy_master_to_params", Phase.OPTIMIZER, step, -1, [], [g.id for g in fp32_grads],
             bytes_moved=sum(t.numel for t in tensors) * 6)
    b.engine.after_step(step)


def _offloaded_update(b: GraphBuilder, step: int, offload: OffloadedStates, create: bool) -> None:
    """Chunk by chunk: copy in (`offload_prefetch` chunks ahead; nothing to copy in when the chunk's states
    are created by its own step, the first), a torch step over the chunk's parameters, copy back."""
    issued, transfers = 0, {}
    for k, chunk in enumerate(offload.chunks):
        name = f"optimizer.chunk{k}"
        if create:
            offload.adopt(_create_states(b, step, chunk, f"{name}.init_state"))
        else:
            while issued <= min(k + offload.prefetch, len(offload.chunks) - 1):
                transfers[issued] = offload.load(issued, step)
                issued += 1
        _update(b, step, chunk, name, after=(transfers[k],) if k in transfers else ())
        offload.offload(k, step)


def _create_states(b: GraphBuilder, step: int, tensors, op_name: str) -> list[Block]:
    """torch's lazy state init (`_init_group`) for `tensors`: every state of each, on the device (Adam's
    `step` scalar on the host unless fused)."""
    s = b.setup
    shard = b.engine.state_shard()
    step_state_pool = step_pool(b.device.is_cpu, s.optimizer_impl)
    states = []
    for t in tensors:
        for state, numel, dtype in state_specs(s.optimizer, t.numel, s.state_dtype):
            sharded = state is not OptimizerState.STEP
            states.append(b.block(f"{t.name}.{state.value}", numel * dtype_bytes(dtype), Category.OPTIMIZER_STATE,
                                  dtype, (numel,) if sharded else (), state=state,
                                  shard=shard if sharded else 1,
                                  pool=step_state_pool if not sharded else Pool.DEVICE))
    if s.optimizer == "adam-8bit":
        states.append(b.block("optimizer.qmaps", BNB_QMAP_BYTES, Category.OPTIMIZER_STATE, "fp32", (2, 256),
                              state=OptimizerState.QUANT_STATE))
    b.op(op_name, Phase.OPTIMIZER, step, -1, states, [], bytes_moved=sum(x.nbytes for x in states))
    return states


def _update(b: GraphBuilder, step: int, tensors, name: str, after=()) -> None:
    """The update kernels of one torch `step()` over `tensors` (ops named `<name>.<kind>`), with the
    temporaries of `setup.optimizer_impl`; the first op waits for `after`."""
    s = b.setup
    shard = b.engine.state_shard()
    state_dtype = s.state_dtype
    ph = Phase.OPTIMIZER
    total_numel = sum(t.numel for t in tensors)
    flops = update_flops(s.optimizer, total_numel)
    bytes_moved = total_numel * dtype_bytes(state_dtype) * 5
    if has_sqrt_temporaries(s.optimizer) and s.optimizer_impl == "foreach":
        temps = [b.block(f"{t.name}.exp_avg_sq_sqrt", t.numel * dtype_bytes(state_dtype), Category.TEMPORARY,
                         state_dtype, t.shape, shard=shard) for t in tensors]
        b.op(f"{name}.foreach_update", ph, step, -1, temps, [x.id for x in temps], flops=flops,
             bytes_moved=bytes_moved, after=after)
    elif has_sqrt_temporaries(s.optimizer) and s.optimizer_impl == "for-loop":
        previous_denom = None
        for i, t in enumerate(tensors):
            nbytes = t.numel * dtype_bytes(state_dtype)
            sqrt = b.block(f"{t.name}.exp_avg_sq_sqrt", nbytes, Category.TEMPORARY, state_dtype, t.shape)
            denom = b.block(f"{t.name}.denom", nbytes, Category.TEMPORARY, state_dtype, t.shape)
            frees = [sqrt.id] + ([previous_denom.id] if previous_denom else [])
            b.op(f"{name}.update.{t.name}", ph, step, -1, [sqrt, denom], frees,
                 flops=update_flops(s.optimizer, t.numel), bytes_moved=t.numel * dtype_bytes(state_dtype) * 5,
                 after=after if i == 0 else ())
            previous_denom = denom
        if previous_denom:
            b.op(f"{name}.update.end", ph, step, -1, [], [previous_denom.id])
    else:
        b.op(f"{name}.{s.optimizer_impl}_update", ph, step, -1, [], [], flops=flops, bytes_moved=bytes_moved,
             after=after)
