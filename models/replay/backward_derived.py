"""The backward pass of a hand-written tape, derived op by op the way torch's autograd formulas run.

Mixed into models/autograd.py's `MicroBatchReplay` (`DerivedBackward`). `backward` plays the pass from the
plan's recording where it can (replay_template.py); otherwise a traced tape follows its recorded nodes
(replay_recorded.py), and a hand-written one runs its ops' backward nodes in reverse here: each checkpoint region
is recomputed before its first node and let go after its last (replay_checkpoint.py), and each node between the
engine's hooks (`_run_backward`) brings an offloaded op's saves back (replay_offload.py), makes its inputs'
gradients (a tensor read as equal views gets one piece per view, concatenated by the split's backward once all
are in), hands its parameters' gradients to the engine and sums into gradients already there
(replay_grads.py), frees its outputs' gradients and releases its saved tensors; autocast's weight copy gets its
gradient turned fp32 by a node of its own. `_end_batch` ends either backward: the caller lets go of its outputs
and the batch.
"""

from __future__ import annotations

from ..simulator.events import Category, Phase
from . import replay_template
from .config import dtype_bytes
from .tape import TapeOp


class DerivedBackward:
    """The backward nodes of one micro-batch's forward ops, in reverse (the replay's state: tape, builder, plan,
    saves, live blocks and their reasons, gradients)."""

    def backward(self) -> None:
        replay_template.backward(self, self._backward)

    def _backward(self) -> None:
        if self.tape.backward:
            self._recorded_backward()
            return
        ops = self.tape.ops
        before_op, after_op = self.b.engine.before_op, self.b.engine.after_op
        region_done: set[int] = set()
        for i in range(len(ops) - 1, -1, -1):
            op = ops[i]
            if op.region is not None and op.region not in region_done:
                region_done.add(op.region)
                self._recompute(op.region)
            if self.needs_backward[i]:
                before_op(self, i, Phase.BACKWARD)
                self._run_backward(i, op)
                after_op(self, i, Phase.BACKWARD)
            if op.region is not None and i == self.regions[op.region][0]:
                self._end_region(op.region)
        self._end_batch([])

    def _end_batch(self, frees: list[int]) -> None:
        """The micro-batch's backward is done: the caller drops its outputs and the batch (with `frees`)."""
        for name in self.tape.held:
            self._release(name, frees)
        for t in self.tape.inputs:
            self._release(t.name, frees)
        self.b.op("batch.release", Phase.BACKWARD, self.step, self.mb, [], frees)

    def _run_backward(self, i: int, op: TapeOp) -> None:
        allocs, frees = [], []
        frees += [b.id for b in self._unpack(i)]
        out0 = op.outputs[0]
        grad_out = self.grad_of.get(out0.name)
        views = self.view_reads[i]
        for name in dict.fromkeys(views):
            # e.g. SDPA on (or q k^T and a copy of v from) the q, k, v splits of one projection: one gradient
            # per view, concatenated into the base's gradient by the split's backward once all are in
            spec = self.specs[name]
            pieces = self.view_pieces.setdefault(name, [])
            for _ in range(views.count(name)):
                pieces.append(self.b.block(f"{name}.grad.view{len(pieces)}", spec.nbytes // self.view_count[name],
                                           Category.TEMPORARY, spec.dtype, spec.shape))
                allocs.append(pieces[-1])
        for name in op.inputs:
            if not self.rg.get(name) or name in views:
                continue
            spec = self.specs[name]
            if op.passthrough and grad_out is not None and spec.shape == out0.shape and spec.dtype == out0.dtype:
                # (a mixed-dtype add casts grad_output for its 16-bit input: a new tensor, below)
                if name in self.grad_of:
                    if self.grad_of[name].pinned:  # summed out of place: a new tensor becomes its gradient
                        self._sum_into_pinned(name)
                    continue  # accumulated in place into the existing gradient
                grad_out.refs += 1
                self.grad_of[name] = grad_out
                continue
            blk = self.b.block(f"{name}.grad", spec.nbytes, Category.TEMPORARY, spec.dtype, spec.shape)
            allocs.append(blk)
            self._add_grad(name, blk, frees)
        cast_grads = []  # autocast: the op's gradient of a 16-bit weight copy, turned fp32 by the next node
        for p in op.params:
            if p in op.casts and p in self.trainable:
                cdt = self.b.setup.compute_dtype
                tmp = self.b.block(f"{p}.autocast_copy.grad", self.b.param_numel[p] * dtype_bytes(cdt),
                                   Category.TEMPORARY, cdt, self.b.param_shape[p])
                allocs.append(tmp)
                cast_grads.append((p, tmp))
            else:
                self._param_grad(p, allocs, frees)
        workspace = [self.b.block(w.name, w.nbytes, Category.TEMPORARY, w.dtype, w.shape) for w in op.bwd_workspace]
        allocs += workspace
        frees += [w.id for w in workspace]
        for o in op.outputs:
            storage = self.grad_of.pop(o.name, None)
            if storage is not None:
                storage.refs -= 1
                if storage.refs == 0 and not storage.pinned:
                    frees.append(storage.block.id)
        saved = self.saved_at.get(i, ())
        for s in dict.fromkeys(saved):  # a tensor saved twice goes when its first listing would
            for _ in range(saved.count(s)):
                self._release(s, frees)
        bytes_moved = 2 * sum(a.nbytes for a in allocs)
        self.b.op(f"{op.name}.backward", Phase.BACKWARD, self.step, self.mb, allocs, frees,
                  flops=2 * op.flops, bytes_moved=bytes_moved)
        self._flush_after_node()
        for name in dict.fromkeys(views):
            if len(self.view_pieces[name]) < self.view_count[name]:
                continue  # the split's backward waits for the other views' gradients
            spec, pieces = self.specs[name], self.view_pieces.pop(name)
            allocs, frees = [], []
            blk = self.b.block(f"{name}.grad", spec.nbytes, Category.TEMPORARY, spec.dtype, spec.shape)
            allocs.append(blk)
            self._add_grad(name, blk, frees)
            frees += [p.id for p in pieces]
            self.b.op(f"{op.name}.split.backward", Phase.BACKWARD, self.step, self.mb, allocs, frees,
                      bytes_moved=2 * spec.nbytes)
            self._flush_after_node()
        if cast_grads:  # ToCopyBackward: after the op's node released its saved tensors and grad_output
            allocs, frees = [], []
            for p, tmp in cast_grads:
                self._param_grad(p, allocs, frees)
                frees.append(tmp.id)
            self.b.op(f"{op.name}.autocast_copy.backward", Phase.BACKWARD, self.step, self.mb, allocs, frees,
                      bytes_moved=sum(a.nbytes for a in allocs))
            self._flush_after_node()
