"""Activation checkpointing in the replay's backward: a region recomputed before its backward, let go after it.

Mixed into models/autograd.py's `MicroBatchReplay` (`CheckpointRegions`). A checkpoint region (`TapeOp.region`)
saves nothing in its first pass but its inputs (held by the region) and, under selective checkpointing, its
cached ops' outputs (replay_forward.py). Right before the region's first backward node, either backward
(replay_backward.py, op by op; replay_recorded.py, node by node) calls `_recompute`: the region's ops run again
through `_run_forward` with their saves, up to its last saving op, where torch's non-reentrant checkpoint stops.
After the region's last backward node, `_end_region` lets its inputs go, and the cached outputs the recompute
never reused.
"""

from __future__ import annotations

from ..simulator.events import Phase


class CheckpointRegions:
    """A checkpoint region's recompute and release (the replay's state: tape, builder, plan, live blocks and their
    reasons, `cache_pending`)."""

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

    def _end_region(self, region: int) -> None:
        """A checkpoint region's backward is done: its inputs, and cached outputs never reused, let go."""
        frees: list[int] = []
        for name in self.region_inputs[region]:
            self._release(name, frees)
        for name in sorted(self.cache_pending.pop(region, ())):  # cached, never reused
            self._release(name, frees)
        if frees:
            self.b.op(f"checkpoint.region{region}.release", Phase.BACKWARD, self.step, self.mb, [], frees)
