"""The backward of a traced tape: the nodes the real autograd engine ran (`Tape.backward`), replayed in order.

A hand-written tape's backward is derived op by op (backward_derived.py `run_node`). A traced tape
(models/traced) carries what the engine really did, node by node: each `GradNode`'s steps allocate the
tensors it made and free those it dropped, in that order (`recorded_backward`). Everything that is not the
model's own goes through the same replay as before: a checkpoint region is recomputed right before its first
node runs (and lets its inputs go after its last: checkpoint.py), an offloaded op's saves come back
(offload.py), saved tensors are released where the node released them, a parameter's gradient is made by the
parallel engine (`.grad`, accumulation into it, sharding: grads.py), and the engines' hooks run around each
node of a forward op. It takes the replay's state (state.py `ReplayState`).
"""

from __future__ import annotations

from ...simulator.events import Block, Category, Phase
from .backward_derived import end_batch
from .checkpoint import end_region, recompute
from .grads import flush_after_node, grads_ready, param_grad
from .offload_streams import unpack_ids
from .state import ReplayState


def recorded_backward(state: ReplayState) -> None:
    """Follow a recorded backward (`Tape.backward`, traced tapes): each node's steps in the order the real
    engine ran them; a checkpoint region is recomputed right before its first node, and its inputs let go
    after its last; parameter gradients go through the engine (`.grad`, accumulation, sharding)."""
    ops, builder = state.tape.ops, state.builder
    engine = builder.engine
    born: dict[str, Block] = {}
    region_last: dict[int, int] = {}
    for k, node in enumerate(state.tape.backward):
        if node.op is not None and ops[node.op].region is not None:
            region_last[ops[node.op].region] = k
    region_done: set[int] = set()
    for k, node in enumerate(state.tape.backward):
        i = node.op
        region = ops[i].region if i is not None else None
        if region is not None and region not in region_done:
            region_done.add(region)
            recompute(state, region)
        if i is not None:
            engine.before_op(state, i, Phase.BACKWARD)
        unpacked = unpack_ids(state, i) if i is not None else []
        for s, step in enumerate(node.steps):
            allocs, frees = [], []
            for t in step.allocs:
                born[t.name] = state.new_block(t, Category.TEMPORARY)
                allocs.append(born[t.name])
            for p in step.grads:
                param_grad(state, p, allocs, frees)
            frees += [born.pop(n).id for n in step.frees]
            if step.release_saved and i is not None:
                frees += unpacked
                saved = state.saved_at.get(i, ())
                for name in saved:
                    state.release(name, frees)
            suffix = f".{s}" if len(node.steps) > 1 else ""
            builder.op(f"{node.name}{suffix}", Phase.BACKWARD, state.step, state.mb, allocs, frees,
                       flops=node.flops if s == 0 else 0, bytes_moved=2 * sum(a.nbytes for a in allocs))
            grads_ready(state)
            if state.after_node and getattr(builder, "cpu_offload", None) is not None:
                flush_after_node(state)  # torchao's gradient hooks (models/offload_libraries.py)
        if i is not None:
            engine.after_op(state, i, Phase.BACKWARD)
        if region is not None and region_last[region] == k:
            end_region(state, region)
    end_batch(state, [blk.id for blk in born.values()])
