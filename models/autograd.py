"""Replay a forward tape the way torch's autograd does, and emit the simulator's ops.

Memory in torch is freed when the last reference goes. Here each tensor has a count of the reasons it
is still alive, and is freed at the end of the op that drops the last one:

- forward use: released by the last forward op that reads it (or by its producer if nothing reads it);
- saved for backward: one per saving op, released when that op's backward node has run;
- held by the caller (logits, the batch): released when the micro-batch's backward ends;
- activation checkpointing: a region's inputs are held until the region's backward is done; inside a
  region nothing is saved in the forward pass, and the region is recomputed (with saves) right before
  its backward, up to its last saving op (torch's non-reentrant checkpoint stops once everything saved
  is saved again; an op that saves only its inputs is not run at all).
- selective activation checkpointing (`TapeOp.cached`, policy "op-policy"): the region's first pass
  also keeps the outputs of its cached ops (torch's SAC storage holds them); the recompute hands
  them back instead of running the op (no FLOPs, no allocation; autocast's weight casts and the node's
  saves still happen) and lets go of them. Outputs the early stop never reaches stay held until the
  region's backward is done.
- autocast's weight cache: a 16-bit copy of a trainable parameter (`TapeOp.casts`) made in the forward
  pass stays in autocast's cache until the forward ends, saved or not (a linear's bias copy is never
  saved; nothing saves the weight copy of a checkpointed or offloaded op); the copies a recompute makes
  live only as long as their saves.
- offloading (`TapeOp.offloaded`, policy "offload", `torch.autograd.graph.save_on_cpu`): each tensor an
  op saves (its saved parameters and autocast weight copies too, a view by its own size) is copied as
  it is saved into a new host block, one per save; the device tensor gets no saved reason, so it goes
  with its last forward use. On a GPU profile the copies are in `Pool.HOST`, and the backward node
  first copies each back into a new device block that lives for that node only. On a CPU profile host
  and device are one memory: the copies stay in the one pool, and the backward reads them as they are.

Gradients flow in reverse: a backward node allocates the gradients of its inputs (an add hands its
grad_output on unchanged), frees the gradients of its outputs, and releases its saved tensors.
A parameter's gradient becomes `.grad` when it is its first contribution in the step; later
contributions (more micro-batches, `set_to_none=False`) are temporaries accumulated in place. A tied
weight's contributions within one backward are summed out of place in its AccumulateGrad node's input
buffer first (`Engine.param_grad`).
A tensor read as equal views (`TapeOp.views`: q, k and v split from one projection, read by one op or
by several) gets one view-sized gradient piece from each view's backward node; its own gradient is made
(SplitBackward's concatenation, the pieces then freed) right after the node that gives the last piece.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..simulator.events import Block, Category, Phase
from . import replay_template
from .config import dtype_bytes
from .gpu import gemm_takes_cublaslt
from .replay_offload import OffloadedSaves
from .replay_recorded import RecordedBackward
from .tape import Tape, TapeOp, TensorSpec


@dataclass
class GradState:
    """Which parameters hold a `.grad` block right now (persists across micro-batches and steps)."""

    blocks: dict[str, Block] = field(default_factory=dict)
    persistent: bool = False  # fp32 main-grad buffers allocated at load: every contribution is a temporary


class _Storage:
    """An activation gradient's memory, shared by the tensors an add hands it to. A `pinned` one is owned
    outside the replay (a pipeline stage's gradient receive buffer): never freed here, and a gradient summed
    into it is summed out of place (autograd's input buffer adds in place only into a tensor it holds the
    last reference to: torch/csrc/autograd/input_buffer.cpp `can_accumulate_inplace`)."""

    def __init__(self, block: Block, refs: int = 1, pinned: bool = False) -> None:
        self.block = block
        self.refs = refs
        self.pinned = pinned


def replace_grad(replay, tensor: str, block: Block) -> list[int]:
    """`block` becomes `tensor`'s gradient (a new storage of its own); the old storage's block id, in a list, when
    that was its last reference, else an empty list (the engines' hooks that make a gradient anew: DTensor's
    all-reduce and out-of-place sum, the backward of a slice)."""
    storage = replay.grad_of[tensor]
    storage.refs -= 1
    replay.grad_of[tensor] = _Storage(block)
    return [storage.block.id] if storage.refs == 0 else []


PLAN = ("needs_backward", "rg", "grad_uses", "saves", "last_use", "readers", "view_reads", "view_count", "regions",
        "region_inputs", "cached", "kept_in_forward", "kept_in_recompute",  # what `_plan` sets (read-only after)
        # and the bytes each op reads, the parameters its ops read, their GEMMs' path
        "input_bytes", "plan_params", "lt")


class MicroBatchReplay(RecordedBackward, OffloadedSaves):
    """Emit forward and backward ops for one micro-batch of a tape, through a `builder` (training.py); a traced
    tape's backward follows its recording (replay_recorded.py), offloaded saves go through save_on_cpu's hooks
    (replay_offload.py), and a pass the plan's first replay recorded is played from that recording where the
    engine's hooks allow it (replay_template.py)."""

    def __init__(self, builder, tape: Tape, step: int, micro_batch: int, grads: GradState,
                 external: dict[str, tuple[TensorSpec, Block]] | None = None) -> None:
        """`external`: tensors the tape reads that exist outside this replay (a pipeline stage's received
        activation, the views of a whole batch), with their blocks: read and saved, never freed here."""
        self.b = builder
        self.external = external or {}
        self.tape = tape
        self.step = step
        self.mb = micro_batch
        self.grads = grads
        self.trainable = builder.trainable
        self.specs: dict[str, TensorSpec] = {t.name: t for t in tape.inputs}
        self.specs.update({name: spec for name, (spec, _) in self.external.items()})
        self.live: dict[str, Block] = {}
        self.reasons: dict[str, int] = {}
        self.grad_of: dict[str, _Storage] = {}
        self.saved_at: dict[int, tuple[str, ...]] = {}  # what each op's backward node holds
        self.contributed: set[str] = set()  # parameters with a gradient contribution in this backward
        self.grad_seen: dict[str, int] = {}  # contributions so far of a parameter read by several ops
        self.grad_buffer: dict[str, Block] = {}  # its AccumulateGrad input buffer (the sum so far)
        self.grad_had: dict[str, bool] = {}  # whether it had a `.grad` when its first contribution came
        self.after_node: list[tuple[str, list, list]] = []  # input-buffer sums to emit once a node is done
        self.autocast_cache: list[str] = []  # weight casts autocast keeps until the forward pass ends
        self.view_pieces: dict[str, list[Block]] = {}  # the pieces of a viewed tensor's gradient in so far
        self.cache_pending: dict[int, set[str]] = {}  # region -> cached outputs its recompute has not reused yet
        # the plan depends on the tape, which external tensors require grad, and what trains: every micro-batch
        # of a tape replays the same one, made once per builder (`GraphBuilder.replay_plans`)
        plans = getattr(builder, "replay_plans", None)
        key = (id(tape), id(self.trainable),
               tuple((name, spec.requires_grad, spec.nbytes) for name, (spec, _) in self.external.items()))
        self.plan_key = key if plans is not None else None  # a pass may be played from a recording of the plan's
        self.template = self.tab = self.tab_index = None  # (models/replay_template.py)
        cached = plans.get(key) if plans is not None else None
        if cached is not None and cached[0] is tape and cached[1] is self.trainable:
            self.specs.update(cached[2])
            self.__dict__.update(cached[3])
        else:
            outputs = {o.name: o for op in tape.ops for o in op.outputs}
            self.specs.update(outputs)
            self._plan()
            specs = self.specs
            self.input_bytes = [sum([specs[n].nbytes for n in op.inputs]) for op in tape.ops]
            self.plan_params = tuple(dict.fromkeys(p for op in tape.ops for p in op.params))
            shape = builder.param_shape
            # each op's GEMM takes the cuBLASLt path on CUDA (models/gpu.py; the builder adds its workspace)
            self.lt = [bool(op.flops) and gemm_takes_cublaslt(
                op.kind, [specs[n].shape for n in op.inputs] + [shape[p] for p in op.params if p in shape],
                op.outputs[0].shape if op.outputs else (), op.outputs[0].dtype if op.outputs else "", op.flops)
                for op in tape.ops]
            if plans is not None:
                plans[key] = (tape, self.trainable, outputs, {name: getattr(self, name) for name in PLAN})

    # -- planning: what requires grad, what is saved, last uses, regions ---------------------------
    def _plan(self) -> None:
        ops = self.tape.ops
        rg: dict[str, bool] = {t.name: False for t in self.tape.inputs}
        rg.update({name: spec.requires_grad for name, (spec, _) in self.external.items()})
        self.needs_backward: list[bool] = []
        for op in ops:
            trainable_param = any(p in self.trainable for p in op.params)
            upstream = any(rg.get(i, False) for i in op.inputs)
            for o in op.outputs:
                rg[o.name] = o.requires_grad and (trainable_param or upstream)
            self.needs_backward.append(any(rg[o.name] for o in op.outputs))
        self.rg = rg
        # gradient contributions per parameter in one backward (> 1: a tied weight read by several ops)
        self.grad_uses: dict[str, int] = {}
        if self.tape.backward:  # recorded: the ops whose node ran; each gradient is made once (its sums recorded)
            ran = {n.op for n in self.tape.backward if n.op is not None}
            self.needs_backward = [i in ran for i in range(len(ops))]
        else:
            for i, op in enumerate(ops):
                if self.needs_backward[i]:
                    for p in dict.fromkeys(op.params):
                        if p in self.trainable:
                            self.grad_uses[p] = self.grad_uses.get(p, 0) + 1
        self.saves: list[tuple[str, ...]] = []
        for i, op in enumerate(ops):
            saves = op.saves if self.needs_backward[i] else ()
            if op.kind == "linear" and not any(p in self.trainable for p in op.params):
                saves = tuple(s for s in saves if s not in op.inputs)  # input only feeds the weight grad
            self.saves.append(saves)
        self.last_use: dict[str, int] = {}
        self.readers: dict[str, set[int]] = {}
        for i, op in enumerate(ops):
            for name in op.inputs:
                self.last_use[name] = i
                self.readers.setdefault(name, set()).add(i)
        for i, op in enumerate(ops):  # a reference kept past the last read (traced tapes)
            for name in op.releases:
                if self.last_use.get(name, -1) < i:
                    self.last_use[name] = i
        # views (`TapeOp.views`): per op, the view reads its backward gives one gradient piece each; per
        # tensor, how many views it is read as in all (its gradient is made when the last piece is in)
        marked = {n for op in ops for n in op.views}
        self.view_reads: list[tuple[str, ...]] = []
        self.view_count: dict[str, int] = {}
        for i, op in enumerate(ops):
            reads: tuple[str, ...] = ()
            if self.needs_backward[i]:
                if op.views:
                    reads = tuple(n for n in op.views if rg.get(n))
                else:  # unmarked: a tensor this op alone reads k times (SDPA on q, k, v of one projection)
                    reads = tuple(n for n in op.inputs if rg.get(n) and n not in marked
                                  and op.inputs.count(n) > 1 and self.readers.get(n) == {i})
            self.view_reads.append(reads)
            for n in reads:
                self.view_count[n] = self.view_count.get(n, 0) + 1
        self.regions: dict[int, list[int]] = {}
        for i, op in enumerate(ops):
            if op.region is not None:
                self.regions.setdefault(op.region, []).append(i)
        self.region_inputs: dict[int, list[str]] = {}
        for r, idxs in self.regions.items():
            inside = {o.name for i in idxs for o in ops[i].outputs}
            seen: list[str] = []
            for i in idxs:
                for name in ops[i].inputs:
                    if name not in inside and name not in seen:
                        seen.append(name)
            self.region_inputs[r] = seen
        # outputs selective checkpointing keeps from a region's first pass for its recompute
        self.cached: set[str] = {o.name for op in ops if op.cached and op.region is not None for o in op.outputs}
        # tensors that outlive their forward use in the first pass (recomputed ones always do)
        self.kept_in_forward: set[str] = {s for i, saves in enumerate(self.saves)
                                          if ops[i].region is None and not ops[i].offloaded for s in saves}
        self.kept_in_forward |= {n for names in self.region_inputs.values() for n in names}
        self.kept_in_forward |= self.cached
        self.kept_in_recompute: set[str] = {s for saves in self.saves for s in saves}

    def _effective_saves(self, i: int, recomputing: bool) -> tuple[str, ...]:
        op = self.tape.ops[i]
        if op.region is not None and not recomputing:
            return ()
        return self.saves[i]

    # -- blocks --------------------------------------------------------------------------------------
    def _new_block(self, spec: TensorSpec, category: Category, name: str | None = None) -> Block:
        return self.b.block(name or spec.name, spec.nbytes, category, spec.dtype, spec.shape)

    def _hold(self, name: str, n: int = 1) -> None:
        self.reasons[name] = self.reasons.get(name, 0) + n

    def _release(self, name: str, frees: list[int]) -> None:
        self.reasons[name] -= 1
        if self.reasons[name] == 0 and name in self.live:
            frees.append(self.live.pop(name).id)

    # -- forward ------------------------------------------------------------------------------------
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

    # -- backward -----------------------------------------------------------------------------------
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

    def _end_region(self, region: int) -> None:
        """A checkpoint region's backward is done: its inputs, and cached outputs never reused, let go."""
        frees: list[int] = []
        for name in self.region_inputs[region]:
            self._release(name, frees)
        for name in sorted(self.cache_pending.pop(region, ())):  # cached, never reused
            self._release(name, frees)
        if frees:
            self.b.op(f"checkpoint.region{region}.release", Phase.BACKWARD, self.step, self.mb, [], frees)

    def _end_batch(self, frees: list[int]) -> None:
        """The micro-batch's backward is done: the caller drops its outputs and the batch (with `frees`)."""
        for name in self.tape.held:
            self._release(name, frees)
        for t in self.tape.inputs:
            self._release(t.name, frees)
        self.b.op("batch.release", Phase.BACKWARD, self.step, self.mb, [], frees)

    def _recompute(self, region: int) -> None:
        idxs = self.regions[region]
        last_saving = max((i for i in idxs if self.saves[i] and self.needs_backward[i]), default=None)
        if last_saving is None:
            return
        todo = [i for i in idxs if i <= last_saving]
        uses: dict[str, int] = {}
        for i in todo:
            for name in self.tape.ops[i].inputs:
                uses[name] = i
        # region inputs are still live (held by the region); recomputed inputs get a forward-use reason
        for name in list(uses):
            if name in self.live and not any(name == o.name for i in todo for o in self.tape.ops[i].outputs):
                self._hold(name)
        # torch's non-reentrant checkpoint stops recomputing once every tensor saved in the first pass is
        # saved again; an op that saves only its inputs saves them before it runs, so when the last saving
        # op is one, its own outputs are never recomputed
        last = self.tape.ops[last_saving]
        early_stop = not set(self.saves[last_saving]) & {o.name for o in last.outputs}
        before_op, after_op = self.b.engine.before_op, self.b.engine.after_op
        for i in todo:
            before_op(self, i, Phase.BACKWARD, recompute=True)
            self._run_forward(i, self.tape.ops[i], recomputing=True, uses=uses,
                              skip_outputs=early_stop and i == last_saving)
            after_op(self, i, Phase.BACKWARD, recompute=True)

    def _param_grad(self, p: str, allocs: list, frees: list) -> None:
        if p in self.trainable:
            self.b.engine.param_grad(self, p, allocs, frees)

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

    def _add_grad(self, name: str, blk: Block, frees: list[int]) -> None:
        """`blk`, a new gradient of `name`, becomes its gradient, or is summed into the one there: in place (`blk`
        goes with the node), or into a pinned one out of place (`_sum_into_pinned`)."""
        storage = self.grad_of.get(name)
        if storage is None:
            self.grad_of[name] = _Storage(blk)
        elif storage.pinned:
            self._sum_into_pinned(name, blk)
        else:
            frees.append(blk.id)  # summed into the gradient already there

    def _sum_into_pinned(self, name: str, contribution: Block | None = None) -> None:
        """A gradient summed into `name`'s pinned gradient: out of place, once the node that made it is done
        (the engine adds a node's outputs to the next input buffers then), the sum a new tensor that becomes
        `name`'s gradient; the contribution goes with it (one handed on unchanged, `None`, stays its node's)."""
        spec = self.specs[name]
        total = self.b.block(f"{name}.grad_sum", spec.nbytes, Category.TEMPORARY, spec.dtype, spec.shape)
        self.after_node.append((f"{name}.grad_accumulate", [total], [contribution.id] if contribution else []))
        self.grad_of[name].refs -= 1
        self.grad_of[name] = _Storage(total)

    def receive_grad(self, name: str, block: Block) -> None:
        """`name`'s gradient arrives from outside the replay, in `block` (a pipeline stage's gradient receive
        buffer, its owner's for good): pinned, before `backward()`."""
        self.grad_of[name] = _Storage(block, pinned=True)

    def take_grad(self, name: str) -> Block | None:
        """The gradient the backward left for `name`, a tensor no op of the tape made (a pipeline stage's
        received input): handed to the caller, who frees it."""
        storage = self.grad_of.pop(name, None)
        return None if storage is None or storage.pinned else storage.block

    def _flush_after_node(self) -> None:
        """Out-of-place sums in AccumulateGrad input buffers (tied weights), after the node that fed them."""
        for name, allocs, frees in self.after_node:
            self.b.op(name, Phase.BACKWARD, self.step, self.mb, allocs, frees,
                      bytes_moved=3 * sum(a.nbytes for a in allocs))
        self.after_node.clear()

    def run(self) -> None:
        self.forward()
        if self.b.setup.passes == "forward":
            self.drop_output()
        else:
            self.backward()

    def drop_output(self) -> None:
        """A forward-only pass (`passes` "forward") ends: the caller drops `out`, and with it the autograd graph
        and everything it saved; the batch goes too."""
        frees = [blk.id for blk in self.live.values()]
        self.live.clear()
        self.reasons.clear()
        self.b.op("output.release", Phase.FORWARD, self.step, self.mb, [], frees)


def param_bytes(numel: int, dtype: str, shard: int = 1) -> int:
    """Bytes of one rank's shard of a tensor: ceil(numel / shard) elements (uneven shards are padded)."""
    return -(-numel // shard) * dtype_bytes(dtype)
