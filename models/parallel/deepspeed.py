"""DeepSpeed ZeRO 0-3: replicas with flat reduce buckets (0), flat partitions of masters and states with the
ipg bucket (1, 2), and partitioned parameters gathered per module with prefetch (3)."""

from __future__ import annotations

from ...simulator.events import Block, Category, Phase, Pool, Stream
from ..config import dtype_bytes
from ..devices import device_profile
from .engine import Engine
from .gathering import Gathering
from .layout import OptimTensor, ceil_div, flat_partition, sub_groups


def deepspeed_engine(builder) -> Engine:
    """DeepSpeed's engine for the builder's setup: ZeRO-3, ZeRO-1/2, plain replicas, or one device."""
    s = builder.setup
    if s.data_parallel.deepspeed.zero_stage == 3:
        return DeepSpeedZero3(builder)
    if s.data_parallel.deepspeed.zero_stage in (1, 2):
        return DeepSpeedZero12(builder)
    return DeepSpeedReplica(builder) if s.mesh.dp > 1 else Engine(builder)


class DeepSpeedReplica(Engine):
    """DeepSpeed without ZeRO on N ranks: gradients all-reduced through transient flat buckets."""

    pure_replay_hooks = Engine.pure_replay_hooks  # its work is when backward ends

    def end_backward(self, step: int, mb: int) -> None:
        if self.n == 1 or mb != self.setup.batch.grad_accum - 1:
            return
        total = sum(p.numel for p in self.trainable)
        size = dtype_bytes(self.grad_dtype)
        k = 0
        while total > 0:
            n = min(total, self.setup.data_parallel.deepspeed.reduce_bucket_size)
            bucket = self.builder.block(f"deepspeed.allreduce_bucket.{k}", n * size, Category.REDUCE_SCATTER_BUCKET,
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
        return e.builder.block("deepspeed.grad_partition", self.partition_numel * dtype_bytes(e.grad_dtype),
                         Category.GRADIENT, e.grad_dtype, (self.partition_numel,), shard=e.n)

    def add(self, p: str, step: int, mb: int, allocs: list, frees: list) -> None:
        e = self.engine
        spec = e.params[p]
        size = dtype_bytes(e.grad_dtype)
        tmp = e.builder.block(f"{p}.grad", spec.numel * size, Category.TEMPORARY, e.grad_dtype, spec.shape)
        allocs.append(tmp)
        frees.append(tmp.id)
        if self.bucket is None:
            n = e.setup.data_parallel.deepspeed.reduce_bucket_size
            self.bucket = e.builder.block(
                "deepspeed.ipg_bucket", n * size, Category.REDUCE_SCATTER_BUCKET, e.grad_dtype, (n,)
            )
            allocs.append(self.bucket)
        if self.filled and self.filled + spec.numel > e.setup.data_parallel.deepspeed.reduce_bucket_size:
            self.flush(step, mb)
        self.filled += spec.numel

    def flush(self, step: int, mb: int) -> None:
        if not self.filled:
            return
        e = self.engine
        allocs = []
        offload = getattr(e, "zero_offload", False)  # ZeRO-Offload: the partition's gradients go to the host
        if self.partition is None and self.lazy and not offload:
            self.partition = self.partition_block()
            allocs.append(self.partition)
        op = e.collective(f"deepspeed.reduce_scatter.bucket{self.reduced}", "reduce_scatter",
                          self.filled * dtype_bytes(e.grad_dtype), Phase.BACKWARD, step, mb, allocs=allocs,
                          after=(e.builder.last(Stream.COMPUTE),))
        if offload:
            e.grads_to_host(self.reduced, self.filled, op.id, step, mb)
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
        ds = self.setup.data_parallel.deepspeed
        self.zero_offload = ds.offload_optimizer == "cpu" and ds.zero_stage == 2 and self.n > 1
        self.host_step_scalar = not self.zero_offload  # DeepSpeedCPUAdam counts steps in a Python int

    # ZeRO-Offload (DeepSpeed 0.19.8 runtime/zero/stage_1_and_2.py, `cpu_offload`, pin_memory true) -----------------
    def state_pool(self) -> Pool:
        return Pool.HOST if self.zero_offload else Pool.DEVICE

    def after_load(self) -> None:
        """`__init__` under cpu_offload: the fp32 partition cloned to the host and pinned
        (`single_partition_of_fp32_groups`), a pinned bit16 buffer of the partition's size
        (`param_buffer_of_bit16_for_cpu_offload_groups`), `temp_grad_buffer_for_cpu_offload` (pinned) and
        `temp_grad_buffer_for_gpu_offload` (on the device), each of the largest parameter's size in the training
        dtype; `initialize_optimizer_states`: the fp32 partition's `.grad`, zeros, pinned."""
        if not self.zero_offload:
            return
        builder, dt = self.builder, self.setup.precision.param
        largest = max(p.numel for p in self.trainable)
        host = [builder.block("flat_group0.partition.fp32", self.partition * 4, Category.MASTER_PARAMETER, "fp32",
                              (self.partition,), shard=self.n, pool=Pool.HOST),
                builder.block("flat_group0.partition.bit16_buffer", self.partition * dtype_bytes(dt),
                              Category.TEMPORARY, dt, (self.partition,), shard=self.n, pool=Pool.HOST),
                builder.block("deepspeed.temp_grad_buffer_for_cpu_offload", largest * dtype_bytes(dt),
                              Category.TEMPORARY, dt, (largest,), pool=Pool.HOST),
                builder.block("deepspeed.temp_grad_buffer_for_gpu_offload", largest * dtype_bytes(dt),
                              Category.TEMPORARY, dt, (largest,)),
                builder.block("flat_group0.partition.fp32.grad", self.partition * 4, Category.GRADIENT, "fp32",
                              (self.partition,), shard=self.n, pool=Pool.HOST)]
        builder.op("deepspeed.cpu_offload.__init__", Phase.LOAD, 0, -1, host, [],
                   duration=self.partition * 4 / builder.device.host_link)

    def grads_to_host(self, k: int, filled: int, reduce: int, step: int, mb: int) -> None:
        """After a bucket's reduce: each of this rank's gradients in it (about 1/N of the bucket) cast to fp32 on
        the device where it is 16-bit (`src_tensor.to(master_weights_and_grads_dtype)`, dropped once copied) and
        copied into the pinned fp32 gradient partition (`async_inplace_copy_grad_to_fp32_buffer_from_gpu`)."""
        builder = self.builder
        mine = ceil_div(filled, self.n)
        allocs = []
        if self.grad_dtype != "fp32":
            allocs = [builder.block(f"deepspeed.grad_to_fp32.bucket{k}", mine * 4, Category.TEMPORARY, "fp32",
                                    (mine,))]
        issue = builder.op(f"deepspeed.grads_to_host.bucket{k}", Phase.BACKWARD, step, mb, allocs,
                           [x.id for x in allocs], bytes_moved=sum(x.nbytes for x in allocs), after=(reduce,))
        builder.op(f"deepspeed.grads_to_host.bucket{k}.copy", Phase.BACKWARD, step, mb, [], [], stream=Stream.HOST,
                   duration=mine * 4 / builder.device.host_link, after=(issue.id,))

    def optim_tensors(self) -> list[OptimTensor]:
        return [OptimTensor("flat_group0.partition", self.partition, (self.partition,))]

    def master_dtype(self) -> str | None:
        # DeepSpeed keeps an fp32 copy of the rank's partition even in fp32 training (on the host under offload)
        return None if self.zero_offload else "fp32"

    def state_shard(self) -> int:
        return self.n

    def extra_param_blocks(self) -> list[Block]:
        pad = self.padded - self.total
        if not pad:
            return []
        dt = self.setup.precision.param
        return [self.builder.block("flat_group0.padding", pad * dtype_bytes(dt), Category.PARAMETER, dt, (pad,))]

    def pure_replay_hooks(self, replay) -> bool:
        return (
            self.setup.data_parallel.deepspeed.zero_stage == 1
        )  # ZeRO-2's gradients go through the ipg bucket, the engine's state

    def param_grad(self, replay, p: str, allocs: list, frees: list) -> None:
        if self.setup.data_parallel.deepspeed.zero_stage == 1:
            return super().param_grad(replay, p, allocs, frees)
        self.ipg.add(p, replay.step, replay.mb, allocs, frees)

    def end_backward(self, step: int, mb: int) -> None:
        if self.setup.data_parallel.deepspeed.zero_stage == 2:
            self.ipg.flush(step, mb)

    def before_step(self, step: int, grads) -> list[Block]:
        builder = self.builder
        if self.zero_offload:  # the fp32 gradients are on the host already; DeepSpeedCPUAdam steps there
            builder.op("deepspeed.cpu_adam.step", Phase.OPTIMIZER, step, -1, [], [],
                       duration=7 * self.partition * 4 / device_profile("cpu").bandwidth,
                       after=(builder.last(Stream.HOST),) if builder.last(Stream.HOST) is not None else ())
            return []
        if (
            self.setup.data_parallel.deepspeed.zero_stage == 1
        ):  # full gradients reduced now, through one bucket at a time
            size = dtype_bytes(self.grad_dtype)
            left, k = self.total, 0
            while left > 0:
                n = min(left, self.setup.data_parallel.deepspeed.reduce_bucket_size)
                bucket = builder.block(f"deepspeed.reduce_bucket.{k}", n * size, Category.REDUCE_SCATTER_BUCKET,
                                 self.grad_dtype, (n,))
                self.collective(f"deepspeed.reduce.bucket{k}", "reduce_scatter", n * size, Phase.OPTIMIZER, step, -1,
                                allocs=[bucket], frees=[bucket.id])
                left -= n
                k += 1
        fp32 = builder.block("flat_group0.partition.grad_fp32", self.partition * 4, Category.TEMPORARY, "fp32",
                       (self.partition,), shard=self.n)
        frees = self.zero_grad_frees(grads) if self.setup.data_parallel.deepspeed.zero_stage == 1 else []
        builder.op("optimizer.grads_to_fp32", Phase.OPTIMIZER, step, -1, [fp32], frees, bytes_moved=3 * fp32.nbytes,
             after=(builder.last(Stream.COMMUNICATION),) if builder.last(Stream.COMMUNICATION) is not None else ())
        return [fp32]

    def after_step(self, step: int) -> None:
        size = dtype_bytes(self.setup.precision.param)
        if self.zero_offload:  # fp32 partition -> the pinned bit16 buffer (host), then to the device partition
            copy = self.builder.op("deepspeed.cpu_offload.params_to_device", Phase.OPTIMIZER, step, -1, [], [],
                                   stream=Stream.HOST, duration=self.partition * size / self.builder.device.host_link,
                                   after=(self.builder.last(Stream.COMPUTE),))
            self.builder.op("deepspeed.cpu_offload.params_to_device.wait", Phase.OPTIMIZER, step, -1, [], [],
                            duration=0.0, after=(copy.id,))
        left, k = self.padded, 0
        while left > 0:
            n = min(left, self.setup.data_parallel.deepspeed.allgather_bucket_size)
            self.collective(f"deepspeed.all_gather.params{k}", "all_gather", n * size, Phase.OPTIMIZER, step, -1,
                            after=(self.builder.last(Stream.COMPUTE),))
            left -= n
            k += 1

    def zero_grad_frees(self, grads) -> list[int]:
        if self.setup.data_parallel.deepspeed.zero_stage == 2:
            return []
        return super().zero_grad_frees(grads)


class DeepSpeedZero3(Gathering):
    """DeepSpeed ZeRO stage 3: per-parameter partitions, per-module fetch and release, prefetch by trace."""

    prefix = "zero3"

    def __init__(self, builder) -> None:
        super().__init__(builder)
        threshold = self.setup.data_parallel.deepspeed.stage3_param_persistence_threshold
        self.persistent = {p.name for p in builder.tape.params if p.numel <= threshold}
        self.op_groups = [
            tuple(dict.fromkeys(p for p in op.params if p not in self.persistent)) for op in builder.tape.ops
        ]
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
        self.builder.op("zero3.init_grad_partition", Phase.LOAD, 0, -1, [self.ipg.partition], [])

    def group_params(self, group: str) -> list:
        return [self.params[p] for p in self.op_groups[int(group)]]

    def copy_out(self, group: str, gather_op: int, phase: Phase, step: int, mb: int) -> None:
        # the gathered flat buffer is the parameters' storage: nothing is copied, it waits for the gather
        self.builder.op(f"zero3.wait.{group}", phase, step, mb, [], [], after=(gather_op,))
        self.live[group] = [self.buffers.pop(group)]

    def _prefetch(self, order: list[int], step: int, phase: Phase, mb: int) -> None:
        """Fetch the next groups of the recorded trace, up to the prefetch bucket and the live limit."""
        if step < 2:
            return  # the first step records the trace; DeepSpeed prefetches from the second on
        budget = self.setup.data_parallel.deepspeed.stage3_prefetch_bucket_size
        live = sum(self.padded_full(p.name) for g in list(self.live) + list(self.in_flight)
                   for p in self.group_params(g))
        for j in order:
            if budget <= 0:
                return
            group = str(j)
            if not self.op_groups[j] or group in self.live or group in self.in_flight:
                continue
            numel = sum(self.padded_full(p.name) for p in self.group_params(group))
            if live + numel > self.setup.data_parallel.deepspeed.stage3_max_live_parameters:
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
        builder = self.builder
        fp32 = [builder.block(f"{t.name}.grad_fp32", t.numel * 4, Category.TEMPORARY, "fp32", t.shape, shard=self.n)
                for t in self.optim_tensors()]
        builder.op("optimizer.grads_to_fp32", Phase.OPTIMIZER, step, -1, fp32, [],
             bytes_moved=3 * sum(x.nbytes for x in fp32), after=(builder.last(Stream.COMMUNICATION),))
        return fp32
