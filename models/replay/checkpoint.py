"""Activation checkpointing in the replay's backward: a region recomputed before its backward, let go after it.

A checkpoint region (`TapeOp.region`) saves nothing in its first pass but its inputs (held by the region) and,
under selective checkpointing, its cached ops' outputs (forward.py). Right before the region's first backward
node, either backward (backward_derived.py, op by op; backward_recorded.py, node by node) calls `recompute`: the
region's ops run again through forward.py's `run_op` with their saves, up to its last saving op, where torch's
non-reentrant checkpoint stops. After the region's last backward node, `end_region` lets its inputs go, and the
cached outputs the recompute never reused. Both take the replay's state (state.py `ReplayState`).
"""

from __future__ import annotations

from ...simulator.events import Phase
from .forward import run_op
from .state import ReplayState


def recompute(state: ReplayState, region: int) -> None:
    """Checkpoint region `region`'s ops run again with their saves, up to its last saving op."""
    plan, ops = state.plan, state.tape.ops
    idxs = plan.regions[region]
    last_saving = max((i for i in idxs if plan.saves[i] and plan.needs_backward[i]), default=None)
    if last_saving is None:
        return
    todo = [i for i in idxs if i <= last_saving]
    uses: dict[str, int] = {}
    for i in todo:
        for name in ops[i].inputs:
            uses[name] = i
    # region inputs are still live (held by the region); recomputed inputs get a forward-use reason
    for name in list(uses):
        if name in state.live and not any(name == o.name for i in todo for o in ops[i].outputs):
            state.hold(name)
    # torch's non-reentrant checkpoint stops recomputing once every tensor saved in the first pass is
    # saved again; an op that saves only its inputs saves them before it runs, so when the last saving
    # op is one, its own outputs are never recomputed
    last = ops[last_saving]
    early_stop = not set(plan.saves[last_saving]) & {o.name for o in last.outputs}
    before_op, after_op = state.builder.engine.before_op, state.builder.engine.after_op
    for i in todo:
        before_op(state, i, Phase.BACKWARD, recompute=True)
        run_op(state, i, ops[i], recomputing=True, uses=uses, skip_outputs=early_stop and i == last_saving)
        after_op(state, i, Phase.BACKWARD, recompute=True)


def end_region(state: ReplayState, region: int) -> None:
    """A checkpoint region's backward is done: its inputs, and cached outputs never reused, let go."""
    frees: list[int] = []
    for name in state.plan.region_inputs[region]:
        state.release(name, frees)
    for name in sorted(state.cache_pending.pop(region, ())):  # cached, never reused
        state.release(name, frees)
    if frees:
        state.builder.op(f"checkpoint.region{region}.release", Phase.BACKWARD, state.step, state.mb, [], frees)
