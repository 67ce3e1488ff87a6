"""The forward pass of the replay, and a checkpoint region's recompute of it, op by op.

Mixed into models/autograd.py's `MicroBatchReplay` (`ForwardPass`). `forward` loads the batch, takes the
references that outlive the forward (the caller's outputs, the checkpoint regions' inputs) and runs each op
(`_run_forward`) between the engine's hooks, then lets autocast's weight cache go. `_run_forward` is one op:
its outputs (or, in a recompute, the selective-checkpoint cache's outputs handed back, or a copy dropped at once
of one still alive), its saves, autocast's 16-bit weight copies, the host copies of an offloaded op's saves
(replay_offload.py), its workspace, and the forward-use references its last reads let go; a recompute
(replay_checkpoint.py) runs the same ops with their saves. The reasons each tensor is alive, and when each goes,
are models/autograd.py's (its module docstring); `drop_output` ends a forward-only pass.
"""

from __future__ import annotations

from ..simulator.events import Block, Category, Phase
from . import replay_template
from .config import dtype_bytes
from .tape import TapeOp


class ForwardPass:
    """The forward ops of one micro-batch, first pass or recompute (the replay's state: tape, builder, plan, live
    blocks and their reasons)."""

    def forward(self) -> None:
        replay_template.forward(self, self._forward)

    def _forward(self) -> None:
        b = self.b
        allocs = []
        for t in self.tape.inputs:
            blk = self._new_block(t, Category.INPUT)
            self.live[t.name] = blk
            allocs.append(blk)
            self._hold(t.name, 2 if t.name in self.last_use else 1)  # the caller's reference + forward use
        for name, (_, blk) in self.external.items():  # their owner's reference (never let go here) + forward use
            self.live[name] = blk
            self._hold(name, 2 if name in self.last_use else 1)
        if allocs or not self.external:
            b.op("batch.load", Phase.FORWARD, self.step, self.mb, allocs, [])
        for name in self.tape.held:
            self._hold(name)
        for r, names in self.region_inputs.items():
            for name in names:
                self._hold(name)
        before_op, after_op, run = self.b.engine.before_op, self.b.engine.after_op, self._run_forward
        for i, op in enumerate(self.tape.ops):
            before_op(self, i, Phase.FORWARD)
            run(i, op, recomputing=False, uses=self.last_use)
            after_op(self, i, Phase.FORWARD)
        frees: list[int] = []
        for name in self.autocast_cache:
            self._release(name, frees)
        if frees:  # casts nothing saved (checkpointed or offloaded ops) lived in the cache until here
            b.op("autocast.exit", Phase.FORWARD, self.step, self.mb, [], frees)

    def _run_forward(self, i: int, op: TapeOp, recomputing: bool, uses: dict[str, int],
                     skip_outputs: bool = False) -> None:
        allocs, frees = [], []
        saves = () if op.region is not None and not recomputing else self.saves[i]  # _effective_saves, inline
        kept = self.kept_in_recompute if recomputing else self.kept_in_forward
        duplicates = set()
        outputs = () if skip_outputs else op.outputs
        reused = recomputing and op.cached and op.region is not None
        offload = op.offloaded and bool(saves)
        for o in outputs:
            if reused:  # selective checkpointing hands back the first pass's output: a forward use, no memory
                self._hold(o.name)
                self.cache_pending[op.region].discard(o.name)
                self._release(o.name, frees)  # the cache's reason
                continue
            if recomputing and o.name in self.live:
                # still alive from the first pass (held by the caller): the recomputed copy is dropped at once
                dup = self._new_block(o, Category.TEMPORARY, name=f"{o.name}.recomputed")
                allocs.append(dup)
                frees.append(dup.id)
                duplicates.add(o.name)
                continue
            category = Category.ACTIVATION if (o.name in kept or o.name in self.tape.held) else Category.TEMPORARY
            blk = self._new_block(o, category)
            self.live[o.name] = blk
            allocs.append(blk)
            self._hold(o.name)  # forward use, released below at its last use
            if o.name in op.autocast_cached and not recomputing:  # a traced cast autocast's cache holds
                self._hold(o.name)
                self.autocast_cache.append(o.name)
            if o.name in self.cached and not recomputing:
                self._hold(o.name)  # the selective-checkpoint cache, until the recompute reuses it
                self.cache_pending.setdefault(op.region, set()).add(o.name)
        if not offload:
            for s in saves:
                self._hold(s)
        casts = []
        for p in op.casts:  # autocast's 16-bit parameter copies; the weight's is saved for backward when there is one
            held = bool(saves) and not offload and self._saves_param(op, p)
            # autocast caches its casts of trainable parameters until the forward pass ends (its context exits)
            cached_cast = not recomputing and p in self.trainable
            cast = self.b.block(f"{p}.autocast_copy", self.b.param_numel[p] * dtype_bytes(self.b.setup.compute_dtype),
                                Category.ACTIVATION if held else Category.TEMPORARY,
                                self.b.setup.compute_dtype, self.b.param_shape[p])
            allocs.append(cast)
            casts.append(cast)
            if held or cached_cast:
                self.live[cast.name] = cast
            if held:
                self._hold(cast.name)
                saves = saves + (cast.name,)
            if cached_cast:
                self._hold(cast.name)
                self.autocast_cache.append(cast.name)
            if not (held or cached_cast):
                frees.append(cast.id)
        packed: dict[str, Block] = {}
        if offload:
            packed = self._pack(op, saves, casts)
            allocs += packed.values()
            saves = tuple(packed)
        self.saved_at[i] = saves
        workspace = [self.b.block(w.name, w.nbytes, Category.TEMPORARY, w.dtype, w.shape)
                     for w in (() if skip_outputs else op.workspace)]
        allocs += workspace
        frees += [w.id for w in workspace]
        for name in dict.fromkeys(op.inputs + op.releases):  # one forward-use reason per tensor, however often read
            if uses.get(name) == i:
                self._release(name, frees)
        for o in outputs:
            if o.name not in uses and o.name not in duplicates:
                self._release(o.name, frees)
        bytes_moved = sum([a.nbytes for a in allocs]) + self.input_bytes[i]
        suffix = ".cached" if reused else ".recompute" if recomputing else ""
        self.b.op(op.name + suffix, Phase.BACKWARD if recomputing else Phase.FORWARD, self.step, self.mb, allocs,
                  frees, flops=0 if reused else op.flops, bytes_moved=0 if reused else bytes_moved,
                  recompute=recomputing, gemm=None if skip_outputs else "cublaslt" if self.lt[i] else "cublas")
        if packed:
            self._copy_op(f"{op.name}.offload", Phase.FORWARD, sum(b.nbytes for b in packed.values()))

    def drop_output(self) -> None:
        """A forward-only pass (`passes` "forward") ends: the caller drops `out`, and with it the autograd graph
        and everything it saved; the batch goes too."""
        frees = [blk.id for blk in self.live.values()]
        self.live.clear()
        self.reasons.clear()
        self.b.op("output.release", Phase.FORWARD, self.step, self.mb, [], frees)
