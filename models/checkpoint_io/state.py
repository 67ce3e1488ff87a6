"""The training state a checkpoint holds, rank by rank, and who writes which tensor: pure functions of a rank's
builder (no ops; save_load.py adds those).

What a checkpoint holds
-----------------------
A rank's training state (`rank_state`): its parameters as its data-parallel engine stores them
(models/parallel/: whole, a dim-0 shard, a flat partition), the fp32 master weights under mixed
precision, and the optimizer states (Adam's `step` included; with an optimizer-state offload,
models/optimizers.py, the states are read from their host buffers). Gradients and activations are
never saved. The module buffers the describers list (nanoGPT's eager causal mask, Llama's rotary
`inv_freq`) are registered non-persistent: they are not in a state dict.

For one state tensor t of rank r, write |t| for the bytes of r's own tensor (its shard, padding
excluded), S(t) for the bytes of the storage it views (FSDP2 pads every shard to ceil(dim0 / N) rows;
torch.save writes whole storages), F(t) for the whole tensor (every rank's part, padding excluded)
and G(t) for the all-gather output that rebuilds it (N x the padded shard). A tensor is *replicated*
when every rank holds the same one (parameters of DDP / ZeRO-0-2 / a single device; the optimizer
state of an engine that does not shard it), else it is the rank's own.

Who writes each tensor in a per-rank save (`written_by`; DCP's deduplication of the replicated ones,
`dcp_writers`), which steps save (`saves_after`), and what a checkpoint makes differ between ranks of one
layout (`rank_signature`, `rank_signatures`, `signature_ranks`).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, replace
from math import prod

from ...simulator.events import Category, OptimizerState, Pool
from ..config import dtype_bytes
from ..optimizers import BNB_QMAP_BYTES, state_specs
from ..optimizers import step_pool as optimizer_step_pool
from ..parallel import FSDP2, dim0_shard

FULL_MODES = ("full-rank0", "full-rank0-offload", "full-all")


@dataclass(frozen=True)
class StateTensor:
    """One tensor of a rank's training state, as a checkpoint sees it (see the module docstring for
    |t| = nbytes, S(t) = storage_nbytes, F(t) = full_nbytes, G(t) = gathered_nbytes)."""

    name: str  # the describer's block name of the live tensor
    category: Category
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    storage_nbytes: int
    full_nbytes: int
    gathered_nbytes: int
    shard: int  # ranks the tensor is split across (1: whole on this rank)
    replicated: bool  # every rank holds the same tensor
    pool: Pool  # where it lives
    state: OptimizerState | None = None

    @property
    def sharded(self) -> bool:
        return self.shard > 1


# -- the state (pure) ---------------------------------------------------------------------------------

def host_pool(builder) -> Pool:
    """Where host memory is counted: the rank's host pool, or the device pool on the "cpu" profile."""
    return Pool.DEVICE if builder.device.is_cpu else Pool.HOST


def step_pool(builder) -> Pool:
    """Where Adam's `step` tensors live, as models/training.py creates them."""
    return optimizer_step_pool(builder.device.is_cpu, builder.setup.optimizer.impl)


def rank_state(builder) -> tuple[StateTensor, ...]:
    """Rank `builder.rank`'s training state in state-dict order: parameters, master weights, optimizer states."""
    e, s = builder.engine, builder.setup
    n = s.mesh.world_size
    params = {p.name: p for p in builder.tape.params}
    out: list[StateTensor] = []
    dtype = e.param_storage_dtype()
    size = dtype_bytes(dtype)
    for p in builder.tape.params:
        stored, shard = e.param_numel(p.name)
        own = dim0_shard(p.shape, n, builder.rank)[1] if isinstance(e, FSDP2) else stored
        out.append(StateTensor(p.name, Category.PARAMETER, dtype, p.shape, own * size, stored * size,
                               p.numel * size, stored * shard * size, shard, shard == 1, Pool.DEVICE))
    shard = e.state_shard()
    replicated = shard == 1 and not e.shards_optimizer
    tensors = e.optim_tensors()

    def full_numel(t) -> int:
        return params[t.name].numel if shard > 1 and t.name in params else t.numel * shard

    def padded_numel(t) -> int:
        return e.param_numel(t.name)[0] if shard > 1 and t.name in params else t.numel

    if e.master_dtype():
        for t in tensors:
            out.append(StateTensor(f"{t.name}.master", Category.MASTER_PARAMETER, "fp32", t.shape, t.numel * 4,
                                   t.numel * 4, full_numel(t) * 4, padded_numel(t) * shard * 4, shard, replicated,
                                   Pool.DEVICE))
    state_pool = Pool.HOST if s.offload.mode != "none" else Pool.DEVICE  # offloaded: host buffers (offload.py)
    for t in tensors:  # states that follow the parameter's shape (OptimizerSpec.by_shape) are never sharded
        local = state_specs(s.optimizer.name, t.numel, s.precision.state, t.shape)
        full = state_specs(s.optimizer.name, full_numel(t), s.precision.state, t.shape)
        padded = state_specs(s.optimizer.name, padded_numel(t), s.precision.state, t.shape)
        for (state, shape, dt), (_, full_shape, _), (_, padded_shape, _) in zip(local, full, padded):
            split = state is not OptimizerState.STEP
            k = dtype_bytes(dt)
            numel, full_n, padded_n = prod(shape), prod(full_shape), prod(padded_shape)
            out.append(StateTensor(f"{t.name}.{state.value}", Category.OPTIMIZER_STATE, dt, shape,
                                   numel * k, numel * k, full_n * k if split else numel * k,
                                   padded_n * shard * k if split else numel * k, shard if split else 1,
                                   replicated, state_pool if split else step_pool(builder), state))
    if s.optimizer.name == "adam-8bit":
        out.append(StateTensor("optimizer.qmaps", Category.OPTIMIZER_STATE, "fp32", (2, 256), BNB_QMAP_BYTES,
                               BNB_QMAP_BYTES, BNB_QMAP_BYTES, BNB_QMAP_BYTES, 1, replicated, Pool.DEVICE,
                               OptimizerState.QUANT_STATE))
    return tuple(out)


def dcp_writers(rank0_state: tuple[StateTensor, ...], world_size: int) -> dict[str, int]:
    """The rank that writes each replicated tensor in a DCP save: torch.distributed.checkpoint's
    `dedup_save_plans` (save_to_lowest_rank=False) walks rank 0's plan in order, counts the rank's own
    tensors into its planned bytes, and gives each tensor every rank holds to the rank with the fewest
    planned bytes so far (the lowest rank on ties).

    The ranks planned something so far sit in a heap (rank 0 from the start), against the lowest rank
    not yet planned anything (0 bytes, as every rank after it): O(T log T) for T tensors, any world size."""
    planned = {0: 0}
    heap = [(0, 0)]  # (planned bytes, rank); an entry whose bytes are no longer the rank's is stale
    fresh = 1  # the lowest rank planned nothing
    writers: dict[str, int] = {}
    for t in rank0_state:
        if t.replicated:
            while heap[0][0] != planned[heap[0][1]]:
                heapq.heappop(heap)
            if fresh < world_size and heap[0][0] > 0:  # 0 bytes beat any; on a tie the lower rank (heap's) wins
                r, fresh = fresh, fresh + 1
                planned[r] = 0
            else:
                r = heapq.heappop(heap)[1]
            writers[t.name] = r
            planned[r] += t.nbytes or 1
            heapq.heappush(heap, (planned[r], r))
        else:
            planned[0] += t.nbytes or 1
            heapq.heappush(heap, (planned[0], 0))
    return writers


def state_dict_items(builder, state: tuple[StateTensor, ...]) -> tuple[StateTensor, ...]:
    """The tensors of a state dict in order, one per key: a tied output embedding is a key of its own
    (`model.state_dict()` lists `lm_head.weight` next to the embedding it is). DCP writes, and a full
    state dict gathers, every key (torch.save and the async stager copy a shared storage once)."""
    params = [t for t in state if t.category is Category.PARAMETER]
    by_name = {t.name: t for t in params}
    aliases = [replace(by_name[p], name="lm_head.weight") for op in builder.tape.ops if op.name == "lm_head"
               for p in op.params if p != "lm_head.weight" and p in by_name]
    return (*params, *aliases, *state[len(params):])


def written_by(
    builder, state: tuple[StateTensor, ...], writers: dict[str, int] | None = None
) -> tuple[StateTensor, ...]:
    """The tensors rank `builder.rank` writes in a per-rank save ("torch-save", "sharded"): its own, and the
    replicated ones it is given (rank 0 for torch-save; DCP's deduplication for sharded: `writers`, as
    `sharded_writers(b)` gives them, computed here when not given)."""
    if builder.setup.checkpoint_io.save_mode == "sharded":
        items = state_dict_items(builder, state)
        if builder.setup.mesh.world_size == 1:
            return items
        if writers is None:
            writers = sharded_writers(builder, items if builder.rank == 0 else None)
        return tuple(t for t in items if not t.replicated or writers[t.name] == builder.rank)
    return tuple(t for t in state if not t.replicated or builder.rank == 0)


def sharded_writers(builder, rank0_items: tuple[StateTensor, ...] | None = None) -> dict[str, int]:
    """`dcp_writers` of a sharded save: the plan every rank shares, from rank 0's state-dict items
    (`rank0_items`, else rank 0's state built here; `builder` is any rank's)."""
    if rank0_items is None:
        rank0_items = state_dict_items(builder, rank_state(type(builder)(builder.tape, builder.setup, builder.device)))
    return dcp_writers(rank0_items, builder.setup.mesh.world_size)


def saves_after(setup, step: int) -> bool:
    """Whether the run saves a checkpoint after optimizer step `step` (every `checkpoint_every` steps)."""
    return setup.checkpoint_io.every > 0 and step % setup.checkpoint_io.every == 0


def saves_any(setup) -> bool:
    """Whether the run saves at all: some step in 1..steps is a multiple of `checkpoint_every` (in O(1))."""
    return 0 < setup.checkpoint_io.every <= setup.batch.steps


def rank_signature(builder, writers: dict[str, int] | None = None) -> tuple:
    """What a checkpoint makes differ between ranks of identical layout (empty when nothing is saved):
    rank 0 alone keeps a full state dict; per-rank saves write different replicated tensors (`writers`:
    a sharded save's `sharded_writers`, computed when not given)."""
    s = builder.setup
    if not saves_any(s):
        return ()
    if s.checkpoint_io.save_mode in FULL_MODES:
        return ("rank0" if builder.rank == 0 else "other",)
    if s.checkpoint_io.save_mode in ("torch-save", "sharded"):
        return tuple(t.nbytes for t in written_by(builder, rank_state(builder), writers))
    return ()


def signature_ranks(builder) -> set[int]:
    """Where `rank_signature` can change along the ranks beyond the engine's layout (`Engine.rank_segments`):
    at rank 1 (rank 0 keeps the full state dict, writes the replicated tensors of a torch-save) and, with a
    sharded save, at every DCP writer and the rank after it. `builder` is rank 0's."""
    s = builder.setup
    out = {1}
    if s.checkpoint_io.save_mode == "sharded" and s.mesh.world_size > 1 and saves_any(s):
        out |= {
            r + k
            for r in set(sharded_writers(builder, state_dict_items(builder, rank_state(builder))).values())
            for k in (0, 1)
        }
    return {r for r in out if r < s.mesh.world_size}


def rank_signatures(builder, ranks, make_builder) -> dict[int, tuple]:
    """`rank_signature` of each of `ranks` at once. `builder` is rank 0's; `make_builder(r)` makes rank r's, and
    is called only where a rank's own state tells it apart: a torch-save or sharded save by an engine whose
    layout is not the same on every rank. A symmetric engine's ranks share rank 0's state and one DCP
    plan: rank r's sharded signature is the state's rank-own tensors merged, in state-dict order, with the
    replicated ones r writes (O(tensors + ranks x what each writes), not O(tensors x ranks))."""
    s = builder.setup
    ranks = list(ranks)
    saves = saves_any(s)
    if not saves or s.checkpoint_io.save_mode not in ("torch-save", "sharded"):
        return {
            r: ("rank0" if r == 0 else "other",) if saves and s.checkpoint_io.save_mode in FULL_MODES else ()
            for r in ranks
        }
    state = rank_state(builder)
    items = state_dict_items(builder, state) if s.checkpoint_io.save_mode == "sharded" else state
    writers = (
        dcp_writers(items, s.mesh.world_size)
        if s.checkpoint_io.save_mode == "sharded" and s.mesh.world_size > 1
        else None
    )
    if not builder.engine.symmetric:
        return {r: rank_signature(builder if r == builder.rank else make_builder(r), writers) for r in ranks}
    if writers is None:  # torch-save (rank 0 writes the replicated tensors), or a sharded save on one rank
        mine = tuple(t.nbytes for t in items if not t.replicated or s.checkpoint_io.save_mode == "sharded")
        everything = tuple(t.nbytes for t in items)
        return {r: everything if r == 0 else mine for r in ranks}
    own = [i for i, t in enumerate(items) if not t.replicated]
    by_writer: dict[int, list[int]] = {}
    for i, t in enumerate(items):
        if t.replicated:
            by_writer.setdefault(writers[t.name], []).append(i)
    common = tuple(items[i].nbytes for i in own)
    return {r: tuple(items[i].nbytes for i in heapq.merge(own, by_writer[r])) if r in by_writer else common
            for r in ranks}


__all__ = ["StateTensor", "rank_state", "state_dict_items", "written_by", "sharded_writers", "dcp_writers",
           "saves_after", "saves_any", "rank_signature", "signature_ranks", "rank_signatures", "host_pool",
           "step_pool", "FULL_MODES"]
