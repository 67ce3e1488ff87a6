"""Optimizer and gradient offload as the libraries do it: torchao's CPUOffloadOptimizer (`optimizer_offload cpu`,
`offload_gradients`), on one rank.

torchao 0.18.0 torchao/optim/cpu_offload.py `CPUOffloadOptimizer(params, optimizer_class=AdamW, *,
offload_gradients=False, minimal_size=4096)`, rule by rule:
- `__init__`: AdamW gets `fused=True` unless given; a parameter with `numel() < minimal_size` stays with an
  on-device optimizer `d_opt` over all of them (its states on the device, made lazily as torch.optim's are);
  every other one gets `p_host = torch.empty_like(p_device, device="cpu", pin_memory=True)` and
  `p_host.grad = torch.empty_like(p_host, pin_memory=True)` (two pinned host buffers in the parameter's own dtype,
  kept for the run), `p_host.copy_(p_device, non_blocking=True)`, a post-accumulate-grad hook, and an optimizer
  of its own over `p_host` alone: its states are made lazily on the host by the first `step()` (torch.optim's
  `_init_group`, `zeros_like(p_host)`: pageable, not pinned; fused Adam's `step` is a host scalar too);
- the hook (backward): once the parameter's `.grad` is accumulated, `p_host.grad.copy_(p_device.grad,
  non_blocking=True)` on the offload's own stream (after the compute stream); with `offload_gradients` the device
  gradient is then `record_stream`ed and dropped (`p_device.grad = None`): freed as the program sees it at once,
  its memory reused by the caching allocator only once the copy is done;
- `step()`: `d_opt.step()` on the device, then for each parameter in the order its hook ran: wait for its
  gradient's copy, the host optimizer's step (the CPU's), and `p_device.copy_(p_host, non_blocking=True)` on the
  offload stream (in place: nothing allocated); then `stream.synchronize()`;
- `zero_grad()`: device gradients only (`set_to_none`); the host gradient buffers are overwritten by each copy.

What the describer assumes (said here, and in bench/VALIDATION.md): the host step's time is the cost model's CPU
profile (models/devices.py "cpu": memory bandwidth over the bytes a fused Adam step reads and writes), the
copies' the host link's.
The host buffers are Pool.HOST blocks: `<param>.cpu_offload.p_host` and `.p_host.grad` pinned (`PINNED_SUFFIXES`),
the host optimizer's states (`<param>.<state>.host`) pageable.
"""

from __future__ import annotations

from math import prod

from ..simulator.events import Block, Category, OptimizerState, Phase, Pool, Stream
from .config import dtype_bytes
from .devices import device_profile
from .optimizers import state_specs
from .parallel import own_dtype

TORCHAO_VERSION = "0.18.0"
MINIMAL_SIZE = 4096  # torchao CPUOffloadOptimizer's `minimal_size` default
PINNED_SUFFIXES = (".cpu_offload.p_host", ".cpu_offload.p_host.grad")
HOOK = ".cpu_offload.grad_to_host"  # the hook's op, `<param>` before it
ADAM_BYTES_PER_ELEMENT = 7  # fused Adam reads param, grad, exp_avg, exp_avg_sq and writes param, exp_avg, exp_avg_sq


def is_pinned(block: Block) -> bool:
    """Whether the library asks for a host block to be pinned, on any profile: torchao's `p_host` / `p_host.grad`,
    and FSDP2's CPUOffloadPolicy sharded parameters and gradients (models/parallel/fsdp.py; a pageable gradient copy
    summed into one when accumulating is `<param>.grad.to_host`). Optimizer states a host step makes are pageable.
    On a GPU profile these blocks carry `Block.pinned` (what the host memory report counts); on the cpu profile
    nothing is page-locked (torch pins only where CUDA is available), and this names what the library would pin."""
    if block.pool is not Pool.HOST:
        return False
    return block.name.endswith(PINNED_SUFFIXES) or (
        block.category in (Category.PARAMETER, Category.GRADIENT) and not block.name.endswith(".to_host"))


class TorchaoCpuOffload:
    """One rank's CPUOffloadOptimizer: which parameters it offloads, their host buffers and host states."""

    def __init__(self, builder, tensors) -> None:
        self.builder = builder
        self.offloaded = [t for t in tensors if t.numel >= MINIMAL_SIZE]
        self.names = {t.name for t in self.offloaded}
        self.on_device = [t for t in tensors if t.numel < MINIMAL_SIZE]  # d_opt's parameters
        self._seen = len(builder.graph)  # ops before this step's backward
        self.host: dict[str, Block] = {}

    def _dtype(self, name: str) -> str:
        return own_dtype(self.builder.tape, name) or self.builder.engine.param_storage_dtype()

    def load(self) -> None:
        """The constructor: two pinned host buffers per offloaded parameter, and the parameters copied into them."""
        builder = self.builder
        blocks = []
        for t in self.offloaded:
            dt = self._dtype(t.name)
            nbytes = t.numel * dtype_bytes(dt)
            for suffix, category in zip(PINNED_SUFFIXES, (Category.MASTER_PARAMETER, Category.GRADIENT)):
                blk = builder.block(f"{t.name}{suffix}", nbytes, category, dt, t.shape, pool=Pool.HOST,
                                    pinned=not builder.device.is_cpu)
                self.host[blk.name] = blk
                blocks.append(blk)
        if blocks:
            moved = sum(b.nbytes for b in blocks) // 2
            builder.op("optimizer.cpu_offload.__init__", Phase.LOAD, 0, -1, blocks, [],
                       duration=moved / builder.device.host_link)

    def grad_hook(self, replay, p: str) -> None:
        """The post-accumulate-grad hook of parameter `p`, issued right after the op that finished its `.grad`
        (queued in the replay's `after_node`): the copy to the host (`HOOK` ops; the copy itself is put on the
        offload stream by `step`, after it); with offload_gradients the device gradient dropped."""
        blk = replay.grads.blocks.get(p) if p in self.names else None
        if blk is None:
            return
        frees = []
        if self.builder.setup.offload.gradients:
            replay.grads.blocks.pop(p)
            frees.append(blk.id)
        replay.after_node.append((f"{p}{HOOK}", [], frees))

    def _hooks(self, step: int) -> list[tuple[str, int]]:
        """(parameter, hook op id) of every hook this step ran, in order (a parameter's hook runs once per
        micro-batch under gradient accumulation, each time copying its gradient)."""
        ops = self.builder.graph.ops_in_order()[self._seen:]
        return [(op.name[: -len(HOOK)], op.id) for op in ops
                if op.rank == self.builder.rank and op.step == step and op.name.endswith(HOOK)]

    def step(self, step: int, create: bool, create_states, update) -> None:
        """`step()`: the gradients' copies to the host (on the offload stream, each after its hook), the on-device
        optimizer's step over the small parameters, then per offloaded parameter in the queue's order: the host
        step once its gradient is in (its states made on the host at the first step) and the updated parameter
        copied back; every copy done before the step returns."""
        builder = self.builder
        by_name = {t.name: t for t in self.offloaded}
        arrived: dict[str, int] = {}  # the library's queue: a parameter whose hook ran again moves to the end
        for name, hook_id in self._hooks(step):
            nbytes = by_name[name].numel * dtype_bytes(self._dtype(name))
            arrived.pop(name, None)
            arrived[name] = self._copy(hook_id, f"{name}.cpu_offload.grad_to_host.copy", nbytes, Phase.BACKWARD,
                                       step)
        if self.on_device:
            if create:
                create_states(builder, step, self.on_device, "optimizer.cpu_offload.d_opt.init_state")
            update(builder, step, self.on_device, "optimizer.cpu_offload.d_opt")
        cpu = device_profile("cpu")
        last = None
        for name in arrived:
            t, dt = by_name[name], self._dtype(name)
            new = []
            if create:
                for state, shape, sdt in state_specs(builder.setup.optimizer.name, t.numel, dt, t.shape):
                    if state is OptimizerState.STEP:  # fused: `_get_scalar_dtype(is_fused=True)`, on p_host's device
                        sdt = "fp32"
                    blk = builder.block(f"{name}.{state.value}.host", prod(shape) * dtype_bytes(sdt),
                                        Category.OPTIMIZER_STATE, sdt, shape, state=state, pool=Pool.HOST)
                    self.host[blk.name] = blk
                    new.append(blk)
            nbytes = t.numel * dtype_bytes(dt)
            op = builder.op(f"optimizer.cpu_offload.{name}.host_step", Phase.OPTIMIZER, step, -1, new, [],
                            duration=ADAM_BYTES_PER_ELEMENT * nbytes / cpu.bandwidth, after=(arrived[name],))
            last = self._copy(op.id, f"optimizer.cpu_offload.{name}.param_to_device", nbytes, Phase.OPTIMIZER, step)
        builder.op("optimizer.cpu_offload.synchronize", Phase.OPTIMIZER, step, -1, [], [], duration=0.0,
                   after=(last,) if last is not None else ())
        self._seen = len(builder.graph)

    def _copy(self, issue_id: int, name: str, nbytes: int, phase: Phase, step: int) -> int:
        """A copy between host and device on the offload stream, after the op that issued it."""
        builder = self.builder
        return builder.op(name, phase, step, -1, [], [], stream=Stream.HOST,
                          duration=nbytes / builder.device.host_link, after=(issue_id,)).id


__all__ = ["TorchaoCpuOffload", "MINIMAL_SIZE", "PINNED_SUFFIXES", "TORCHAO_VERSION", "is_pinned"]
