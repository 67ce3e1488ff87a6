"""Checkpoint save and load: the device and host memory a training checkpoint needs, rank by rank.

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

Saving (`TrainingSetup.save_mode`, after every `checkpoint_every`-th optimizer step, Phase.CHECKPOINT)
--------------------------------------------------------------------------------------------------
`model.state_dict()` and `optimizer.state_dict()` return the live tensors (detached views): no bytes.

- "torch-save": `torch.save({"model": ..., "optimizer": ...}, path)`. torch/serialization.py (`_save`)
  pickles first, then writes storage after storage; a storage not on the CPU is copied to the host
  with `storage.cpu()` right before it is written, into the loop variable, so the previous host copy
  is dropped before the next one is made: one host copy at a time (pageable memory; the pinned
  option `torch.utils.serialization.config.save.use_pinned_memory_for_d2h` is off by default and
  has the same lifetimes). The rank writes its own tensors, and rank 0 the replicated ones.
      host   +max S(t) over the device tensors it writes, transient     device  +0
  On the "cpu" profile `storage.cpu()` is the storage itself: nothing is copied (+0 on both).
  Written to an `io.BytesIO` instead of a file, the archive itself (about the checkpoint's size, as
  the buffer grows) is held in host memory too: not modelled here (the file is assumed).
- "full-rank0", "full-rank0-offload", "full-all": a full (unsharded) state dict, built tensor by
  tensor as torch.distributed.checkpoint.state_dict.get_state_dict(full_state_dict=True) does
  (`_gather_state_dict`: `full_tensor()` per DTensor), then written by rank 0 with torch.save.
  Every sharded tensor is all-gathered on every rank into a device buffer of G(t), once per state-dict
  key (a tied embedding twice: measured on gloo); a rank whose shard is shorter than the padded one
  first pads it (`constant_pad_nd`, G(t) / N, transient: DTensor's uneven all-gather); whole tensors
  are used as they are.
    full-rank0          (FSDP FullStateDictConfig(offload_to_cpu=False, rank0_only=True)) rank 0
                        keeps every gathered tensor on its device until the file is written; the
                        other ranks drop each one as soon as it is gathered.
                          rank 0  device +sum G(t) over sharded t, then host +max over its device
                                  tensors as in torch-save;   other ranks  device +max G(t), transient
    full-rank0-offload  (offload_to_cpu=True, rank0_only=True = get_state_dict(cpu_offload=True))
                        rank 0 copies each tensor to the host (`.to("cpu")`: F(t) of a gathered one,
                        |t| of a whole device tensor) and drops the gathered buffer at once.
                          rank 0  host +sum over device tensors, kept until written; device +max G(t)
                          other ranks  device +max G(t), transient
                        On the "cpu" profile `.to("cpu")` returns the gathered tensor itself: rank 0
                        keeps the G(t) buffers, as full-rank0 does.
    full-all            (get_state_dict(full_state_dict=True) without cpu_offload: ranks_only=())
                        every rank keeps every gathered tensor until rank 0 has written the file.
                          every rank  device +sum G(t) over sharded t; rank 0 host as full-rank0
  For DeepSpeed these are the same semantics applied to its partitions (its flat fp32 groups are
  gathered too); DeepSpeed itself consolidates only the 16-bit weights online and the fp32 state
  offline (zero_to_fp32.py). ZeroRedundancyOptimizer's `consolidate_state_dict` (pickled per rank
  through a device byte tensor) is not modelled: refused by TrainingSetup.
- "sharded": torch.distributed.checkpoint (DCP) `save` with the FileSystemWriter: each rank writes its
  own tensors, and replicated ones are spread by `dedup_save_plans` (each to the rank with the fewest
  planned bytes so far, the lowest on ties, in rank 0's state-dict order); every state-dict key is an
  item, so a tied output embedding is written twice (torch.save writes its storage once). With a GPU, the
  `_OverlappingCpuLoader` copies each tensor to the host (`.to("cpu")`, |t|, smallest first, 10 MB
  ahead), and the writer loop keeps every staged tensor in its `tensor_dict` until the rank's file
  is written (torch 2.13 filesystem.py, `_write_files_from_queue`), so the copies add up:
      host   +sum |t| over the device tensors it writes, freed when the file is written    device +0
  On the "cpu" profile the `_SerialCpuLoader`'s `.cpu()` is the tensor itself: +0.
- "async": `dcp.async_save` with a stager kept across saves (torchtitan's async_with_pinned_mem,
  DCP's `DefaultStager` reused): the StateDictStager copies every storage of the rank's state dict,
  host-resident ones included, into a CPU storage cached per source storage: allocated at the first
  save (pinned in place on a GPU host) and reused by every later save; the file is then written by a
  background thread from those copies (no further bytes).
      host   +sum S(t) over every tensor, persistent from the first save                 device +0
  (plus a one-element host placeholder per tensor while its copy is made: StateDictStager builds each
  copy as `new_empty([])` then `set_` to the staged storage.)
  (torch 2.13's `async_save` without a stager makes a fresh unpinned copy per save and drops it when
  the write has finished: the same host peak, released between saves.)

Loading (`TrainingSetup.load_mode`, at the start of the run, Phase.LOAD)
------------------------------------------------------------------------
The rank reads back the state it holds (its own file: torch.save, or its DCP shards). Loaded
optimizer states become the optimizer's states (optimizer.load_state_dict keeps a tensor already of
the parameter's device and dtype; Adam's host `step` stays on the host), so the first step creates
none (`load_checkpoint` returns True).

- "full-then-device": the model is built on the device (parameters allocated), then
  `sd = torch.load(path, map_location="cpu")` reads every tensor into host memory, all kept;
  `model.load_state_dict(sd)` copies into the existing parameters (no new bytes);
  `optimizer.load_state_dict` copies each state to the device; dropping `sd` frees the host copies.
      host   +sum S(t), then freed        device  +sum S(t) over optimizer states (kept)
  On the "cpu" profile the loaded states are the states and the loaded parameters are dropped
  after their copy: device +sum S(t) at the peak, +states after.
- "map-to-device": `torch.load(path, map_location=device)` into a model built on the device: each
  storage is read into a host buffer, moved to the device, and the host buffer dropped (one at a
  time); the loaded parameters sit next to the initialized ones until `sd` is dropped.
      host   +max S(t), transient         device  +sum S(t) (parameters x 2 at the peak)
- "meta-assign": the model is built on the meta device (no bytes), loaded with map_location=device
  and `model.load_state_dict(sd, assign=True)`: the loaded tensors become the parameters; the
  optimizer is built after (re-tie tied weights first) and adopts the loaded states.
      host   +max S(t), transient         device  +0 beyond the state itself
  On the "cpu" profile there is no host buffer: the tensors are read where they stay.

Where host memory is
--------------------
On a GPU profile host memory is the rank's Pool.HOST (per rank; `timeline(log, rank, Pool.HOST)`
gives its peak). On the "cpu" profile host and device are one memory, so what would be host blocks
are Pool.DEVICE blocks, and a copy to the host of a CPU tensor is no copy.

Durations are timing only: device<->host copies at the profile's `host_link`, file writes and reads
at STORAGE_BANDWIDTH (an assumption).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, replace
from math import prod

from ..simulator.events import Block, Category, OptimizerState, Phase, Pool, Stream
from .config import dtype_bytes
from .optimizers import BNB_QMAP_BYTES, state_specs
from .optimizers import step_pool as optimizer_step_pool
from .parallel import FSDP2, dim0_shard

STORAGE_BANDWIDTH = 2e9  # bytes/s one rank writes to or reads from checkpoint storage (assumption; timing only)
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


# -- saving -------------------------------------------------------------------------------------------

def _storage_seconds(nbytes: int) -> float:
    return nbytes / STORAGE_BANDWIDTH


def _copy_seconds(builder, nbytes: int) -> float:
    return nbytes / builder.device.host_link


def _on_device(builder, t: StateTensor) -> bool:
    """A tensor a save must copy to host memory: one in device memory of a GPU profile."""
    return not builder.device.is_cpu and t.pool is Pool.DEVICE


PIN_MIN_BYTES = 5  # the stager pins a copy of at least this many bytes (torch 2.13 distributed/checkpoint/
# _state_dict_stager.py `pin_memory_min_bytes`; DefaultStager's StagingOptions.use_pinned_memory is True, staging.py)


def _staging(builder, name: str, nbytes: int, t: StateTensor, pool: Pool, whole: bool = False,
             pinned: bool = False) -> Block:
    """A checkpoint buffer holding `t` (its shard, or the `whole` tensor rebuilt by a gather); `pinned`: page-locked
    host memory (only the async stager's copies; every other host copy here is pageable)."""
    return builder.block(name, nbytes, Category.CHECKPOINT_STAGING, t.dtype, t.shape, shard=1 if whole else t.shard,
                   pool=pool, pinned=pinned)


def save_checkpoint(builder, step: int) -> None:
    """Add the ops of one checkpoint save after optimizer step `step` (Phase.CHECKPOINT) to rank `builder.rank`."""
    mode = builder.setup.checkpoint_io.save_mode
    state = rank_state(builder)
    if mode == "torch-save":
        _torch_save(builder, step, written_by(builder, state), "checkpoint.torch_save")
    elif mode in FULL_MODES:
        _full_state_dict(builder, step, state)
    elif mode == "sharded":
        _dcp_save(builder, step, written_by(builder, state))
    elif mode == "async":
        _async_save(builder, step, state)
    else:
        raise ValueError(f"unknown save_mode {mode!r}")


def _torch_save(builder, step: int, tensors, prefix: str, storages=None) -> None:
    """torch.save of `tensors` (a rank's own file): one host copy at a time of each device storage.
    `storages` maps a tensor name to the device block it is written from, when that is not the tensor
    itself (a gathered full tensor)."""
    ph, written = Phase.CHECKPOINT, 0
    for t in tensors:
        source = (storages or {}).get(t.name)
        nbytes = source.nbytes if source is not None else t.storage_nbytes
        on_device = _on_device(builder, t) if source is None else not builder.device.is_cpu
        if not on_device:
            written += nbytes
            continue
        host = _staging(builder, f"checkpoint.{t.name}.host", nbytes, t, Pool.HOST, whole=source is not None)
        builder.op(f"{prefix}.write.{t.name}", ph, step, -1, [host], [host.id],
             duration=_copy_seconds(builder, nbytes) + _storage_seconds(nbytes))
    builder.op(f"{prefix}.write", ph, step, -1, [], [], duration=_storage_seconds(written))


def _full_state_dict(builder, step: int, state: tuple[StateTensor, ...]) -> None:
    """A full state dict gathered tensor by tensor on every rank, kept or offloaded on rank 0, then
    written by rank 0 (see the module docstring for full-rank0 / full-rank0-offload / full-all)."""
    mode, rank0, ph = builder.setup.checkpoint_io.save_mode, builder.rank == 0, Phase.CHECKPOINT
    offload = mode == "full-rank0-offload" and not builder.device.is_cpu
    keep = (rank0 and not offload) or mode == "full-all"
    kept: list[Block] = []
    storages: dict[str, Block] = {}
    items = state_dict_items(builder, state)
    for t in items:
        if t.sharded:
            full = _staging(builder, f"checkpoint.{t.name}.full", t.gathered_nbytes, t, Pool.DEVICE, whole=True)
            shard = t.gathered_nbytes // t.shard  # a shorter local shard is padded to it as the gather's input
            padded = [_staging(builder, f"checkpoint.{t.name}.padded_shard", shard, t, Pool.DEVICE)
                      for _ in range(t.nbytes < shard)]
            gather = builder.engine.collective(f"checkpoint.all_gather.{t.name}", "all_gather", t.gathered_nbytes, ph,
                                         step, -1, allocs=[*padded, full], frees=[x.id for x in padded],
                                         after=(builder.last(Stream.COMPUTE),))
            if keep:
                kept.append(full)
                storages[t.name] = full
                continue
            host = [_staging(builder, f"checkpoint.{t.name}.host", t.full_nbytes, t, Pool.HOST, whole=True)
                    for _ in range(rank0)]
            builder.op(f"checkpoint.full.{'offload' if rank0 else 'drop'}.{t.name}", ph, step, -1, host, [full.id],
                 duration=_copy_seconds(builder, t.full_nbytes) if rank0 else 0.0, after=(gather.id,))
            kept += host
        elif rank0 and offload and _on_device(builder, t):
            host = _staging(builder, f"checkpoint.{t.name}.host", t.storage_nbytes, t, Pool.HOST)
            builder.op(f"checkpoint.full.offload.{t.name}", ph, step, -1, [host], [],
                 duration=_copy_seconds(builder, t.storage_nbytes))
            kept.append(host)
    if rank0:
        if offload:
            builder.op("checkpoint.full.torch_save.write", ph, step, -1, [], [],
                 duration=_storage_seconds(sum(x.nbytes for x in kept)))
        else:
            _torch_save(builder, step, items, "checkpoint.full.torch_save", storages)
    builder.op(
        "checkpoint.full.release", ph, step, -1, [], [x.id for x in kept], after=(builder.last(Stream.COMMUNICATION),)
    )


def _dcp_save(builder, step: int, tensors) -> None:
    """DCP save with the FileSystemWriter: every device tensor the rank writes is staged to the host
    (smallest first) and kept until the rank's file is written."""
    ph = Phase.CHECKPOINT
    staged: list[Block] = []
    for t in sorted(tensors, key=lambda x: x.nbytes):  # _OverlappingCpuLoader.start_loading sorts by size
        if not _on_device(builder, t):
            continue
        host = _staging(builder, f"checkpoint.{t.name}.host", t.nbytes, t, Pool.HOST)
        builder.op(
            f"checkpoint.dcp.stage.{t.name}", ph, step, -1, [host], [], duration=_copy_seconds(builder, t.nbytes)
        )
        staged.append(host)
    builder.op("checkpoint.dcp.write", ph, step, -1, [], [x.id for x in staged],
         duration=_storage_seconds(sum(t.nbytes for t in tensors)))


def _async_save(builder, step: int, state: tuple[StateTensor, ...]) -> None:
    """Async save: the stager's deep copy of every storage into its cached host copy (allocated at the
    first save), on the compute stream, then the write on the rank's host stream in the background.
    Each tensor's copy starts from a one-element host placeholder (`x.new_empty([], device="cpu")`,
    StateDictStager._offload_tensor) that `set_` replaces by the staged storage: a transient of one
    element per tensor."""
    ph, pool = Phase.CHECKPOINT, host_pool(builder)
    first = step == builder.setup.checkpoint_io.every
    for t in state:
        placeholder = builder.block(
            f"checkpoint.{t.name}.placeholder",
            dtype_bytes(t.dtype),
            Category.CHECKPOINT_STAGING,
            t.dtype,
            (),
            pool=pool,
        )
        staged = [_staging(builder, f"checkpoint.{t.name}.staging", t.storage_nbytes, t, pool,
                           pinned=pool is Pool.HOST and t.storage_nbytes >= PIN_MIN_BYTES)] if first else []
        builder.op(f"checkpoint.async.stage.{t.name}", ph, step, -1, [placeholder] + staged, [placeholder.id],
             duration=_copy_seconds(builder, t.storage_nbytes))
    builder.op("checkpoint.async.write", ph, step, -1, [], [], stream=Stream.HOST,
         duration=_storage_seconds(sum(t.storage_nbytes for t in state)), after=(builder.last(Stream.COMPUTE),))


# -- loading ------------------------------------------------------------------------------------------

def _adopted(builder, t: StateTensor) -> Block:
    """The loaded tensor that becomes the optimizer's state: the block the first step would have created."""
    return builder.block(
        t.name, t.storage_nbytes, t.category, t.dtype, t.shape, state=t.state, shard=t.shard, pool=t.pool
    )


def load_checkpoint(builder) -> bool:
    """Add the ops of loading the rank's checkpoint (`setup.checkpoint_io.load_mode`, Phase.LOAD, after the engine has
    built the model). True when the optimizer states now exist (the first step creates none)."""
    mode = builder.setup.checkpoint_io.load_mode
    if mode == "none":
        return False
    state = rank_state(builder)
    if mode == "full-then-device":
        _load_to_host(builder, state)
    elif mode in ("map-to-device", "meta-assign"):
        _load_to_device(builder, state, keep_params=mode == "meta-assign")
    else:
        raise ValueError(f"unknown load_mode {mode!r}")
    return any(t.category is Category.OPTIMIZER_STATE for t in state)


def _load_to_host(builder, state: tuple[StateTensor, ...]) -> None:
    """torch.load(map_location="cpu") of everything, copy into the model, states to the device, drop."""
    ph, pool = Phase.LOAD, host_pool(builder)
    read: list[Block] = []
    for t in state:
        adopt = t.category is Category.OPTIMIZER_STATE and t.pool is pool
        blk = (
            _adopted(builder, t)
            if adopt
            else _staging(builder, f"checkpoint.{t.name}.loaded", t.storage_nbytes, t, pool)
        )
        builder.op(f"checkpoint.load.read.{t.name}", ph, 0, -1, [blk], [], duration=_storage_seconds(t.storage_nbytes))
        if not adopt:
            read.append(blk)
    model = [t for t in state if t.category is not Category.OPTIMIZER_STATE]
    builder.op("checkpoint.load.model_load_state_dict", ph, 0, -1, [], [],
         duration=_copy_seconds(builder, sum(t.storage_nbytes for t in model)))
    moved = [_adopted(builder, t) for t in state if t.category is Category.OPTIMIZER_STATE and t.pool is not pool]
    builder.op("checkpoint.load.optimizer_load_state_dict", ph, 0, -1, moved, [],
         duration=_copy_seconds(builder, sum(x.nbytes for x in moved)))
    builder.op("checkpoint.load.release", ph, 0, -1, [], [x.id for x in read])


def _load_to_device(builder, state: tuple[StateTensor, ...], keep_params: bool) -> None:
    """torch.load(map_location=device): each device storage through a host buffer (dropped once moved;
    none on the "cpu" profile, nor for tensors that live on the host). The loaded parameters are the
    model's own (meta-assign: `keep_params`) or copies dropped after `load_state_dict` (map-to-device)."""
    ph = Phase.LOAD
    copies: list[Block] = []
    for t in state:
        host = [_staging(builder, f"checkpoint.{t.name}.read", t.storage_nbytes, t, Pool.HOST)
                for _ in range(_on_device(builder, t))]
        if t.category is Category.OPTIMIZER_STATE:
            lands = [_adopted(builder, t)]
        elif keep_params:
            lands = []
        else:
            lands = [_staging(builder, f"checkpoint.{t.name}.loaded", t.storage_nbytes, t, t.pool)]
            copies += lands
        builder.op(f"checkpoint.load.read.{t.name}", ph, 0, -1, host + lands, [x.id for x in host],
             duration=_storage_seconds(t.storage_nbytes) + _copy_seconds(builder, t.storage_nbytes))
    builder.op("checkpoint.load.load_state_dict", ph, 0, -1, [], [],
         duration=_copy_seconds(builder, sum(x.nbytes for x in copies)))
    builder.op("checkpoint.load.release", ph, 0, -1, [], [x.id for x in copies])


__all__ = ["StateTensor", "rank_state", "state_dict_items", "written_by", "sharded_writers", "dcp_writers",
           "saves_after", "rank_signature", "signature_ranks", "rank_signatures", "save_checkpoint", "load_checkpoint",
           "host_pool", "step_pool", "FULL_MODES",
           "STORAGE_BANDWIDTH"]
