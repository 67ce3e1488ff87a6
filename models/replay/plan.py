"""The replay's plan: what one tape's replay needs to know before it runs, worked out once per tape.

From the tape, the trainable set and which external tensors require grad, `make_plan` derives which tensors
require grad and which ops' backward nodes run, what each op saves, each tensor's last forward use and readers,
the tensors read as equal views (their gradients come in pieces), the checkpoint regions and their inputs, the
outputs selective checkpointing caches, and what outlives its forward use, with the bytes each op reads, the
parameters the tape reads and each GEMM's cuBLAS path: a `ReplayPlan`. Every micro-batch of a tape replays the
same plan: `load_plan` takes it from the builder's cache (`GraphBuilder.replay_plans`) or makes it and stores it
there. Nothing changes the plan afterwards; the passes (forward.py, backward_derived.py, checkpoint.py,
backward_recorded.py) and the engines' hooks only read it (`ReplayState.plan`). `backward_order` is the order the
backward nodes run in, for the engines that plan with it.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...simulator.events import Block
from ..gpu import gemm_takes_cublaslt
from ..tape import Tape, TensorSpec


@dataclass(frozen=True, eq=False, slots=True)
class ReplayPlan:
    """What a tape's replay knows before it runs (module docstring): read only, shared by its micro-batches."""

    needs_backward: list[bool]
    """Per op: whether its backward node runs (a traced tape: whether its recorded backward has the op's node)."""
    rg: dict[str, bool]
    """Per tensor: whether it requires grad."""
    grad_uses: dict[str, int]
    """Per trainable parameter: its gradient contributions in one backward (> 1: a tied weight read by several
    ops); empty for a traced tape, whose recording makes each gradient once."""
    saves: list[tuple[str, ...]]
    """Per op: what its backward node saves (nothing when it has none; a frozen linear's input not)."""
    last_use: dict[str, int]
    """Per tensor: the op whose forward use is its last (a read, or a traced tape's reference kept past it)."""
    readers: dict[str, set[int]]
    """Per tensor: the ops that read it."""
    view_reads: list[tuple[str, ...]]
    """Per op: the tensors its backward gives one gradient piece each (a tensor read as equal views)."""
    view_count: dict[str, int]
    """Per viewed tensor: how many views it is read as in all (its gradient is made when the last piece is in)."""
    regions: dict[int, list[int]]
    """Per checkpoint region: its ops, in order."""
    region_inputs: dict[int, list[str]]
    """Per checkpoint region: the tensors its ops read that none of them makes (held until its backward ends)."""
    cached: set[str]
    """The outputs selective checkpointing keeps from a region's first pass for its recompute."""
    kept_in_forward: set[str]
    """The tensors that outlive their forward use in the first pass (saved, region inputs, cached)."""
    kept_in_recompute: set[str]
    """The tensors that outlive their forward use in a recompute (everything saved)."""
    input_bytes: list[int]
    """Per op: the bytes of the tensors it reads."""
    params: tuple[str, ...]
    """The parameters the tape's ops read, in the order first read."""
    lt: list[bool]
    """Per op: whether its GEMM takes the cuBLASLt path on CUDA (models/gpu.py; the builder adds its workspace)."""
    outputs: dict[str, TensorSpec]
    """The specs of the tensors the tape's ops make, by name (added to each replay's `specs`)."""


def load_plan(builder, tape: Tape, trainable: set[str], external: dict[str, tuple[TensorSpec, Block]],
              specs: dict[str, TensorSpec]) -> tuple[ReplayPlan, tuple | None]:
    """The plan of `tape`'s replay and its key (None: the builder keeps no plans, and so no recordings either:
    template.py), from the builder's cache or made now; the specs of the tape's outputs are added to `specs`
    (which holds the tape's inputs and the external tensors)."""
    # the plan depends on the tape, which external tensors require grad, and what trains: every micro-batch
    # of a tape replays the same one, made once per builder (`GraphBuilder.replay_plans`)
    plans = getattr(builder, "replay_plans", None)
    key = (id(tape), id(trainable),
           tuple((name, spec.requires_grad, spec.nbytes) for name, (spec, _) in external.items()))
    plan_key = key if plans is not None else None  # a pass may be played from a recording of the plan's
    cached = plans.get(key) if plans is not None else None
    if cached is not None and cached[0] is tape and cached[1] is trainable:
        plan = cached[2]
        specs.update(plan.outputs)
        return plan, plan_key
    outputs = {o.name: o for op in tape.ops for o in op.outputs}
    specs.update(outputs)
    plan = make_plan(tape, trainable, external, specs, builder.param_shape, outputs)
    if plans is not None:
        plans[key] = (tape, trainable, plan)
    return plan, plan_key


def make_plan(tape: Tape, trainable: set[str], external: dict[str, tuple[TensorSpec, Block]],
              specs: dict[str, TensorSpec], param_shape: dict[str, tuple], outputs: dict[str, TensorSpec]
              ) -> ReplayPlan:
    """Work out the plan (module docstring): what requires grad, what is saved, last uses, views, regions."""
    ops = tape.ops
    rg: dict[str, bool] = {t.name: False for t in tape.inputs}
    rg.update({name: spec.requires_grad for name, (spec, _) in external.items()})
    needs_backward: list[bool] = []
    for op in ops:
        trainable_param = any(p in trainable for p in op.params)
        upstream = any(rg.get(i, False) for i in op.inputs)
        for o in op.outputs:
            rg[o.name] = o.requires_grad and (trainable_param or upstream)
        needs_backward.append(any(rg[o.name] for o in op.outputs))
    # gradient contributions per parameter in one backward (> 1: a tied weight read by several ops)
    grad_uses: dict[str, int] = {}
    if tape.backward:  # recorded: the ops whose node ran; each gradient is made once (its sums recorded)
        ran = {n.op for n in tape.backward if n.op is not None}
        needs_backward = [i in ran for i in range(len(ops))]
    else:
        for i, op in enumerate(ops):
            if needs_backward[i]:
                for p in dict.fromkeys(op.params):
                    if p in trainable:
                        grad_uses[p] = grad_uses.get(p, 0) + 1
    saves: list[tuple[str, ...]] = []
    for i, op in enumerate(ops):
        op_saves = op.saves if needs_backward[i] else ()
        if op.kind == "linear" and not any(p in trainable for p in op.params):
            op_saves = tuple(s for s in op_saves if s not in op.inputs)  # input only feeds the weight grad
        saves.append(op_saves)
    last_use: dict[str, int] = {}
    readers: dict[str, set[int]] = {}
    for i, op in enumerate(ops):
        for name in op.inputs:
            last_use[name] = i
            readers.setdefault(name, set()).add(i)
    for i, op in enumerate(ops):  # a reference kept past the last read (traced tapes)
        for name in op.releases:
            if last_use.get(name, -1) < i:
                last_use[name] = i
    # views (`TapeOp.views`): per op, the view reads its backward gives one gradient piece each; per
    # tensor, how many views it is read as in all (its gradient is made when the last piece is in)
    marked = {n for op in ops for n in op.views}
    view_reads: list[tuple[str, ...]] = []
    view_count: dict[str, int] = {}
    for i, op in enumerate(ops):
        reads: tuple[str, ...] = ()
        if needs_backward[i]:
            if op.views:
                reads = tuple(n for n in op.views if rg.get(n))
            else:  # unmarked: a tensor this op alone reads k times (SDPA on q, k, v of one projection)
                reads = tuple(n for n in op.inputs if rg.get(n) and n not in marked
                              and op.inputs.count(n) > 1 and readers.get(n) == {i})
        view_reads.append(reads)
        for n in reads:
            view_count[n] = view_count.get(n, 0) + 1
    regions: dict[int, list[int]] = {}
    for i, op in enumerate(ops):
        if op.region is not None:
            regions.setdefault(op.region, []).append(i)
    region_inputs: dict[int, list[str]] = {}
    for r, idxs in regions.items():
        inside = {o.name for i in idxs for o in ops[i].outputs}
        seen: list[str] = []
        for i in idxs:
            for name in ops[i].inputs:
                if name not in inside and name not in seen:
                    seen.append(name)
        region_inputs[r] = seen
    # outputs selective checkpointing keeps from a region's first pass for its recompute
    cached: set[str] = {o.name for op in ops if op.cached and op.region is not None for o in op.outputs}
    # tensors that outlive their forward use in the first pass (recomputed ones always do)
    kept_in_forward: set[str] = {s for i, op_saves in enumerate(saves)
                                 if ops[i].region is None and not ops[i].offloaded for s in op_saves}
    kept_in_forward |= {n for names in region_inputs.values() for n in names}
    kept_in_forward |= cached
    kept_in_recompute: set[str] = {s for op_saves in saves for s in op_saves}
    input_bytes = [sum([specs[n].nbytes for n in op.inputs]) for op in ops]
    params = tuple(dict.fromkeys(p for op in ops for p in op.params))
    # each op's GEMM takes the cuBLASLt path on CUDA (models/gpu.py; the builder adds its workspace)
    lt = [bool(op.flops) and gemm_takes_cublaslt(
        op.kind, [specs[n].shape for n in op.inputs] + [param_shape[p] for p in op.params if p in param_shape],
        op.outputs[0].shape if op.outputs else (), op.outputs[0].dtype if op.outputs else "", op.flops)
        for op in ops]
    return ReplayPlan(needs_backward=needs_backward, rg=rg, grad_uses=grad_uses, saves=saves, last_use=last_use,
                      readers=readers, view_reads=view_reads, view_count=view_count, regions=regions,
                      region_inputs=region_inputs, cached=cached, kept_in_forward=kept_in_forward,
                      kept_in_recompute=kept_in_recompute, input_bytes=input_bytes, params=params, lt=lt,
                      outputs=outputs)


def backward_order(tape: Tape, plan: ReplayPlan) -> list[int]:
    """The forward ops whose backward nodes run, in the order they run (engines plan with it)."""
    if tape.backward:
        return list(dict.fromkeys(n.op for n in tape.backward if n.op is not None))
    return [i for i in range(len(tape.ops) - 1, -1, -1) if plan.needs_backward[i]]
