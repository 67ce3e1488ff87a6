"""torch DDP (gradient buckets all-reduced as backward ends) and ZeroRedundancyOptimizer (DDP plus optimizer
states of whole parameters assigned to ranks greedily)."""

from __future__ import annotations

from functools import cached_property

from ...simulator.events import Category, Phase, Stream
from ..config import dtype_bytes
from .engine import Engine
from .layout import DDP_FIRST_BUCKET_BYTES, OptimTensor, greedy_owners


class DDP(Engine):
    """torch DDP: full replicas; gradient buckets (`ddp_bucket_cap_mb`, the first one 1 MiB) built at
    construction in reverse parameter order, all-reduced when backward ends."""

    pure_replay_hooks = Engine.pure_replay_hooks  # its work is at load and when backward ends

    def bucket_numels(self) -> list[int]:
        cap = self.setup.data_parallel.ddp.bucket_cap_mb * 1024 * 1024
        size = dtype_bytes(self.grad_dtype)
        buckets, current, limit = [], 0, DDP_FIRST_BUCKET_BYTES
        ignored = set(getattr(self.builder.tape, "local_params", ()))  # expert parallelism's experts: each rank's own
        for p in reversed(self.trainable):
            if p.name in ignored:  # `_set_params_and_buffers_to_ignore_for_model` (torch/nn/parallel/distributed.py)
                continue
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
        self.buckets = [self.builder.block(f"ddp.bucket.{k}", n * dtype_bytes(self.grad_dtype),
                                     Category.REDUCE_SCATTER_BUCKET, self.grad_dtype, (n,))
                        for k, n in enumerate(self.bucket_numels())]
        self.builder.op("ddp.init_buckets", Phase.LOAD, 0, -1, self.buckets, [])

    def end_backward(self, step: int, mb: int) -> None:
        if self.n == 1:
            return
        for k, blk in enumerate(self.buckets):
            self.collective(f"ddp.all_reduce.bucket{k}", "all_reduce", blk.nbytes, Phase.BACKWARD, step, mb)
        self.builder.op(
            "ddp.copy_back", Phase.BACKWARD, step, mb, [], [], after=(self.builder.last(Stream.COMMUNICATION),)
        )


class ZeroRedundancy(DDP):
    """DDP + torch.distributed.optim.ZeroRedundancyOptimizer: states for this rank's own parameters only."""

    pure_replay_hooks = Engine.pure_replay_hooks

    shards_optimizer = True
    symmetric = False  # whole parameters per rank: uneven by nature

    @cached_property
    def owners(self) -> list[list[str]]:
        """`greedy_owners`: the parameters of ranks 0..k-1; the ranks from k on own none."""
        return greedy_owners([(p.name, p.numel) for p in self.trainable], self.n)

    def owned(self) -> list[str]:
        return self.owners[self.rank] if self.rank < len(self.owners) else []

    def optim_tensors(self) -> list[OptimTensor]:
        """The rank's parameters in its local optimizer's order, the partition's (largest first: `greedy_owners`)."""
        params = {p.name: p for p in self.trainable}
        return [OptimTensor(name, params[name].numel, params[name].shape) for name in self.owned()]

    def rank_segments(self) -> list[tuple[int, tuple]]:
        """One range per rank that owns parameters (ranks 0..k-1, k <= parameters), and one for the ranks that
        own none (k..N-1, when N > k): O(P log P) from the greedy, not O(world)."""
        stored = tuple(self.param_numel(p.name) for p in self.builder.tape.params)
        order = {p.name: i for i, p in enumerate(self.trainable)}
        out = []
        for r, names in enumerate(self.owners):
            mine = sorted(order[name] for name in names)
            out.append((r, (stored, tuple((self.trainable[i].name, self.trainable[i].numel) for i in mine))))
        if len(self.owners) < self.n:
            out.append((len(self.owners), (stored, ())))
        return out

    def after_step(self, step: int) -> None:
        owners = self.owners
        for r in range(self.n):
            names = owners[r] if r < len(owners) else []
            nbytes = sum(self.params[n].numel for n in names) * dtype_bytes(self.setup.precision.param)
            self.collective(f"zero.broadcast.rank{r}", "broadcast", nbytes, Phase.OPTIMIZER, step, -1)
