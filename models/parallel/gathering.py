"""`Gathering`: what FSDP2 and ZeRO-3 share: a unit's parameters all-gathered before it runs and freed after."""

from __future__ import annotations

from ...simulator.events import Block, Category, Phase, Stream
from ..config import dtype_bytes
from .engine import Engine


class Gathering(Engine):
    """Engines that keep parameters sharded and rebuild them for compute (FSDP2, ZeRO-3), by groups: an
    FSDP2 unit, or the parameters of one module call in ZeRO-3. A group is gathered (`gather`: the
    all-gather output allocated when issued, possibly ahead as a prefetch), waited for and made whole
    (`wait` -> the subclass's `copy_out`), and released after its compute (`release`)."""

    shards_optimizer = True

    def __init__(self, b) -> None:
        super().__init__(b)
        self.gather_dtype = self.setup.precision.param
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
        builder = self.builder
        size = dtype_bytes(self.gather_dtype)
        numel = sum(self.padded_full(p.name) for p in self.group_params(group))
        buf = builder.block(f"{group}.all_gather_output", numel * size, Category.ALL_GATHER_BUFFER, self.gather_dtype,
                      (numel,))
        last = builder.last(Stream.COMPUTE)
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
            self.builder.op(f"{self.prefix}.reshard.{group}", phase, step, mb, [], [x.id for x in blocks])
