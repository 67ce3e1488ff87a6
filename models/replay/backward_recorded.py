"""The backward of a traced tape: the nodes the real autograd engine ran (`Tape.backward`), replayed in order.

A hand-written tape's backward is derived op by op (replay_backward.py `DerivedBackward._run_backward`). A traced
tape (models/trace) carries what the engine really did, node by node: each `GradNode`'s steps allocate the
tensors it made and free those it dropped, in that order. Everything that is not the model's own goes
through the same replay as before: a checkpoint region is recomputed right before its first node runs (and
lets its inputs go after its last), saved tensors are released where the node released them, a
parameter's gradient is made by the parallel engine (`.grad`, accumulation into it, sharding), and the
engines' hooks run around each node of a forward op.
"""

from __future__ import annotations

from ..simulator.events import Block, Category, Phase


class RecordedBackward:
    """Mixed into autograd.py's `MicroBatchReplay` (its state: tape, builder, saved tensors, regions)."""

    def _recorded_backward(self) -> None:
        """Follow a recorded backward (`Tape.backward`, traced tapes): each node's steps in the order the real
        engine ran them; a checkpoint region is recomputed right before its first node, and its inputs let go
        after its last; parameter gradients go through the engine (`.grad`, accumulation, sharding)."""
        ops, engine = self.tape.ops, self.b.engine
        born: dict[str, Block] = {}
        region_last: dict[int, int] = {}
        for k, node in enumerate(self.tape.backward):
            if node.op is not None and ops[node.op].region is not None:
                region_last[ops[node.op].region] = k
        region_done: set[int] = set()
        for k, node in enumerate(self.tape.backward):
            i = node.op
            region = ops[i].region if i is not None else None
            if region is not None and region not in region_done:
                region_done.add(region)
                self._recompute(region)
            if i is not None:
                engine.before_op(self, i, Phase.BACKWARD)
            unpacked = [blk.id for blk in self._unpack(i)] if i is not None else []
            for s, step in enumerate(node.steps):
                allocs, frees = [], []
                for t in step.allocs:
                    born[t.name] = self._new_block(t, Category.TEMPORARY)
                    allocs.append(born[t.name])
                for p in step.grads:
                    self._param_grad(p, allocs, frees)
                frees += [born.pop(n).id for n in step.frees]
                if step.release_saved and i is not None:
                    frees += unpacked
                    saved = self.saved_at.get(i, ())
                    for name in saved:
                        self._release(name, frees)
                suffix = f".{s}" if len(node.steps) > 1 else ""
                self.b.op(f"{node.name}{suffix}", Phase.BACKWARD, self.step, self.mb, allocs, frees,
                          flops=node.flops if s == 0 else 0, bytes_moved=2 * sum(a.nbytes for a in allocs))
            if i is not None:
                engine.after_op(self, i, Phase.BACKWARD)
            if region is not None and region_last[region] == k:
                self._end_region(region)
        self._end_batch([blk.id for blk in born.values()])

    def backward_order(self) -> list[int]:
        """The forward ops whose backward nodes run, in the order they run (engines plan with it)."""
        if self.tape.backward:
            return list(dict.fromkeys(n.op for n in self.tape.backward if n.op is not None))
        return [i for i in range(len(self.tape.ops) - 1, -1, -1) if self.needs_backward[i]]
