"""Offloading saved tensors (`TapeOp.offloaded`, policy "offload", `torch.autograd.graph.save_on_cpu`) in the replay.

Mixed into models/autograd.py's `MicroBatchReplay`: as an offloaded op saves a tensor, a host copy is made (the
pack hook, one per save), and before its backward node runs each copy is brought back to the device (the unpack
hook). On a CPU profile host and device are one memory: the copies stay in the one pool and nothing comes back.
See the module docstring of models/autograd.py for how these blocks live and go.
"""

from __future__ import annotations

from ..simulator.events import Block, Category, Phase, Pool
from .config import dtype_bytes
from .tape import TapeOp


class OffloadedSaves:
    """The pack and unpack hooks of `save_on_cpu` (the replay's state: tape, builder, live blocks, saves)."""

    def _host_pool(self) -> Pool:
        """Where offloaded tensors go: the host, or on a CPU device the one memory there is."""
        return Pool.DEVICE if self.b.device.is_cpu else Pool.HOST

    def _pack(self, op: TapeOp, saves: tuple[str, ...], casts: list[Block]) -> dict[str, Block]:
        """One host copy per tensor autograd saves for `op` (save_on_cpu's pack hook runs per save):
        the saved activations (a tensor read as k equal views is saved as k view-sized pieces), the
        autocast weight copies, and the parameters it saves. Each is held until the op's backward; the
        keys are the names the op's backward node releases."""
        pool = self._host_pool()
        out: dict[str, Block] = {}

        def pack(name: str, nbytes: int, dtype: str, shape) -> None:
            key = f"{op.name}.saved.{len(out)}"
            out[key] = self.live[key] = self.b.block(f"{name}.offloaded", nbytes, Category.ACTIVATION, dtype, shape,
                                                     pool=pool)
            self._hold(key)

        for name in saves:
            spec = self.specs[name]
            views = op.inputs.count(name)
            pack(name, spec.nbytes // views if views > 1 else spec.nbytes, spec.dtype, spec.shape)
        for p, cast in zip(op.casts, casts):
            if self._saves_param(op, p):
                pack(cast.name, cast.nbytes, cast.dtype, cast.shape)
        for p in op.saved_params:
            if p in op.casts or not self._saves_param(op, p):
                continue
            dtype = self.b.setup.param_dtype
            pack(p, self.b.param_numel[p] * dtype_bytes(dtype), dtype, self.b.param_shape[p])
        return out

    def _saves_param(self, op: TapeOp, p: str) -> bool:
        """Whether autograd saves parameter `p` (or autocast's copy of it) for `op`: a linear saves its
        weight only for its input's gradient (not for the batch), norms always save theirs."""
        if p not in op.saved_params:
            return False
        return op.kind != "linear" or any(self.rg.get(n) for n in op.inputs)

    def _unpack(self, i: int) -> list[Block]:
        """save_on_cpu's unpack hook, before op `i`'s backward node runs: on a GPU profile a device copy
        of each offloaded tensor (freed when the node is done); on a CPU profile nothing (the host
        tensor is handed back as it is)."""
        if self.b.device.is_cpu or not self.tape.ops[i].offloaded:
            return []
        blocks = [self.b.block(self.live[key].name.removesuffix(".offloaded") + ".reloaded", self.live[key].nbytes,
                               Category.ACTIVATION, self.live[key].dtype, self.live[key].shape)
                  for key in self.saved_at.get(i, ()) if key in self.live]
        if blocks:
            self._copy_op(f"{self.tape.ops[i].name}.reload", Phase.BACKWARD, sum(b.nbytes for b in blocks), blocks)
        return blocks

    def _copy_op(self, name: str, phase: Phase, nbytes: int, allocs=()) -> None:
        """A device<->host copy over the host link, on the compute stream (save_on_cpu copies in line)."""
        duration = nbytes / self.b.device.host_link + self.b.device.launch_latency
        self.b.op(name, phase, self.step, self.mb, list(allocs), [], bytes_moved=nbytes, duration=duration)
