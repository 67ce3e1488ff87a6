"""Optimizer-state offload, described: where each state tensor is, step by step, on one rank.

The semantics (which wrapper does what, and why the first step is special) are in models/optimizers.py.
Here an `OffloadedStates` keeps the rank's two sets of blocks as the describer adds ops:

- host buffers, one per offloaded state tensor (`<tensor>.<state>.host`), allocated by the first
  offload and kept for the rest of the run: the state's home between steps (pinned on a GPU profile: Megatron's
  and DeepSpeed's offload buffers are page-locked, models/optimizers.py; pageable on "cpu", where nothing can be
  pinned without CUDA). They are Pool.HOST on
  every profile, the "cpu" one included (the tracker counts the reference offload's host buffers as
  host memory too), so a CPU run's device pool holds what a GPU's would;
- device copies (`<tensor>.<state>`, the blocks torch's lazy init creates in step 1, later the
  copies brought in for an update), live only while their chunk is being updated.

`load` copies a chunk in: its device copies are allocated when the host issues the copies (program
order, as the caching allocator sees them) and the transfer runs on the rank's host stream, so a
prefetched chunk's copy overlaps the update of the one before; the update waits for its own chunk.
`offload` copies a chunk back tensor by tensor, blocking (pinned memory), each device copy freed
once copied: at most one tensor more than the chunk at any moment.
"""

from __future__ import annotations

from math import prod

from ..simulator.events import Block, Category, Phase, Pool, Stream
from .config import dtype_bytes
from .optimizers import offload_chunks, offloaded, state_specs


class OffloadedStates:
    """One rank's offloaded optimizer states: the chunks, their host buffers and live device copies."""

    def __init__(self, builder, tensors) -> None:
        s = builder.setup
        self.builder = builder
        indices = offload_chunks([t.numel for t in tensors], s.offload.mode, s.offload.chunk_params)
        self.chunks = [[tensors[i] for i in chunk] for chunk in indices]
        self.prefetch = s.offload.prefetch if s.offload.mode == "chunked" else 0
        self.host: dict[str, Block] = {}
        self.device: dict[str, Block] = {}

    def adopt(self, blocks: list[Block]) -> None:
        """State blocks a torch step just created on the device (its lazy init)."""
        self.device.update({blk.name: blk for blk in blocks if blk.state is not None and offloaded(blk.state)})

    def _specs(self, t):
        s = self.builder.setup
        for state, shape, dtype in state_specs(s.optimizer.name, t.numel, s.precision.state, t.shape):
            if offloaded(state):
                yield f"{t.name}.{state.value}", state, shape, dtype

    def load(self, k: int, step: int) -> int:
        """Copy chunk `k`'s states to the device; the id of the transfer its update must wait for."""
        builder, shard = self.builder, self.builder.engine.state_shard()
        copies = [
            builder.block(
                name, prod(shape) * dtype_bytes(dtype), Category.OPTIMIZER_STATE, dtype, shape, state=state, shard=shard
            )
            for t in self.chunks[k]
            for name, state, shape, dtype in self._specs(t)
        ]
        self.device.update({blk.name: blk for blk in copies})
        issue = builder.op(f"optimizer.offload.chunk{k}.to_device", Phase.OPTIMIZER, step, -1, copies, [], duration=0.0)
        nbytes = sum(x.nbytes for x in copies)
        return builder.op(f"optimizer.offload.chunk{k}.to_device.copy", Phase.OPTIMIZER, step, -1, [], [],
                    stream=Stream.HOST, duration=nbytes / builder.device.host_link, after=(issue.id,)).id

    def offload(self, k: int, step: int) -> None:
        """Copy chunk `k`'s states back to their host buffers (allocated now the first time), freeing each
        device copy once it is copied."""
        builder = self.builder
        for t in self.chunks[k]:
            for name, _state, _shape, _dtype in self._specs(t):
                blk = self.device.pop(name)
                new = [] if name in self.host else [self._host_buffer(blk)]
                builder.op(f"optimizer.offload.{name}.to_host", Phase.OPTIMIZER, step, -1, new, [blk.id],
                     duration=blk.nbytes / builder.device.host_link)

    def _host_buffer(self, device_copy: Block) -> Block:
        d = device_copy
        blk = self.builder.block(f"{d.name}.host", d.nbytes, Category.OPTIMIZER_STATE, d.dtype, d.shape, state=d.state,
                           shard=d.shard_factor, pool=Pool.HOST, pinned=not self.builder.device.is_cpu)
        self.host[d.name] = blk
        return blk


__all__ = ["OffloadedStates"]
