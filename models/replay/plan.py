"""The replay's plan: what one tape's replay needs to know before it runs, worked out once per tape.

Mixed into models/autograd.py's `MicroBatchReplay` (`ReplayPlan`). From the tape, the trainable set and which
external tensors require grad, `_plan` derives which tensors require grad and which ops' backward nodes run, what
each op saves, each tensor's last forward use and readers, the tensors read as equal views (their gradients come
in pieces), the checkpoint regions and their inputs, the outputs selective checkpointing caches, and what outlives
its forward use (`PLAN` names them all, with the bytes each op reads, the parameters the tape reads and each
GEMM's cuBLAS path). Every micro-batch of a tape replays the same plan: `_load_plan` takes it from the builder's
cache (`GraphBuilder.replay_plans`) or makes it and stores it there. Nothing changes the plan afterwards; the
passes (replay_forward.py, replay_backward.py, replay_checkpoint.py, replay_recorded.py) only read it.
"""

from __future__ import annotations

from .gpu import gemm_takes_cublaslt

PLAN = ("needs_backward", "rg", "grad_uses", "saves", "last_use", "readers", "view_reads", "view_count", "regions",
        "region_inputs", "cached", "kept_in_forward", "kept_in_recompute",  # what `_plan` sets (read-only after)
        # and the bytes each op reads, the parameters its ops read, their GEMMs' path
        "input_bytes", "plan_params", "lt")


class ReplayPlan:
    """Making (or taking from the builder's cache) the plan of the replay's tape (its state: builder, tape,
    trainable set, external tensors, specs)."""

    def _load_plan(self) -> None:
        """The plan's fields set on the replay (and the specs of the tape's outputs), from the builder's cache
        or made now; the plan's key, and no recording yet (models/replay_template.py)."""
        builder, tape = self.b, self.tape
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
