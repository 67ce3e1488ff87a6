"""The ops of a checkpoint save and load on one rank: the device and host blocks each mode makes, when they are
freed, and the durations (the state they move and the notation |t|, S(t), F(t), G(t): state.py).

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

from ...simulator.events import Block, Category, Phase, Pool, Stream
from ..config import dtype_bytes
from .state import FULL_MODES, StateTensor, host_pool, rank_state, state_dict_items, written_by

STORAGE_BANDWIDTH = 2e9  # bytes/s one rank writes to or reads from checkpoint storage (assumption; timing only)


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


__all__ = ["save_checkpoint", "load_checkpoint", "STORAGE_BANDWIDTH"]
