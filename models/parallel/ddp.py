"""torch DDP (gradient buckets all-reduced as backward ends) and ZeroRedundancyOptimizer (DDP plus optimizer
states of whole parameters assigned to ranks greedily)."""

from __future__ import annotations

from ...simulator.events import Category, Phase, Stream
from ..config import dtype_bytes
from .layout import DDP_FIRST_BUCKET_BYTES, OptimTensor, greedy_partition
from .engine import Engine


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
