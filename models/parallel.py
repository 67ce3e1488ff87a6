"""Data parallelism: which bytes each rank holds, and the collectives that move them.

N ranks train one model on different data. A data-parallel *engine* decides, for each rank:

- the layout: how many elements of each parameter, gradient, fp32 master weight and optimizer state
  the rank stores (padding for uneven shards included), and which tensors its optimizer steps over;
- the transient buffers: all-gather buffers that rebuild a unit's full parameters for its compute,
  reduce / reduce-scatter buckets that carry gradients, and when each is allocated and freed;
- the collectives, as ops on the rank's communication stream that overlap compute in SimPy time.

Engines (`TrainingSetup.dp_engine`):

- "deepspeed" with `zero_stage` (DeepSpeed ZeRO semantics):
  0  full replicas; gradients all-reduced through flat buckets of `reduce_bucket_size` elements.
  1  bit16 parameters flattened into one buffer padded to a multiple of 2N elements; each rank keeps
     the fp32 master copy and optimizer states of its 1/N flat partition; full gradients until the
     step, then reduced and the rank's partition turned fp32 for the update; updated partitions are
     all-gathered in place.
  2  as 1, but gradients are reduced during backward: each gradient is copied into the `ipg` bucket
     (`reduce_bucket_size` elements, allocated once) and dropped; the rank keeps only its partition
     (`grads_in_partition`, allocated at the first reduce).
  3  every parameter split into N partitions of ceil(numel / N) (parameters of at most
     `stage3_param_persistence_threshold` elements stay whole); before each module runs its
     parameters are all-gathered into a buffer (prefetching up to `stage3_prefetch_bucket_size`
     elements ahead from the second step on, when the trace is known, never holding more than
     `stage3_max_live_parameters`), and released after; gradients go through the ipg bucket into a
     flat partition buffer allocated at start; fp32 partitions and states per sub-group.
- "fsdp2" (torch `fully_shard` per transformer block / per MLP Linear, then the root): each parameter
  is chunked on dim 0 and padded to ceil(dim0 / N) rows on every rank; optimizer states follow the
  rank's unpadded local rows. A unit's all-gather fills one flat output buffer, copied out into each
  parameter's unsharded storage; after the unit (forward with `reshard_after_forward`, and backward)
  the unsharded storage is freed; the unit's gradients are reduce-scattered through a flat input
  buffer into one flat sharded-gradient buffer. The root is not resharded after forward.
- "ddp": full replicas; the gradient buckets of torch DDP (`ddp_bucket_cap_mb`) all-reduced as
  backward ends.
- "zero-redundancy-optimizer": DDP plus torch's ZeroRedundancyOptimizer: whole parameters are
  assigned to ranks greedily, largest first, to the rank with the fewest elements so far; a rank
  keeps optimizer states for its own parameters only and broadcasts them after its step.

The layout functions are pure. `Engine` objects receive hooks from the describer (`training.py`) and
the autograd replay (`autograd.py`) at the moments the real engine acts.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from math import prod

from ..simulator.events import Block, Category, Phase, Pool, Stream
from .config import dtype_bytes

DS_ALIGNMENT = 2  # DeepSpeed's nccl_start_alignment_factor: flat buffers padded to a multiple of 2N
DS_SUB_GROUP_SIZE = 1_000_000_000  # DeepSpeed stage 3 sub_group_size (elements), its default
DDP_FIRST_BUCKET_BYTES = 1024 * 1024  # torch.distributed._DEFAULT_FIRST_BUCKET_BYTES
UNIT_PATTERN = re.compile(r"^(transformer\.h\.\d+|model\.layers\.\d+|layers\.\d+)\.")
ROOT = "root"


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


# -- layouts (pure) ----------------------------------------------------------------------------------

def dim0_shard(shape: tuple[int, ...], world_size: int, rank: int) -> tuple[int, int]:
    """FSDP2: (padded elements stored on every rank, elements of this rank's unpadded local shard).

    torch.chunk on dim 0: every rank stores ceil(dim0 / N) rows (padding included); rank r's local
    shard holds the rows that exist, which can be fewer (or none) on the last ranks."""
    rows = shape[0] if shape else 1
    rest = 1
    for d in shape[1:]:
        rest *= d
    chunk = ceil_div(rows, world_size)
    local_rows = max(0, min(chunk, rows - rank * chunk))
    return chunk * rest, local_rows * rest


def flat_partition(total_numel: int, world_size: int, alignment: int = DS_ALIGNMENT) -> tuple[int, int]:
    """DeepSpeed stages 1-2: (padded flat numel, numel of each rank's partition)."""
    unit = alignment * world_size
    padded = ceil_div(total_numel, unit) * unit
    return padded, padded // world_size


def greedy_partition(numels: list[tuple[str, int]], world_size: int) -> list[list[str]]:
    """torch ZeroRedundancyOptimizer: parameters sorted by size (largest first, stable), each to the rank
    with the fewest elements so far (the lowest rank on ties)."""
    sizes = [0] * world_size
    owned: list[list[str]] = [[] for _ in range(world_size)]
    for name, numel in sorted(numels, key=lambda item: -item[1]):
        rank = sizes.index(min(sizes))
        owned[rank].append(name)
        sizes[rank] += numel
    return owned


def unit_of(name: str, units: set[str]) -> str:
    """The FSDP unit a parameter or op belongs to: the transformer block / MLP Linear it sits in, else root."""
    m = UNIT_PATTERN.match(name + ".")
    if m and m.group(1) in units:
        return m.group(1)
    parts = name.split(".")
    for k in range(1, len(parts)):  # a traced tape's layers (`Tape.layers`): any module path
        if ".".join(parts[:k]) in units:
            return ".".join(parts[:k])
    return ROOT


def sub_groups(numels: list[int], size: int = DS_SUB_GROUP_SIZE) -> list[int]:
    """DeepSpeed stage 3: partition numels grouped in order into sub-groups of at most `size` elements
    (a larger tensor is a sub-group of its own); the numel of each sub-group."""
    groups: list[int] = []
    current = 0
    for n in numels:
        if current and current + n > size:
            groups.append(current)
            current = 0
        current += n
    if current:
        groups.append(current)
    return groups


@dataclass(frozen=True)
class OptimTensor:
    """One tensor the optimizer updates on this rank: a parameter, its shard, or a flat partition."""

    name: str
    numel: int
    shape: tuple[int, ...]


def own_dtype(tape, name: str) -> str | None:
    """A parameter's own dtype where the tape gives one (models/lora.py `LoraTape`: fp32 adapters under pure bf16,
    4-bit packed weights), else None (the setup's parameter dtype)."""
    return getattr(tape, "param_dtypes", {}).get(name)


# -- engines ------------------------------------------------------------------------------------------

class Engine:
    """Full replicas: one device, or DDP-style data parallelism without sharding.

    Subclasses override the layout and the hooks; this class is also the exact single-device case.
    """

    shards_optimizer = False
    symmetric = True  # every rank's layout is the same by construction (padded equal partitions)

    def __init__(self, b) -> None:
        self.b = b
        self.setup = b.setup
        self.n = b.setup.world_size
        self.rank = b.rank
        self.params = {p.name: p for p in b.tape.params}
        self.trainable = [p for p in b.tape.params if p.name in b.trainable]
        self.grad_dtype = b.setup.grad_dtype
        self.contribution_dtype = "fp32" if b.setup.param_dtype == "fp32" else b.setup.param_dtype

    # layout ------------------------------------------------------------------------------------------
    def param_numel(self, name: str) -> tuple[int, int]:
        """(elements of parameter `name` this rank stores at rest, shard factor)."""
        return self.params[name].numel, 1

    def optim_tensors(self) -> list[OptimTensor]:
        return [OptimTensor(p.name, p.numel, p.shape) for p in self.trainable]

    def master_dtype(self) -> str | None:
        return self.setup.master_dtype

    def state_shard(self) -> int:
        return 1

    def signature(self) -> tuple:
        """What makes this rank's bytes differ from another's: ranks with equal signatures are identical."""
        return (tuple(self.param_numel(p.name) for p in self.b.tape.params),
                tuple((t.name, t.numel) for t in self.optim_tensors()))

    # load --------------------------------------------------------------------------------------------
    def load(self, grads) -> None:
        b, s = self.b, self.setup
        params = []
        for p in b.tape.params:
            numel, shard = self.param_numel(p.name)
            dt = own_dtype(b.tape, p.name) or self.param_storage_dtype()
            params.append(b.block(p.name, numel * dtype_bytes(dt), Category.PARAMETER, dt, p.shape, shard=shard))
        params += self.extra_param_blocks()
        # the describers' buffers are floating point: `module.to(dtype)` casts them with the parameters
        buffers = []
        for t in b.tape.buffers:  # a traced tape's buffers keep the dtype they were traced in
            dtype = self.param_storage_dtype() if b.tape.buffers_follow_params else t.dtype
            buffers.append(b.block(t.name, prod(t.shape) * dtype_bytes(dtype), Category.BUFFER, dtype, t.shape))
        b.op("load.parameters", Phase.LOAD, 0, -1, params + buffers, [], bytes_moved=sum(x.nbytes for x in params))
        master_dtype = self.master_dtype()
        if master_dtype:
            master = [b.block(f"{t.name}.master", t.numel * 4, Category.MASTER_PARAMETER, "fp32", t.shape,
                              shard=self.state_shard()) for t in self.optim_tensors()]
            b.op("load.master_weights", Phase.LOAD, 0, -1, master, [], bytes_moved=sum(x.nbytes for x in master))
        if grads.persistent:
            main = [b.block(f"{p.name}.main_grad", p.numel * 4, Category.GRADIENT, "fp32", p.shape)
                    for p in self.trainable]
            grads.blocks.update({p.name: blk for p, blk in zip(self.trainable, main)})
            b.op("load.main_grads", Phase.LOAD, 0, -1, main, [], bytes_moved=sum(x.nbytes for x in main))
        self.after_load()

    def param_storage_dtype(self) -> str:
        return self.setup.param_dtype

    def extra_param_blocks(self) -> list[Block]:
        return []

    def after_load(self) -> None:
        pass

    # forward / backward hooks ------------------------------------------------------------------------
    def before_op(self, replay, i: int, phase: Phase, recompute: bool = False) -> None:
        pass

    def after_op(self, replay, i: int, phase: Phase, recompute: bool = False) -> None:
        pass

    def param_grad(self, replay, p: str, allocs: list, frees: list) -> None:
        """A gradient contribution for parameter `p` in backward: the first in the step becomes `.grad`;
        later ones (more micro-batches, kept gradients) are temporaries summed in place.

        A parameter read by several ops of one micro-batch (a tied embedding) has one AccumulateGrad
        node, whose input buffer sums the contributions before it runs: the first waits in the buffer
        (from its own backward node on), each later one is added OUT of place once the node that made
        it is done (a new sum, then the old sum and the contribution are freed: measured with the
        tracker, torch 2.13 CPU, fp32 and bf16-autocast), and after the last one AccumulateGrad steals
        the sum as `.grad`, or adds it in place to the `.grad` already there and frees it."""
        b = self.b
        numel, shape = self.params[p].numel, self.params[p].shape
        own = own_dtype(b.tape, p)  # a LoRA adapter kept fp32 under pure bf16: its gradient is fp32 too
        grad_dtype, contribution_dtype = (own, own) if own else (self.grad_dtype, self.contribution_dtype)
        has_grad = replay.grads.persistent or p in replay.grads.blocks or p in replay.contributed
        uses = replay.grad_uses.get(p, 1)
        if uses > 1:
            seen = replay.grad_seen[p] = replay.grad_seen.get(p, 0) + 1
            cdt = contribution_dtype
            new = b.block(f"{p}.grad_contribution", numel * dtype_bytes(cdt), Category.TEMPORARY, cdt, shape)
            allocs.append(new)
            if seen == 1:
                replay.grad_buffer[p] = new  # waits in AccumulateGrad's input buffer
                replay.grad_had[p] = has_grad
                if not has_grad:  # keeps `.grad`'s place in the order gradients are freed (zero_grad)
                    replay.grads.blocks[p] = new
                return
            last = seen == uses
            stolen = last and not replay.grad_had[p]
            total = b.block(f"{p}.grad" if stolen else f"{p}.grad_sum", numel * dtype_bytes(cdt),
                            Category.GRADIENT if stolen else Category.TEMPORARY, cdt, shape)
            # the engine adds a node's outputs to the next input buffers once the node is done (its
            # grad_output and saved tensors gone): the sum is an op of its own, right after
            sum_frees = [replay.grad_buffer.pop(p).id, new.id]
            if not last:
                replay.grad_buffer[p] = total
            elif stolen:
                replay.grads.blocks[p] = total
            else:
                sum_frees.append(total.id)  # summed in place into the `.grad` already there
            replay.after_node.append((f"{p}.grad_accumulate", [total], sum_frees))
            replay.contributed.add(p)
            return
        if has_grad:
            tmp = b.block(f"{p}.grad_contribution", numel * dtype_bytes(contribution_dtype),
                          Category.TEMPORARY, contribution_dtype, shape)
            allocs.append(tmp)
            frees.append(tmp.id)
        else:
            blk = b.block(f"{p}.grad", numel * dtype_bytes(grad_dtype), Category.GRADIENT,
                          grad_dtype, shape)
            replay.grads.blocks[p] = blk
            allocs.append(blk)
        replay.contributed.add(p)

    def end_backward(self, step: int, mb: int) -> None:
        pass

    # optimizer ---------------------------------------------------------------------------------------
    def before_step(self, step: int, grads) -> list[Block]:
        """Before the update: fp32 copies of 16-bit gradients where mixed precision needs them (freed after)."""
        s, b = self.setup, self.b
        if not (s.master_dtype and not s.fp32_grads):
            return []
        fp32 = [b.block(f"{t.name}.grad_fp32", t.numel * 4, Category.TEMPORARY, "fp32", t.shape,
                        shard=self.state_shard()) for t in self.optim_tensors()]
        b.op("optimizer.grads_to_fp32", Phase.OPTIMIZER, step, -1, fp32, [],
             bytes_moved=3 * sum(x.nbytes for x in fp32))
        return fp32

    def after_step(self, step: int) -> None:
        pass

    def zero_grad_frees(self, grads) -> list[int]:
        """`zero_grad(set_to_none=True)` drops the gradients in parameter order (torch/optim/optimizer.py
        `zero_grad`: its param_groups in `model.parameters()` order)."""
        if self.setup.set_to_none and not grads.persistent:
            order = {p.name: i for i, p in enumerate(self.b.tape.params)}
            frees = [blk.id for _, blk in sorted(grads.blocks.items(), key=lambda kv: order.get(kv[0], len(order)))]
            grads.blocks.clear()
            return frees
        return []

    # collectives -------------------------------------------------------------------------------------
    def collective(self, name: str, kind: str, nbytes: int, phase: Phase, step: int, mb: int,
                   allocs=(), frees=(), after=()):
        """One collective: its buffers are allocated (and its scratch freed) when the host issues it, in
        program order on the compute stream, as the caching allocator sees them; the transfer itself runs
        on the rank's communication stream for the ring model's duration, overlapping later compute."""
        issue = self.b.op(f"{name}.issue", phase, step, mb, allocs, frees, duration=0.0, after=after)
        duration = self.b.device.collective_duration(kind, nbytes, self.n)
        return self.b.op(name, phase, step, mb, [], [], stream=Stream.COMMUNICATION, duration=duration,
                         after=(issue.id,))


class DDP(Engine):
    """torch DDP: full replicas; gradient buckets (`ddp_bucket_cap_mb`, the first one 1 MiB) built at
    construction in reverse parameter order, all-reduced when backward ends."""

    def bucket_numels(self) -> list[int]:
        cap = self.setup.ddp_bucket_cap_mb * 1024 * 1024
        size = dtype_bytes(self.grad_dtype)
        buckets, current, limit = [], 0, DDP_FIRST_BUCKET_BYTES
        for p in reversed(self.trainable):
            current += p.numel
            if current * size >= limit:
                buckets.append(current)
                current, limit = 0, cap
        if current:
            buckets.append(current)
        return buckets

    def after_load(self) -> None:
        if self.n == 1:
            return
        self.buckets = [self.b.block(f"ddp.bucket.{k}", n * dtype_bytes(self.grad_dtype), Category.REDUCE_SCATTER_BUCKET,
                                     self.grad_dtype, (n,)) for k, n in enumerate(self.bucket_numels())]
        self.b.op("ddp.init_buckets", Phase.LOAD, 0, -1, self.buckets, [])

    def end_backward(self, step: int, mb: int) -> None:
        if self.n == 1:
            return
        for k, blk in enumerate(self.buckets):
            self.collective(f"ddp.all_reduce.bucket{k}", "all_reduce", blk.nbytes, Phase.BACKWARD, step, mb)
        self.b.op("ddp.copy_back", Phase.BACKWARD, step, mb, [], [], after=(self.b.last(Stream.COMMUNICATION),))


class ZeroRedundancy(DDP):
    """DDP + torch.distributed.optim.ZeroRedundancyOptimizer: states for this rank's own parameters only."""

    shards_optimizer = True
    symmetric = False  # whole parameters per rank: uneven by nature

    def owned(self) -> list[str]:
        return greedy_partition([(p.name, p.numel) for p in self.trainable], self.n)[self.rank]

    def optim_tensors(self) -> list[OptimTensor]:
        mine = set(self.owned())
        return [OptimTensor(p.name, p.numel, p.shape) for p in self.trainable if p.name in mine]

    def after_step(self, step: int) -> None:
        owners = greedy_partition([(p.name, p.numel) for p in self.trainable], self.n)
        for r, names in enumerate(owners):
            nbytes = sum(self.params[n].numel for n in names) * dtype_bytes(self.setup.param_dtype)
            self.collective(f"zero.broadcast.rank{r}", "broadcast", nbytes, Phase.OPTIMIZER, step, -1)


class DeepSpeedReplica(Engine):
    """DeepSpeed without ZeRO on N ranks: gradients all-reduced through transient flat buckets."""

    def end_backward(self, step: int, mb: int) -> None:
        if self.n == 1 or mb != self.setup.grad_accum - 1:
            return
        total = sum(p.numel for p in self.trainable)
        size = dtype_bytes(self.grad_dtype)
        k = 0
        while total > 0:
            n = min(total, self.setup.reduce_bucket_size)
            bucket = self.b.block(f"deepspeed.allreduce_bucket.{k}", n * size, Category.REDUCE_SCATTER_BUCKET,
                                  self.grad_dtype, (n,))
            self.collective(f"deepspeed.all_reduce.bucket{k}", "all_reduce", n * size, Phase.BACKWARD, step, mb,
                            allocs=[bucket], frees=[bucket.id])
            total -= n
            k += 1


class IpgBucket:
    """DeepSpeed's gradient path in stages 2 and 3: each gradient autograd produces is copied into the
    `ipg` bucket (`reduce_bucket_size` elements, allocated at the first gradient and kept) and dropped;
    a full bucket is reduce-scattered into the rank's flat gradient partition (`partition` elements;
    allocated at the first reduce when `lazy_partition`, else already at load)."""

    def __init__(self, engine: Engine, partition: int, lazy_partition: bool) -> None:
        self.engine = engine
        self.partition_numel = partition
        self.lazy = lazy_partition
        self.bucket: Block | None = None
        self.partition: Block | None = None
        self.filled = 0
        self.reduced = 0

    def partition_block(self) -> Block:
        e = self.engine
        return e.b.block("deepspeed.grad_partition", self.partition_numel * dtype_bytes(e.grad_dtype),
                         Category.GRADIENT, e.grad_dtype, (self.partition_numel,), shard=e.n)

    def add(self, p: str, step: int, mb: int, allocs: list, frees: list) -> None:
        e = self.engine
        spec = e.params[p]
        size = dtype_bytes(e.grad_dtype)
        tmp = e.b.block(f"{p}.grad", spec.numel * size, Category.TEMPORARY, e.grad_dtype, spec.shape)
        allocs.append(tmp)
        frees.append(tmp.id)
        if self.bucket is None:
            n = e.setup.reduce_bucket_size
            self.bucket = e.b.block("deepspeed.ipg_bucket", n * size, Category.REDUCE_SCATTER_BUCKET, e.grad_dtype, (n,))
            allocs.append(self.bucket)
        if self.filled and self.filled + spec.numel > e.setup.reduce_bucket_size:
            self.flush(step, mb)
        self.filled += spec.numel

    def flush(self, step: int, mb: int) -> None:
        if not self.filled:
            return
        e = self.engine
        allocs = []
        if self.partition is None and self.lazy:
            self.partition = self.partition_block()
            allocs.append(self.partition)
        e.collective(f"deepspeed.reduce_scatter.bucket{self.reduced}", "reduce_scatter",
                     self.filled * dtype_bytes(e.grad_dtype), Phase.BACKWARD, step, mb, allocs=allocs,
                     after=(e.b.last(Stream.COMPUTE),))
        self.reduced += 1
        self.filled = 0


class DeepSpeedZero12(Engine):
    """DeepSpeed ZeRO stages 1 and 2 (one flat parameter group)."""

    shards_optimizer = True

    def __init__(self, b) -> None:
        super().__init__(b)
        self.total = sum(p.numel for p in self.trainable)
        self.padded, self.partition = flat_partition(self.total, self.n)
        self.ipg = IpgBucket(self, self.partition, lazy_partition=True)

    def optim_tensors(self) -> list[OptimTensor]:
        return [OptimTensor("flat_group0.partition", self.partition, (self.partition,))]

    def master_dtype(self) -> str | None:
        return "fp32"  # DeepSpeed keeps an fp32 copy of the rank's partition even in fp32 training

    def state_shard(self) -> int:
        return self.n

    def extra_param_blocks(self) -> list[Block]:
        pad = self.padded - self.total
        if not pad:
            return []
        dt = self.setup.param_dtype
        return [self.b.block("flat_group0.padding", pad * dtype_bytes(dt), Category.PARAMETER, dt, (pad,))]

    def param_grad(self, replay, p: str, allocs: list, frees: list) -> None:
        if self.setup.zero_stage == 1:
            return super().param_grad(replay, p, allocs, frees)
        self.ipg.add(p, replay.step, replay.mb, allocs, frees)

    def end_backward(self, step: int, mb: int) -> None:
        if self.setup.zero_stage == 2:
            self.ipg.flush(step, mb)

    def before_step(self, step: int, grads) -> list[Block]:
        b = self.b
        if self.setup.zero_stage == 1:  # full gradients reduced now, through one bucket at a time
            size = dtype_bytes(self.grad_dtype)
            left, k = self.total, 0
            while left > 0:
                n = min(left, self.setup.reduce_bucket_size)
                bucket = b.block(f"deepspeed.reduce_bucket.{k}", n * size, Category.REDUCE_SCATTER_BUCKET,
                                 self.grad_dtype, (n,))
                self.collective(f"deepspeed.reduce.bucket{k}", "reduce_scatter", n * size, Phase.OPTIMIZER, step, -1,
                                allocs=[bucket], frees=[bucket.id])
                left -= n
                k += 1
        fp32 = b.block("flat_group0.partition.grad_fp32", self.partition * 4, Category.TEMPORARY, "fp32",
                       (self.partition,), shard=self.n)
        frees = self.zero_grad_frees(grads) if self.setup.zero_stage == 1 else []
        b.op("optimizer.grads_to_fp32", Phase.OPTIMIZER, step, -1, [fp32], frees, bytes_moved=3 * fp32.nbytes,
             after=(b.last(Stream.COMMUNICATION),) if b.last(Stream.COMMUNICATION) is not None else ())
        return [fp32]

    def after_step(self, step: int) -> None:
        size = dtype_bytes(self.setup.param_dtype)
        left, k = self.padded, 0
        while left > 0:
            n = min(left, self.setup.allgather_bucket_size)
            self.collective(f"deepspeed.all_gather.params{k}", "all_gather", n * size, Phase.OPTIMIZER, step, -1,
                            after=(self.b.last(Stream.COMPUTE),))
            left -= n
            k += 1

    def zero_grad_frees(self, grads) -> list[int]:
        if self.setup.zero_stage == 2:
            return []
        return super().zero_grad_frees(grads)


class Gathering(Engine):
    """Engines that keep parameters sharded and rebuild them for compute (FSDP2, ZeRO-3), by groups: an
    FSDP2 unit, or the parameters of one module call in ZeRO-3. A group is gathered (`gather`: the
    all-gather output allocated when issued, possibly ahead as a prefetch), waited for and made whole
    (`wait` -> the subclass's `copy_out`), and released after its compute (`release`)."""

    shards_optimizer = True

    def __init__(self, b) -> None:
        super().__init__(b)
        self.gather_dtype = self.setup.param_dtype
        self.live: dict[str, list[Block]] = {}  # group -> unsharded parameter blocks now allocated
        self.in_flight: dict[str, int] = {}  # group -> id of the collective that fetched it
        self.buffers: dict[str, Block] = {}  # group -> its all-gather output
        self.unsharded_grads: dict[str, Block] = {}

    def group_params(self, group: str) -> list:
        raise NotImplementedError

    def padded_full(self, name: str) -> int:
        """Elements of the rebuilt (unsharded) parameter: N x the padded shard."""
        return self.param_numel(name)[0] * self.n

    def gather(self, group: str, phase: Phase, step: int, mb: int) -> None:
        """Issue the all-gather of `group` on the communication stream (once the current compute is done)."""
        if group in self.live or group in self.in_flight or not self.group_params(group):
            return
        b = self.b
        size = dtype_bytes(self.gather_dtype)
        numel = sum(self.padded_full(p.name) for p in self.group_params(group))
        buf = b.block(f"{group}.all_gather_output", numel * size, Category.ALL_GATHER_BUFFER, self.gather_dtype,
                      (numel,))
        last = b.last(Stream.COMPUTE)
        op = self.collective(f"{self.prefix}.all_gather.{group}", "all_gather", numel * size, phase, step, mb,
                             allocs=[buf], after=() if last is None else (last,))
        self.in_flight[group] = op.id
        self.buffers[group] = buf

    def wait(self, group: str, phase: Phase, step: int, mb: int) -> None:
        """The compute stream waits for `group`'s all-gather and makes its parameters whole."""
        if group in self.live or not self.group_params(group):
            return
        if group not in self.in_flight:
            self.gather(group, phase, step, mb)
        self.copy_out(group, self.in_flight.pop(group), phase, step, mb)

    def copy_out(self, group: str, gather_op: int, phase: Phase, step: int, mb: int) -> None:
        raise NotImplementedError

    def release(self, group: str, phase: Phase, step: int, mb: int) -> None:
        blocks = self.live.pop(group, None)
        if blocks is not None:
            self.b.op(f"{self.prefix}.reshard.{group}", phase, step, mb, [], [x.id for x in blocks])


class FSDP2(Gathering):
    """torch FSDP2 `fully_shard`: one unit per transformer block / MLP Linear, the rest in the root.

    The order of allocations and frees is the one measured on torch 2.13 (gloo, CPU; see
    bench/DISTRIBUTED_FINDINGS.md):
    forward   unit pre-forward: all-gather output (flat, N x the padded shards), copy-out into each
              parameter's unsharded storage, then the previous unit's all-gather output is freed (FSDP2
              keeps the last one as `all_gather_state`; the root's post-forward frees the last);
              post-forward: the unsharded storages are freed (`reshard_after_forward`, never the root).
    backward  the root's pre-backward all-gathers the first unit in backward order ahead
              (`backward_prefetch` units ahead at every pre-backward); a unit's pre-backward copies out
              and frees its all-gather output at once; its post-backward reshards, frees the previous
              unit's reduce-scatter input, allocates its own (N x padded shards), frees the unsharded
              gradients and reduce-scatters into one flat sharded-gradient buffer (summed into the
              existing one in later micro-batches); the last input is freed by the final callback.
    Not modelled: gloo's reduce-scatter clones its input on its worker threads, freed at a moment that
    varies from run to run (NCCL makes no such copy); measured logs drop it (`without_backend_copies`).
    """

    prefix = "fsdp"
    symmetric = False  # the last ranks' local shards can be shorter (or empty)

    def __init__(self, b) -> None:
        super().__init__(b)
        self.units = set(b.tape.layers) or {m.group(1) for p in b.tape.params if (m := UNIT_PATTERN.match(p.name))}
        self.unit_params: dict[str, list] = {}
        for p in b.tape.params:
            self.unit_params.setdefault(unit_of(p.name, self.units), []).append(p)
        self.op_unit = [unit_of(op.name, self.units) for op in b.tape.ops]
        self.forward_order = list(dict.fromkeys(u for u in self.op_unit if u != ROOT))
        self.kept_gather: Block | None = None  # all_gather_state: the last forward all-gather output
        self.kept_reduce_input: Block | None = None  # reduce_scatter_state: the last reduce-scatter input
        self.sharded_grads: dict[str, Block] = {}
        self.last_backward: dict[str, int] = {}
        self.backward_started = False

    # layout ----------------------------------------------------------------------------------------------
    def param_numel(self, name: str) -> tuple[int, int]:
        return dim0_shard(self.params[name].shape, self.n, self.rank)[0], self.n

    def param_storage_dtype(self) -> str:
        return "fp32" if self.setup.master_dtype else self.setup.param_dtype

    def master_dtype(self) -> str | None:
        return None  # the fp32 sharded parameters are the master weights under mixed precision

    def state_shard(self) -> int:
        return self.n

    def optim_tensors(self) -> list[OptimTensor]:
        out = []
        for p in self.trainable:
            local = dim0_shard(p.shape, self.n, self.rank)[1]
            rest = p.numel // p.shape[0] if p.shape else 1
            out.append(OptimTensor(p.name, local, (local // rest, *p.shape[1:]) if p.shape else ()))
        return out

    def group_params(self, group: str) -> list:
        return self.unit_params.get(group, [])

    # unshard / reshard -----------------------------------------------------------------------------------
    def copy_out(self, unit: str, gather_op: int, phase: Phase, step: int, mb: int) -> None:
        """Copy the unit's gathered parameters into their unsharded storages; the all-gather output is freed
        at once in backward, and kept as `all_gather_state` until the next unit's copy-out in forward."""
        output = self.buffers.pop(unit)
        b = self.b
        size = dtype_bytes(self.gather_dtype)
        blocks = [b.block(f"{p.name}.unsharded", self.padded_full(p.name) * size, Category.PARAMETER,
                          self.gather_dtype, p.shape) for p in self.group_params(unit)]
        if phase is Phase.FORWARD:
            frees = [self.kept_gather.id] if self.kept_gather is not None else []
            self.kept_gather = output
        else:
            frees = [output.id]
        b.op(f"fsdp.copy_out.{unit}", phase, step, mb, blocks, frees, bytes_moved=2 * sum(x.nbytes for x in blocks),
             after=(gather_op,))
        self.live[unit] = blocks

    def prefetch_backward(self, unit: str | None, step: int, mb: int) -> None:
        """Issue the all-gathers of the next `backward_prefetch` units in backward order after `unit`."""
        order = list(reversed(self.forward_order))
        k = 0 if unit is None else order.index(unit) + 1
        for ahead in order[k:k + self.setup.backward_prefetch]:
            if ahead not in self.live:
                self.gather(ahead, Phase.BACKWARD, step, mb)

    # hooks -----------------------------------------------------------------------------------------------
    def before_op(self, replay, i: int, phase: Phase, recompute: bool = False) -> None:
        step, mb = replay.step, replay.mb
        unit = self.op_unit[i]
        if phase is Phase.FORWARD:
            if i == 0:
                self.backward_started = False
                self.wait(ROOT, phase, step, mb)
            if unit != ROOT:
                self.wait(unit, phase, step, mb)
                k = self.forward_order.index(unit)
                for ahead in self.forward_order[k + 1:k + 1 + self.setup.forward_prefetch]:
                    self.gather(ahead, phase, step, mb)
            return
        if not self.backward_started:  # the root's pre-backward
            self.backward_started = True
            self.last_backward = {}
            for j in replay.backward_order():
                if self.op_unit[j] != ROOT:
                    self.last_backward[self.op_unit[j]] = j
            self.wait(ROOT, phase, step, mb)
            self.prefetch_backward(None, step, mb)
        if unit != ROOT and unit not in self.live:
            self.wait(unit, phase, step, mb)
            self.prefetch_backward(unit, step, mb)

    def after_op(self, replay, i: int, phase: Phase, recompute: bool = False) -> None:
        unit = self.op_unit[i]
        if recompute:
            return
        if phase is Phase.FORWARD:
            last = i + 1 == len(self.op_unit)
            if unit != ROOT and (last or self.op_unit[i + 1] != unit) and self.setup.reshard_after_forward:
                self.release(unit, phase, replay.step, replay.mb)
            if last and self.kept_gather is not None:  # the root's post-forward drops all_gather_state
                self.b.op("fsdp.root_post_forward", phase, replay.step, replay.mb, [], [self.kept_gather.id])
                self.kept_gather = None
        elif unit != ROOT and self.last_backward.get(unit) == i:
            self.post_backward(unit, replay.step, replay.mb)

    def param_grad(self, replay, p: str, allocs: list, frees: list) -> None:
        b, spec = self.b, self.params[p]
        if p in self.unsharded_grads:  # a tied weight's second use: summed into the first
            tmp = b.block(f"{p}.grad_contribution", spec.numel * dtype_bytes(self.gather_dtype), Category.TEMPORARY,
                          self.gather_dtype, spec.shape)
            allocs.append(tmp)
            frees.append(tmp.id)
            return
        blk = b.block(f"{p}.unsharded.grad", spec.numel * dtype_bytes(self.gather_dtype), Category.GRADIENT,
                      self.gather_dtype, spec.shape)
        self.unsharded_grads[p] = blk
        allocs.append(blk)

    def post_backward(self, unit: str, step: int, mb: int) -> None:
        """Reshard the unit, then reduce-scatter its gradients into the flat sharded-gradient buffer."""
        b = self.b
        self.release(unit, Phase.BACKWARD, step, mb)
        params = [p for p in self.group_params(unit) if p.name in self.unsharded_grads]
        if not params:
            return
        dt = self.gather_dtype
        full = sum(self.padded_full(p.name) for p in self.group_params(unit))
        rs_input = b.block(f"{unit}.reduce_scatter_input", full * dtype_bytes(dt), Category.REDUCE_SCATTER_BUCKET,
                           dt, (full,))
        frees = [self.kept_reduce_input.id] if self.kept_reduce_input is not None else []
        self.kept_reduce_input = rs_input
        b.op(f"fsdp.reduce_scatter_copy_in.{unit}", Phase.BACKWARD, step, mb, [rs_input],
             frees + [self.unsharded_grads.pop(p.name).id for p in params], bytes_moved=2 * rs_input.nbytes)
        shard = full // self.n
        grad_dt = self.param_storage_dtype()
        first = unit not in self.sharded_grads
        out = b.block(f"{unit}.sharded_grads" if first else f"{unit}.reduce_scatter_output", shard * dtype_bytes(grad_dt),
                      Category.GRADIENT if first else Category.TEMPORARY, grad_dt, (shard,), shard=self.n)
        allocs, out_frees = [out], [] if first else [out.id]
        if first:
            self.sharded_grads[unit] = out
        self.collective(f"fsdp.reduce_scatter.{unit}", "reduce_scatter", rs_input.nbytes, Phase.BACKWARD, step, mb,
                        allocs=allocs, frees=out_frees, after=(b.last(Stream.COMPUTE),))

    def end_backward(self, step: int, mb: int) -> None:
        for unit in [u for u in self.forward_order if u in self.live]:
            self.post_backward(unit, step, mb)
        self.post_backward(ROOT, step, mb)
        # the final callback: wait for the last reduce-scatter and drop reduce_scatter_state
        frees = [self.kept_reduce_input.id] if self.kept_reduce_input is not None else []
        self.kept_reduce_input = None
        self.b.op("fsdp.post_backward_final_callback", Phase.BACKWARD, step, mb, [], frees,
                  after=(self.b.last(Stream.COMMUNICATION),))

    def zero_grad_frees(self, grads) -> list[int]:
        if not self.setup.set_to_none:
            return []
        frees = [blk.id for blk in self.sharded_grads.values()]
        self.sharded_grads.clear()
        return frees

    def before_step(self, step: int, grads) -> list[Block]:
        return []


class DeepSpeedZero3(Gathering):
    """DeepSpeed ZeRO stage 3: per-parameter partitions, per-module fetch and release, prefetch by trace."""

    prefix = "zero3"

    def __init__(self, b) -> None:
        super().__init__(b)
        threshold = self.setup.stage3_param_persistence_threshold
        self.persistent = {p.name for p in b.tape.params if p.numel <= threshold}
        self.op_groups = [tuple(dict.fromkeys(p for p in op.params if p not in self.persistent)) for op in b.tape.ops]
        partitions = [ceil_div(p.numel, self.n) for p in self.trainable]
        self.sub_groups = sub_groups(partitions)
        self.ipg = IpgBucket(self, sum(partitions), lazy_partition=False)

    def param_numel(self, name: str) -> tuple[int, int]:
        if name in self.persistent:
            return self.params[name].numel, 1
        return ceil_div(self.params[name].numel, self.n), self.n

    def padded_full(self, name: str) -> int:
        return ceil_div(self.params[name].numel, self.n) * self.n

    def master_dtype(self) -> str | None:
        return "fp32"

    def state_shard(self) -> int:
        return self.n

    def optim_tensors(self) -> list[OptimTensor]:
        return [OptimTensor(f"fp32_sub_group{k}.partition", n, (n,)) for k, n in enumerate(self.sub_groups)]

    def after_load(self) -> None:
        self.ipg.partition = self.ipg.partition_block()
        self.b.op("zero3.init_grad_partition", Phase.LOAD, 0, -1, [self.ipg.partition], [])

    def group_params(self, group: str) -> list:
        return [self.params[p] for p in self.op_groups[int(group)]]

    def copy_out(self, group: str, gather_op: int, phase: Phase, step: int, mb: int) -> None:
        # the gathered flat buffer is the parameters' storage: nothing is copied, it waits for the gather
        self.b.op(f"zero3.wait.{group}", phase, step, mb, [], [], after=(gather_op,))
        self.live[group] = [self.buffers.pop(group)]

    def _prefetch(self, order: list[int], step: int, phase: Phase, mb: int) -> None:
        """Fetch the next groups of the recorded trace, up to the prefetch bucket and the live limit."""
        if step < 2:
            return  # the first step records the trace; DeepSpeed prefetches from the second on
        budget = self.setup.stage3_prefetch_bucket_size
        live = sum(self.padded_full(p.name) for g in list(self.live) + list(self.in_flight)
                   for p in self.group_params(g))
        for j in order:
            if budget <= 0:
                return
            group = str(j)
            if not self.op_groups[j] or group in self.live or group in self.in_flight:
                continue
            numel = sum(self.padded_full(p.name) for p in self.group_params(group))
            if live + numel > self.setup.stage3_max_live_parameters:
                return
            self.gather(group, phase, step, mb)
            live += numel
            budget -= numel

    def before_op(self, replay, i: int, phase: Phase, recompute: bool = False) -> None:
        if not self.op_groups[i]:
            return
        self.wait(str(i), phase, replay.step, replay.mb)
        n_ops = len(self.op_groups)
        order = range(i + 1, n_ops) if phase is Phase.FORWARD else range(i - 1, -1, -1)
        self._prefetch(list(order), replay.step, phase, replay.mb)

    def after_op(self, replay, i: int, phase: Phase, recompute: bool = False) -> None:
        if self.op_groups[i]:
            self.release(str(i), phase, replay.step, replay.mb)

    def param_grad(self, replay, p: str, allocs: list, frees: list) -> None:
        self.ipg.add(p, replay.step, replay.mb, allocs, frees)

    def end_backward(self, step: int, mb: int) -> None:
        self.ipg.flush(step, mb)
        for group in list(self.in_flight):  # prefetched but never used: dropped with the trace
            self.copy_out(group, self.in_flight.pop(group), Phase.BACKWARD, step, mb)
            self.release(group, Phase.BACKWARD, step, mb)

    def zero_grad_frees(self, grads) -> list[int]:
        return []

    def before_step(self, step: int, grads) -> list[Block]:
        b = self.b
        fp32 = [b.block(f"{t.name}.grad_fp32", t.numel * 4, Category.TEMPORARY, "fp32", t.shape, shard=self.n)
                for t in self.optim_tensors()]
        b.op("optimizer.grads_to_fp32", Phase.OPTIMIZER, step, -1, fp32, [], bytes_moved=3 * sum(x.nbytes for x in fp32),
             after=(b.last(Stream.COMMUNICATION),))
        return fp32


def make_engine(b) -> Engine:
    """The engine for `b.setup` (dp_engine, zero_stage, world_size)."""
    s = b.setup
    if s.dp_engine == "fsdp2":
        return FSDP2(b)
    if s.dp_engine == "ddp":
        return DDP(b)
    if s.dp_engine == "zero-redundancy-optimizer":
        return ZeroRedundancy(b)
    if s.zero_stage == 3:
        return DeepSpeedZero3(b)
    if s.zero_stage in (1, 2):
        return DeepSpeedZero12(b)
    return DeepSpeedReplica(b) if s.world_size > 1 else Engine(b)
